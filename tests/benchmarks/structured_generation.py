"""JSONSchemaBench schemas with the bundled model, per grammar backend, for
`make bench-structured`.

For each schema of the subset a backend compiles, one chat prompt asks for an
example of it, with the schema's text in the prompt (`PROMPT`); the answer is
generated under that schema with greedy decoding (temperature 0: the same model,
so the two backends' answers differ only where their masks do). All requests of
a backend go to one fresh engine, which steps until they finish (continuous
batching). An answer counts when it finished "stop" and its text is JSON that
`jsonschema`'s Draft202012Validator, formats checked, accepts; one that finished
"stop" and is not is a soundness bug of the backend (MASK-SOUND-1) and is listed.

On a shared 2-core CPU a prompt holding a schema of several kilobytes makes every
step of the batch slow, so the bench caps the schemas (`select`): the same ones for
both backends, those both compile, the first `per_set` of each set whose text is
at most `max_bytes`; the results file says so.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections import Counter

from jsonschema import Draft202012Validator

from decodespec.reference.engine import Engine
from decodespec.reference.grammar import StructuredOutput
from decodespec.reference.request_options import RequestOptions
from decodespec.spec.params import SamplingParams

PROMPT = "Give an example JSON object that follows this JSON Schema:\n{schema}"
CACHE_TOKENS = 65_536  # the KV cache: every request of a backend's batch fits at once


def select(
    schemas: dict[str, object], compiled: dict[str, list[str]], per_set: int, max_bytes: int
) -> list[str]:
    """The schemas every backend compiles, at most `per_set` of each set (in the file's
    order) whose JSON text is at most `max_bytes` long."""
    everywhere = set.intersection(*(set(keys) for keys in compiled.values()))
    taken: Counter = Counter()
    keys = []
    for key, schema in schemas.items():
        name = key.split("/")[0]
        if key in everywhere and len(json.dumps(schema)) <= max_bytes and taken[name] < per_set:
            taken[name] += 1
            keys.append(key)
    return keys


def prompt_ids(tokenizer: object, schema: object) -> list[int]:
    text = PROMPT.format(schema=json.dumps(schema))
    return tokenizer.encode(
        tokenizer.apply_chat_template([{"role": "user", "content": text}]),
        add_special_tokens=False,
    )


def looping(text: str, tail: int = 60, longest: int = 24) -> bool:
    """Whether `text` ends in a loop: its last `tail` characters repeat one unit of at
    most `longest` characters (`"10, 10, 10, "`, `"TypeTypeType"`), which no larger
    max_tokens would end."""
    end = text[-tail:]
    if len(end) < tail:
        return False
    return any(end == (end[:p] * (tail // p + 1))[:tail] for p in range(1, longest + 1))


def judge(text: str, schema: object) -> tuple[bool, str | None]:
    """Whether `text` is JSON valid under `schema` (draft 2020-12, formats checked), and
    why not."""
    try:
        value = json.loads(text)
    except ValueError as error:
        return False, f"not JSON: {error}"
    validator = Draft202012Validator(schema, format_checker=Draft202012Validator.FORMAT_CHECKER)
    error = next(iter(validator.iter_errors(value)), None)
    if error is None:
        return True, None
    where = "/" + "/".join(str(p) for p in error.absolute_path)
    return False, f"at {where}: {error.message[:200]}"


def generate(
    weights: object,
    tokenizer: object,
    backend: str,
    schemas: dict[str, object],
    keys: list[str],
    max_tokens: int,
    engine_backend: str,
) -> dict:
    """One constrained, greedy answer per schema of `keys` under `backend`, all in one
    engine: finish reasons, schema-valid and stopped, and any stopped answer that is
    not valid."""
    engine = Engine(
        weights,
        tokenizer,
        backend=engine_backend,
        seed=0,
        grammar_backend=backend,
        cache_tokens=CACHE_TOKENS,
    )
    start = time.perf_counter()
    ids, prompt_tokens = {}, 0
    for key in keys:
        prompt = prompt_ids(tokenizer, schemas[key])
        prompt_tokens += len(prompt)
        ids[key] = engine.add_request(
            prompt,
            SamplingParams(temperature=0.0, max_tokens=max_tokens),
            RequestOptions(
                structured_output=StructuredOutput.json_schema(schemas[key], field="bench")
            ),
        )
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        if steps % 50 == 0:
            print(
                f"    {backend}: step {steps}, {time.perf_counter() - start:.0f} s",
                file=sys.stderr,
                flush=True,
            )
    wall_s = time.perf_counter() - start
    answers = {}
    for key, request in ids.items():
        output = engine.output(request)
        valid, why = judge(output.text, schemas[key])
        answers[key] = {
            "finish_reason": output.finish_reason,
            "valid": valid,
            "tokens": len(output.token_ids),
            "why_invalid": why,
            "looping": output.finish_reason == "length" and looping(output.text),
            "text": output.text[:300],
        }
    return summarize(answers, prompt_tokens, steps, wall_s)


def summarize(answers: dict[str, dict], prompt_tokens: int, steps: int, wall_s: float) -> dict:
    n = len(answers)
    stopped = [a for a in answers.values() if a["finish_reason"] == "stop"]
    good = [a for a in stopped if a["valid"]]
    stopped_tokens = [a["tokens"] for a in stopped]
    return {
        "requests": n,
        "valid_and_stop": len(good),
        "valid_and_stop_rate": len(good) / n if n else None,
        "valid_rate": sum(a["valid"] for a in answers.values()) / n if n else None,
        "finish_reasons": dict(Counter(a["finish_reason"] for a in answers.values())),
        "stop_but_invalid": [
            {"schema": key, "why": a["why_invalid"], "text": a["text"]}
            for key, a in answers.items()
            if a["finish_reason"] == "stop" and not a["valid"]
        ],
        "length_looping": sum(a["looping"] for a in answers.values()),
        "stopped_tokens_median": statistics.median(stopped_tokens) if stopped_tokens else None,
        "stopped_tokens_max": max(stopped_tokens) if stopped_tokens else None,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": sum(a["tokens"] for a in answers.values()),
        "steps": steps,
        "wall_s": wall_s,
        "answers": answers,
    }
