"""`decodespec check`'s checks: the spec's observable clauses through the OpenAI API.

Each check is a function of a `Context` registered with the clause it observes.
It returns an `Outcome`: "pass", "fail" (with the evidence: the requests and
excerpts of the responses), or "not supported" (the server refused a parameter
with a 4xx, or does not return what the check needs). A 5xx answer to a valid
request is a fail: the server broke, it did not decline; so is a 200 that is
not the API's shape, with its body in the detail and the evidence. Checks of a
single answer live here; checks of the sampling distribution in
`check_sampling.py`; the teacher-forced comparison with the spec's forward pass
in `check_weights.py`.

The checks use only what the API returns: texts, finish reasons, usage, and the
logprobs the server itself reports (both the legacy completions form and the
chat form are read). Nothing assumes an extension is there: `top_k` and
`min_p` are tried, and a refusal is reported as such.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import jsonschema

from .check_client import BRIEF_CHARS, BudgetExhaustedError, Client, Exchange

PROMPT = "The capital of France is"
STORY = "Once upon a time, in a small village by the sea,"
LOAD_PROMPTS = (
    "The three primary colors are",
    "To make a cup of tea, first",
    "The largest planet in our solar system is",
    "In computer science, a linked list is",
    "Water boils at a temperature of",
    "The first step in learning to swim is",
)


@dataclass
class Outcome:
    outcome: str  # "pass", "fail", "not supported"
    detail: str
    evidence: list[dict] = field(default_factory=list)


def passed(detail: str, *exchanges: Exchange) -> Outcome:
    return Outcome("pass", detail, [e.evidence() for e in exchanges])


def failed(detail: str, *exchanges: Exchange) -> Outcome:
    return Outcome("fail", detail, [e.evidence() for e in exchanges])


def unsupported(detail: str, *exchanges: Exchange) -> Outcome:
    return Outcome("not supported", detail, [e.evidence() for e in exchanges])


# what reading an answer that is not the API's shape raises
MALFORMED = (AttributeError, KeyError, IndexError, TypeError, ValueError)


class RefusedError(Exception):
    """A request the server did not answer with 200: the check ends with this
    exchange as its evidence (4xx: not supported; 5xx or no answer: fail)."""

    def __init__(self, exchange: Exchange) -> None:
        super().__init__(f"HTTP {exchange.status} {exchange.error}".strip())
        self.exchange = exchange

    def outcome(self, what: str) -> Outcome:
        e = self.exchange
        message = _error_message(e)
        if 400 <= e.status < 500:
            return unsupported(f"{what}: refused with HTTP {e.status}: {message}", e)
        return failed(f"{what}: HTTP {e.status or 'no answer'}: {message}", e)


class MalformedAnswerError(Exception):
    """A 200 whose body is not the OpenAI API's shape (no choices, not JSON, a
    choice's text not a string): the check fails with this exchange as its
    evidence, and its detail shows the body, what came instead of an answer."""

    def __init__(self, exchange: Exchange, problem: str) -> None:
        super().__init__(problem)
        self.exchange = exchange

    def outcome(self, what: str) -> Outcome:
        return failed(
            f"{what}: HTTP 200 but not the OpenAI API's shape ({self}): "
            f"{self.exchange.excerpt(BRIEF_CHARS)}",
            self.exchange,
        )


def _error_message(exchange: Exchange) -> str:
    """The error's message in the body (OpenAI's `error.message`, FastAPI's
    `detail`), else the body itself, else what went wrong."""
    body = exchange.body if isinstance(exchange.body, dict) else {}
    error = body.get("error", body.get("detail", ""))
    if isinstance(error, dict):
        error = error.get("message", "")
    return str(error or exchange.excerpt(BRIEF_CHARS))[:BRIEF_CHARS]


@dataclass
class Position:
    """One generated token as the server reports it: its text, its logprob, and the
    top alternatives, most likely first."""

    token: str
    logprob: float
    top: list[tuple[str, float]]


@dataclass
class Answer:
    text: str
    finish_reason: str | None
    usage: dict | None
    positions: list[Position] | None  # None: no logprobs came back


def _positions(logprobs: dict | None) -> list[Position] | None:
    """Both forms: the legacy completions one (`tokens`, `token_logprobs`,
    `top_logprobs` as dicts) and the chat one (`content`: a list of entries)."""
    if not logprobs:
        return None
    if isinstance(logprobs.get("content"), list):
        positions = []
        for entry in logprobs["content"]:
            top = [(t["token"], t["logprob"]) for t in entry.get("top_logprobs") or []]
            top.sort(key=lambda pair: -pair[1])
            positions.append(Position(entry["token"], entry["logprob"], top))
        return positions
    tops = logprobs.get("top_logprobs") or [None] * len(logprobs.get("tokens", []))
    return [
        Position(token, logprob, sorted((top or {}).items(), key=lambda pair: -pair[1]))
        for token, logprob, top in zip(
            logprobs["tokens"], logprobs["token_logprobs"], tops, strict=True
        )
    ]


def _has_choices(exchange: Exchange) -> bool:
    """Whether the body, or one of the stream's events, holds a choice."""
    if exchange.events:
        return any(event.get("choices") for event in exchange.events)
    return isinstance(exchange.body, dict) and bool(exchange.body.get("choices"))


def answer(exchange: Exchange) -> Answer:
    """A completion's first choice, whole or streamed (chunks joined)."""
    if exchange.events:
        text, finish, usage, logprobs = "", None, None, []
        for event in exchange.events:
            usage = event.get("usage") or usage
            for choice in event.get("choices") or []:
                text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                finish = choice.get("finish_reason") or finish
                logprobs.extend(_positions(choice.get("logprobs")) or [])
        return Answer(text, finish, usage, logprobs or None)
    choice = exchange.body["choices"][0]
    message = choice.get("message")
    text = message.get("content") or "" if message is not None else choice.get("text") or ""
    if not isinstance(text, str):
        raise TypeError(f"the choice's text is {type(text).__name__}, not a string")
    positions = _positions(choice.get("logprobs"))
    return Answer(text, choice.get("finish_reason"), exchange.body.get("usage"), positions)


class Context:
    """What the checks share: the client, the model's name, and the token ids of
    strings when the server or `--model-file` can give them."""

    def __init__(self, client: Client, model: str, tokenize: Callable | None = None) -> None:
        self.client = client
        self.model = model
        self.tokenize = tokenize  # str -> list[int] | None
        self.top_n = 5  # the largest top_logprobs the server takes (probed up to 20)
        self.memo: dict[object, object] = {}  # answers that several checks share

    def complete(self, prompt: str | list[int] = PROMPT, **params: object) -> Exchange:
        return self.client.call("/completions", {"model": self.model, "prompt": prompt, **params})

    def chat(self, content: str, **params: object) -> Exchange:
        body = {"model": self.model, "messages": [{"role": "user", "content": content}]}
        return self.client.call("/chat/completions", body | params)

    def ok(self, exchange: Exchange) -> Answer:
        """The exchange's answer: RefusedError unless it is a 200, MalformedAnswerError
        unless the 200 is the API's shape (a choice, whole or among the events)."""
        if exchange.status != 200:
            raise RefusedError(exchange)
        if exchange.error:
            raise MalformedAnswerError(exchange, exchange.error)
        try:
            if not _has_choices(exchange):
                raise MalformedAnswerError(exchange, "no choices")
            return answer(exchange)
        except MALFORMED as error:
            raise MalformedAnswerError(exchange, repr(error)) from error

    def greedy(self, prompt: str | list[int] = PROMPT, **params: object) -> tuple[Answer, Exchange]:
        exchange = self.complete(prompt, temperature=0, **params)
        return self.ok(exchange), exchange

    def probe_top_n(self) -> None:
        """The largest `logprobs` (top alternatives) the server takes: 20, or 5."""
        for n in (20, 5):
            try:
                exchange = self.complete(max_tokens=1, temperature=0, logprobs=n)
                positions = answer(exchange).positions if exchange.ok else None
            except (BudgetExhaustedError, *MALFORMED):  # the checks report either
                return
            if positions and len(positions[0].top) >= min(n, 5):
                self.top_n = min(n, len(positions[0].top))
                return


CHECKS: list[tuple[str, str, Callable[[Context], Outcome]]] = []


def check(name: str, clause: str) -> Callable:
    """Register a check: `name` (what it looks at), the spec clause it observes."""

    def register(function: Callable[[Context], Outcome]) -> Callable[[Context], Outcome]:
        CHECKS.append((name, clause, function))
        return function

    return register


def run_check(function: Callable[[Context], Outcome], context: Context) -> Outcome:
    try:
        return function(context)
    except (RefusedError, MalformedAnswerError) as error:
        return error.outcome("a request of this check")
    except BudgetExhaustedError as error:
        return Outcome("not supported", f"not run: {error}")
    except MALFORMED as error:
        return Outcome("fail", f"the answer is not the OpenAI API's shape: {error!r}")


# ---------------------------------------------------------------- single answers


@check("temperature 0 takes the most likely token", "SAMPLE-GREEDY-1")
def greedy_is_argmax(ctx: Context) -> Outcome:
    result, exchange = ctx.greedy(STORY, max_tokens=16, logprobs=5)
    if not result.positions or not all(p.top for p in result.positions):
        return unsupported("no top logprobs came back", exchange)
    for i, p in enumerate(result.positions):
        best = max(lp for _, lp in p.top)
        if p.logprob < best - 1e-4:
            return failed(
                f"token {i} {p.token!r} has logprob {p.logprob:.4f}; the server's own top "
                f"list has {p.top[0][0]!r} at {best:.4f}",
                exchange,
            )
    return passed(f"each of {len(result.positions)} tokens is its position's maximum", exchange)


@check("temperature 0 repeats", "SAMPLE-GREEDY-1")
def greedy_repeats(ctx: Context) -> Outcome:
    (first, a), (second, b) = ctx.greedy(STORY, max_tokens=24), ctx.greedy(STORY, max_tokens=24)
    if first.text != second.text:
        return failed(f"{first.text!r} then {second.text!r}", a, b)
    return passed("the same text twice", a, b)


@check("streamed text is the whole text", "STOP-STREAM-1")
def stream_is_whole(ctx: Context) -> Outcome:
    whole, a = ctx.greedy(STORY, max_tokens=24)
    streamed, b = ctx.greedy(STORY, max_tokens=24, stream=True)
    if (streamed.text, streamed.finish_reason) != (whole.text, whole.finish_reason):
        return failed(
            f"streamed {streamed.text!r} ({streamed.finish_reason}), whole {whole.text!r} "
            f"({whole.finish_reason})",
            a,
            b,
        )
    return passed("the same text and finish reason", a, b)


@check("max_tokens ends with 'length' and usage counts the tokens", "STOP-LEN-1")
def length_and_usage(ctx: Context) -> Outcome:
    result, exchange = ctx.greedy(STORY, max_tokens=12, logprobs=1)
    usage = result.usage or {}
    tokens = usage.get("completion_tokens")
    problems = []
    if result.finish_reason == "length" and tokens != 12:
        problems.append(f"finish_reason 'length' after {tokens} completion tokens, not 12")
    if result.finish_reason not in ("length", "stop"):
        problems.append(f"finish_reason {result.finish_reason!r}")
    if result.finish_reason == "stop" and (tokens is None or tokens > 12):
        problems.append(f"{tokens} completion tokens with max_tokens 12")
    if result.positions is not None and tokens is not None and len(result.positions) != tokens:
        problems.append(f"{len(result.positions)} logprob entries, usage says {tokens}")
    again, second = ctx.greedy(STORY, max_tokens=3)
    if (again.usage or {}).get("prompt_tokens") != usage.get("prompt_tokens"):
        problems.append("prompt_tokens differ between two requests with the same prompt")
    if problems:
        return failed("; ".join(problems), exchange, second)
    return passed(f"finish_reason {result.finish_reason!r}, {tokens} tokens", exchange)


def _stop_string(text: str) -> str | None:
    """A stop string from inside a greedy answer: a word well past its start."""
    words = text.split(" ")
    for i in range(2, len(words)):
        if len(words[i]) >= 3:
            return " " + words[i]
    return None


@check("a stop string ends the text before it", "STOP-STR-1")
def stop_string_cuts(ctx: Context) -> Outcome:
    return _stop_check(ctx, stream=False)


@check("a stop string is never streamed", "STOP-STREAM-1")
def stop_string_streamed(ctx: Context) -> Outcome:
    return _stop_check(ctx, stream=True)


def _stop_check(ctx: Context, *, stream: bool) -> Outcome:
    base, a = ctx.greedy(STORY, max_tokens=32)
    stop = _stop_string(base.text)
    if stop is None:
        return unsupported(f"no word to stop at in {base.text!r}", a)
    want = base.text[: base.text.index(stop)]
    cut, b = ctx.greedy(STORY, max_tokens=32, stop=[stop], stream=stream)
    if cut.text != want or cut.finish_reason != "stop":
        return failed(
            f"stop {stop!r}: got {cut.text!r} ({cut.finish_reason}), want {want!r} ('stop')",
            a,
            b,
        )
    if stream and any(stop in e for e in _chunks(b)):
        return failed(f"a chunk holds the stop string {stop!r}", b)
    return passed(f"cut at {stop!r}", a, b)


def _chunks(exchange: Exchange) -> list[str]:
    texts = []
    for event in exchange.events:
        for choice in event.get("choices") or []:
            texts.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return texts


@check("a seed reproduces a sampled answer", "SAMPLE-SEED-1")
def seed_repeats(ctx: Context) -> Outcome:
    params = {"temperature": 1.0, "max_tokens": 24, "seed": 1234}
    exchanges = [ctx.complete(STORY, **params) for _ in range(3)]
    texts = [ctx.ok(e).text for e in exchanges]
    if len(set(texts)) != 1:
        return failed(f"seed 1234 gave {texts!r}", *exchanges)
    other = ctx.ok(ctx.complete(STORY, **(params | {"seed": 4321}))).text
    note = "" if other != texts[0] else " (seed 4321 gave the same text too)"
    return passed(f"the same text three times{note}", *exchanges)


@check("a seeded answer does not depend on the load", "LOOP-INVARIANT-1")
def seed_under_load(ctx: Context) -> Outcome:
    """The same seeded request alone and beside 6 others, twice: the same text and, where
    the server returns logprobs, every logprob and alternative bitwise as the JSON
    carries them (a server whose sums move with its batch passes on text alone)."""
    params = {"temperature": 1.0, "max_tokens": 24, "seed": 99}
    first = ctx.complete(STORY, **params, logprobs=min(ctx.top_n, 5))
    if 400 <= first.status < 500:  # no logprobs here: the text alone is compared
        first = ctx.complete(STORY, **params)
    else:
        params["logprobs"] = min(ctx.top_n, 5)
    alone = ctx.ok(first)

    def background(i: int) -> None:
        prompt = LOAD_PROMPTS[i % len(LOAD_PROMPTS)]
        ctx.complete(prompt, temperature=1.0, max_tokens=32, seed=i)

    for round_ in range(2):
        threads = [threading.Thread(target=background, args=(i,)) for i in range(6)]
        for thread in threads:
            thread.start()
        loaded_exchange = ctx.complete(STORY, **params)
        for thread in threads:
            thread.join()
        loaded = ctx.ok(loaded_exchange)
        if loaded.text != alone.text:
            return failed(
                f"round {round_ + 1}: alone {alone.text!r}, beside 6 other requests "
                f"{loaded.text!r}",
                first,
                loaded_exchange,
            )
        difference = _first_difference(alone.positions, loaded.positions)
        if difference is not None:
            return failed(
                f"round {round_ + 1}: the same text, but {difference}", first, loaded_exchange
            )
    if alone.positions is None:
        return passed(
            "the same text alone and beside 6 concurrent requests, twice (text only: "
            "no logprobs came back)",
            first,
        )
    return passed(
        f"the same text and all {len(alone.positions)} tokens' logprobs bitwise, alone and "
        "beside 6 concurrent requests, twice",
        first,
    )


def _first_difference(alone: list[Position] | None, loaded: list[Position] | None) -> str | None:
    """Where two answers' logprobs first differ in any bit, in words; None if nowhere."""
    if alone is None or loaded is None:
        return None if alone is loaded else "logprobs came back only one of the two times"
    if len(alone) != len(loaded):
        return f"{len(alone)} logprob entries alone, {len(loaded)} under load"
    for i, (a, b) in enumerate(zip(alone, loaded, strict=True)):
        if a.token != b.token or a.logprob != b.logprob:
            return (
                f"token {i} ({a.token!r}) has logprob {a.logprob!r} alone, "
                f"{b.logprob!r} ({b.token!r}) under load"
            )
        if a.top != b.top:
            return f"token {i}'s alternatives are {a.top!r} alone, {b.top!r} under load"
    return None


BAD_PARAMS = (
    {"temperature": -1.0},
    {"top_p": 1.5},
    {"max_tokens": -5},
    {"logit_bias": {"10": 500}},
)


@check("invalid parameters are refused with a 4xx", "PARAM-RANGE-1")
def bad_params_refused(ctx: Context) -> Outcome:
    accepted, broke, exchanges = [], [], []
    for params in BAD_PARAMS:
        exchange = ctx.complete(**({"max_tokens": 4} | params))
        exchanges.append(exchange)
        if exchange.status == 200:
            accepted.append(params)
        elif not 400 <= exchange.status < 500:
            broke.append((params, exchange.status))
    if accepted or broke:
        detail = "; ".join(
            [f"{p} answered 200" for p in accepted] + [f"{p} answered {s}" for p, s in broke]
        )
        return failed(detail, *exchanges)
    return passed(f"{len(BAD_PARAMS)} invalid requests, each a 4xx", *exchanges)


@check("logit_bias bans and forces tokens", "LOGITS-BIAS-1")
def logit_bias(ctx: Context) -> Outcome:
    if ctx.tokenize is None:
        return unsupported("needs token ids: --model-file, or a /tokenize endpoint")
    base, a = ctx.greedy(PROMPT, max_tokens=1, logprobs=5)
    if not base.positions or len(base.positions[0].top) < 3:
        return unsupported("no top logprobs came back", a)
    top = [token for token, _ in base.positions[0].top]
    ids = [ctx.tokenize(token) for token in top[:3]]
    if any(i is None or len(i) != 1 for i in ids):
        return unsupported(f"the top tokens {top[:3]!r} are not single tokens again", a)
    banned, b = ctx.greedy(PROMPT, max_tokens=1, logit_bias={str(ids[0][0]): -100})
    forced, c = ctx.greedy(PROMPT, max_tokens=1, logit_bias={str(ids[2][0]): 100})
    problems = []
    if banned.text == base.text:
        problems.append(f"banning {top[0]!r} (-100) still gave it")
    elif banned.text != top[1]:
        problems.append(f"banning {top[0]!r} gave {banned.text!r}, not the runner-up {top[1]!r}")
    if forced.text != top[2]:
        problems.append(f"forcing {top[2]!r} (+100) gave {forced.text!r}")
    if problems:
        return failed("; ".join(problems), a, b, c)
    return passed(f"-100 on {top[0]!r} gives {top[1]!r}; +100 on {top[2]!r} gives it", b, c)


# OpenAI's strict form: objects at the root, every property required, no others
SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "colour": {
        "type": "object",
        "properties": {"colour": {"enum": ["red", "green", "blue"]}},
        "required": ["colour"],
        "additionalProperties": False,
    },
    "scores": {
        "type": "object",
        "properties": {
            "scores": {
                "type": "array",
                "items": {"type": "integer", "minimum": 1, "maximum": 9},
                "minItems": 2,
                "maxItems": 4,
            }
        },
        "required": ["scores"],
        "additionalProperties": False,
    },
}
BROKEN_SCHEMA = {  # strict in form; "nonsense" is no JSON Schema type
    "type": "object",
    "properties": {"a": {"type": "nonsense"}},
    "required": ["a"],
    "additionalProperties": False,
}


def _json_schema(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


@check("a json_schema answer validates", "MASK-SOUND-1")
def json_schema_validates(ctx: Context) -> Outcome:
    exchanges = []
    for name, schema in SCHEMAS.items():
        exchange = ctx.chat(
            f"Answer in JSON: a {name}.", response_format=_json_schema(name, schema),
            max_tokens=200, temperature=0.7, seed=5,
        )  # fmt: skip
        exchanges.append(exchange)
        result = ctx.ok(exchange)
        try:
            jsonschema.validate(json.loads(result.text), schema)
        except (ValueError, jsonschema.ValidationError) as error:
            reason = getattr(error, "message", str(error))
            return failed(
                f"schema {name!r}: {result.text[:120]!r} ({result.finish_reason}) does not "
                f"validate: {reason}",
                exchange,
            )
    return passed(f"{len(SCHEMAS)} schemas, each answer valid", *exchanges)


@check("a schema that is not valid JSON Schema is refused", "MASK-SOUND-1")
def broken_schema_refused(ctx: Context) -> Outcome:
    exchange = ctx.chat(
        "Answer in JSON.", response_format=_json_schema("broken", BROKEN_SCHEMA), max_tokens=20
    )
    if 400 <= exchange.status < 500:
        return passed(f"HTTP {exchange.status}: {_error_message(exchange)}", exchange)
    return failed(f"HTTP {exchange.status or 'no answer'} to an invalid schema", exchange)
