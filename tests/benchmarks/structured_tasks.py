"""The prompts and schemas of `make bench-structured` (tests/benchmarks/structured.py),
and how an answer is judged against its schema: strictly (the whole text is the JSON)
and leniently (the first fenced ```json block counts)."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

import jsonschema


@dataclass(frozen=True)
class Task:
    """A schema and the prompts that ask for it."""

    name: str
    schema: dict
    ask: str  # with {subject}
    keys: str
    subjects: tuple[str, ...]

    def prompt(self, subject: str) -> str:
        return f"{self.ask.format(subject=subject)} Reply with only a JSON object with {self.keys}."


def _object(properties: dict, required: Sequence[str] | None = None) -> dict:
    return {
        "type": "object",
        "properties": properties,
        "required": list(required if required is not None else properties),
        "additionalProperties": False,
    }


TASKS = (
    Task(
        "flat",
        _object(
            {
                "name": {"type": "string", "maxLength": 40},
                "age": {"type": "integer", "minimum": 0},
                "city": {"type": "string", "maxLength": 40},
            }
        ),
        "Invent a character: {subject}.",
        'the keys "name" (a string), "age" (an integer) and "city" (a string)',
        (
            "a retired sailor from Lisbon",
            "a young violinist in Vienna",
            "a baker who opens at dawn",
            "a programmer from Osaka",
            "a lighthouse keeper",
            "a teacher in a mountain village",
            "a chess champion",
            "a nurse on night shifts",
            "a street musician",
            "a beekeeper",
            "a taxi driver in Cairo",
            "a marine biologist",
            "a librarian who loves maps",
        ),
    ),
    Task(
        "nested",
        _object(
            {
                "title": {"type": "string", "maxLength": 60},
                "year": {"type": "integer"},
                "author": _object(
                    {"name": {"type": "string", "maxLength": 40}, "born": {"type": "integer"}}
                ),
            }
        ),
        "Invent a book about {subject}.",
        'the keys "title" (a string), "year" (an integer) and "author", an object with '
        '"name" (a string) and "born" (an integer)',
        (
            "the history of bridges",
            "a cat who learns to fly",
            "cooking with seaweed",
            "the first trip to Mars",
            "a detective in Venice",
            "growing tomatoes",
            "the life of bees",
            "a lost city in the desert",
            "learning to play chess",
            "an old clockmaker",
            "the northern lights",
            "a friendly robot",
            "the invention of paper",
        ),
    ),
    Task(
        "enum",
        _object(
            {
                "task": {"type": "string", "maxLength": 60},
                "priority": {"enum": ["low", "medium", "high"]},
                "done": {"type": "boolean"},
            }
        ),
        "Write a to-do item for this job: {subject}.",
        'the keys "task" (a string), "priority" (one of "low", "medium" or "high") and '
        '"done" (true or false)',
        (
            "paying the electricity bill",
            "watering the plants",
            "fixing a leaking roof",
            "booking a dentist appointment",
            "returning library books",
            "renewing a passport",
            "buying a birthday present",
            "cleaning the garage",
            "backing up the laptop",
            "replacing a smoke alarm battery",
            "calling grandmother",
            "filing the tax return",
        ),
    ),
    Task(
        "array",
        _object(
            {
                "dish": {"type": "string", "maxLength": 40},
                "ingredients": {
                    "type": "array",
                    "items": {"type": "string", "maxLength": 30},
                    "minItems": 2,
                    "maxItems": 5,
                },
                "minutes": {"type": "integer", "minimum": 1},
            }
        ),
        "Suggest a recipe for {subject}.",
        'the keys "dish" (a string), "ingredients" (a list of 2 to 5 strings) and '
        '"minutes" (an integer)',
        (
            "a quick breakfast",
            "a cold summer day",
            "a vegetarian dinner",
            "a birthday cake",
            "a rainy evening",
            "a picnic",
            "using leftover rice",
            "a spicy soup",
            "two people in ten minutes",
            "a school lunch box",
            "a winter stew",
            "a fruit dessert",
        ),
    ),
)


@dataclass(frozen=True)
class Case:
    """One prompt: its task, text and seed."""

    task: Task
    subject: str
    seed: int


def cases(smoke: bool) -> list[Case]:
    """The 50 prompts (smoke: the first of each task), each with its own seed."""
    subjects = [
        (task, s) for task in TASKS for s in (task.subjects[:1] if smoke else task.subjects)
    ]
    return [Case(task, subject, seed) for seed, (task, subject) in enumerate(subjects)]


# ---------------------------------------------------------------- validity

FENCED = re.compile(r"```(?:json)?[ \t]*\n?(.*?)```", re.S)


def check(text: str, schema: dict) -> dict:
    """Strict: the whole text is JSON (and fits the schema); fenced: else the first
    ```json block is."""

    def parse(candidate: str) -> tuple[bool, bool]:
        try:
            value = json.loads(candidate)
        except ValueError:
            return False, False
        try:
            jsonschema.validate(value, schema)
        except jsonschema.ValidationError:
            return True, False
        return True, True

    strict_json, strict_schema = parse(text)
    fenced_json, fenced_schema = strict_json, strict_schema
    if not strict_json:
        block = FENCED.search(text)
        if block is not None:
            fenced_json, fenced_schema = parse(block.group(1))
    return {
        "json": strict_json,
        "schema": strict_schema,
        "json_or_fenced": fenced_json,
        "schema_or_fenced": fenced_schema,
    }
