"""What a request asks of the engine beyond its sampling parameters, declared once.

`SamplingParams` (the spec's) says how a request's tokens are chosen and when
it stops. The rest of a request is `RequestOptions`: a cap on its draft tokens,
the scoring of its prompt, the grammar its output must match, the moment it
arrived. Each field declares itself once with `option(...)` — what it does and
its name in an API body, if it has one — as `SamplingParams`' fields do with
`param(...)`. `Engine.add_request`, `EngineLoop.submit` and the server's
parsed request carry one `RequestOptions`, and the body fields the server
takes for them come from the declarations (`API_FIELDS`).

Each value is checked once, when the options are built (a `ParameterError`
naming the field, as the spec's checks raise); what depends on the engine —
whether it has a drafter, its K — is checked by the engine
(`check_num_draft`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from decodespec.spec.checks import (
    ParameterError,
    ParameterTypeError,
    check_integer,
    check_real,
    shown,
    type_name,
)
from decodespec.spec.params import MAX_TOP_LOGPROBS

from .grammar import StructuredOutput


@dataclass(frozen=True)
class Option:
    """What `RequestOptions` declares about one field.

    Attributes:
        help: what it does, in a phrase.
        api: its name in an OpenAI request body (an extra field, as vLLM's are), if
            the body spells it as it is; None when the server derives it from other
            fields (`structured_api.py`, `scoring_api.py`) or from the connection.
    """

    help: str
    api: str | None = None


def option(help: str, api: str | None = None) -> object:
    """A field of `RequestOptions` (default None) with its declaration as metadata."""
    return field(default=None, metadata={"option": Option(help, api)})


@dataclass(frozen=True)
class RequestOptions:
    """A request's options beyond `SamplingParams`; every one is optional.

    Example:
        >>> RequestOptions(num_draft=2, prompt_logprobs=0)
        RequestOptions(num_draft=2, prompt_logprobs=0, structured_output=None, arrival=None)
        >>> RequestOptions(prompt_logprobs=21)
        Traceback (most recent call last):
        ...
        decodespec.spec.checks.ParameterError: prompt_logprobs must be an integer in [0, 20], got 21
    """

    num_draft: int | None = option(
        "speculative decoding: at most this many draft tokens per step for this request "
        "(0: none); at most the engine's K, which is the default",
        api="num_draft",
    )
    prompt_logprobs: int | None = option(
        f"score the prompt: per prompt token its logprob, rank and the top k in "
        f"[0, {MAX_TOP_LOGPROBS}] of the raw logits (LOGPROB-RAW-1); over the API, vLLM's "
        "`prompt_logprobs` and `echo` with `logprobs` ask for it (`scoring_api.py`)"
    )
    # option() is dataclasses.field with metadata, not a shared default.
    structured_output: StructuredOutput | None = option(  # noqa: RUF009
        "constrain every token to a grammar (MASK-ADVANCE-1); over the API, "
        "`response_format`, `structured_outputs` or `guided_*` (`structured_api.py`)"
    )
    arrival: float | None = option(
        "a time.perf_counter() reading: where the time to first token starts (default: "
        "when the engine takes the request; a server passes when it came in)"
    )

    def __post_init__(self) -> None:
        if self.num_draft is not None:
            object.__setattr__(self, "num_draft", _count("num_draft", self.num_draft))
        if self.prompt_logprobs is not None:
            object.__setattr__(self, "prompt_logprobs", check_prompt_logprobs(self.prompt_logprobs))
        if self.structured_output is not None and not isinstance(
            self.structured_output, StructuredOutput
        ):
            raise ParameterTypeError(
                "structured_output",
                "structured_output must be a StructuredOutput, got "
                f"{type_name(self.structured_output)}",
            )
        if self.arrival is not None:
            arrival = check_real("arrival", self.arrival)
            if not math.isfinite(arrival):
                raise ParameterError("arrival", f"arrival must be finite, got {arrival}")
            object.__setattr__(self, "arrival", arrival)

    def check_num_draft(self, engine_num_draft: int) -> None:
        """Refuse a `num_draft` the engine cannot honour: `engine_num_draft` is its K,
        0 without a drafter."""
        if self.num_draft is None or self.num_draft <= engine_num_draft:
            return
        if engine_num_draft == 0:
            raise ParameterError(
                "num_draft",
                "num_draft: there is no drafter (the engine was started without speculative "
                "decoding: `speculate`, `--speculate`)",
            )
        raise ParameterError(
            "num_draft", f"num_draft must be in [0, {engine_num_draft}], got {self.num_draft}"
        )


def check_prompt_logprobs(value: object) -> int:
    """A prompt_logprobs k: an integer in [0, MAX_TOP_LOGPROBS] (`ParameterError`)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ParameterTypeError(
            "prompt_logprobs",
            f"prompt_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got "
            f"{shown(value)} ({type_name(value)})",
        )
    if not 0 <= value <= MAX_TOP_LOGPROBS:
        raise ParameterError(
            "prompt_logprobs",
            f"prompt_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {value}",
        )
    return value


def _count(name: str, value: object) -> int:
    number = check_integer(name, value)
    if number < 0:
        raise ParameterError(name, f"{name} must be an integer >= 0, got {number}")
    return number


# Each option's declaration, and the body fields that spell an option as it is.
OPTIONS = {f.name: f.metadata["option"] for f in fields(RequestOptions)}
API_FIELDS = {o.api: name for name, o in OPTIONS.items() if o.api is not None}
