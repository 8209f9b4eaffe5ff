"""Sampling parameters: `SamplingParams`, declared once, and the tensors they become.

Each field of `SamplingParams` declares itself (`param`): its type, its
valid range, and its names in an OpenAI request body and on the command line.
Its checks are derived from that declaration (`decodespec.spec.checks` does
the checking), and so are the server's body parsing and the command line's
flags (`decodespec.reference`). `validate_request` checks a request against a
model, `resolve_seed` gives a request without a seed one, and
`sampling_tensors` turns a batch of requests into the per-row tensors of
`sample` (`decodespec.spec.sampling`, where `SamplingParams` can also be
imported from, its home before this module).

[PARAM-RANGE-1] Invalid parameters raise `ValueError` naming the parameter and
the value: temperature finite and >= 0; top_k an integer >= 0; top_p in
(0, 1]; min_p in [0, 1]; repetition_penalty finite and > 0; frequency and
presence penalties in [-2, 2]; logit bias values in [-100, 100]; max_tokens
>= 1 (or None: until the context is full); 0 <= min_tokens <= max_tokens;
seed in [0, 2^64); stop strings non-empty; top_logprobs in [0, 20]. The
per-row tensors given to `sample` are checked the same way, naming the row.

[PARAM-REQUEST-1] Against a model: token ids in the prompt, in logit_bias and
in stop_token_ids must be inside the vocabulary; the prompt must hold at least
one token and leave room for one generated token; prompt + max_tokens must fit
the model's context, and so must prompt + min_tokens. Prompt token ids are
integers (not bool, float or str; a tensor of an integer dtype, 1-D), checked
by `check_token_ids`, which an engine uses to turn them into Python ints.

[SAMPLE-SEED-1] A request without a seed gets one drawn from the engine's
generator (`resolve_seed`), and the seed used is reported back, so any
generation can be replayed.

(A little over 500 lines: the sixteen field declarations, each with its
range, help and interface names, take some 230 of them; they are the one
place a parameter is declared, so they stay together.)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from .checks import (
    INT64_MAX,
    ContextLengthError,
    ParameterError,
    ParameterTypeError,
    Range,
    check_float,
    check_int64,
    check_int_list,
    check_integer,
    check_token_id,
    check_token_ids,
    shown,
    type_name,
)

MAX_TOP_LOGPROBS = 20


# ---------------------------------------------------------------------------
# Declaring a parameter


COUNT = Range(0, math.inf, high_open=True)  # a count or an index: an integer >= 0


@dataclass(frozen=True)
class Param:
    """What `SamplingParams` declares about one field, for its checks and its interfaces.

    Attributes:
        help: what it does, in a phrase (the command line's help).
        type: float, int or bool for a number or a flag checked by its declaration
            alone; another type has a check of its own (`SamplingParams._check_<name>`).
        range: its valid values (PARAM-RANGE-1); `sample`'s tensor of the same name
            is checked against the same interval.
        divisor: it divides logits, so its float32 reciprocal must be normal (PARAM-TENSOR-1).
        optional: None is a value (the field's meaning says what None does).
        api: its name in an OpenAI request body (or vLLM's extra body), if it has one.
        flag: its command-line option of `decodespec generate`, if it has one.
        metavar: the option's value in the command line's help.
    """

    help: str
    type: type
    range: Range | None = None
    divisor: bool = False
    optional: bool = False
    api: str | None = None
    flag: str | None = None
    metavar: str | None = None


def param(default: object, help: str, type: type, **declared: object) -> object:
    """A field of `SamplingParams` with its declaration (`Param`) as metadata."""
    metadata = {"param": Param(help, type, **declared)}
    if isinstance(default, dict):
        return field(default_factory=dict, metadata=metadata)
    return field(default=default, metadata=metadata)


# ---------------------------------------------------------------------------
# The parameters


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops (PARAM-RANGE-1).

    Each field declares itself once (`param`: its help, type, range, and its
    names in an API body and on the command line); its checks, the command
    line's flags and the server's body parsing are derived from that. To add
    a parameter, declare it here and give `sample` its tensor.

    Construction validates every field: a wrong type raises
    `ParameterTypeError` (PARAM-TYPE-1), a bad value `ParameterError`, a
    `ValueError` (PARAM-RANGE-1, PARAM-TENSOR-1), naming the field and the
    value. Vocabulary- and model-dependent checks are in `validate_request`.

    Example:
        >>> SamplingParams(temperature=0.7, top_p=0.9, seed=1234, stop=["\\n\\n"]).stop
        ('\\n\\n',)
        >>> SamplingParams(temperature=1e-46)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        decodespec.spec.checks.ParameterError: temperature 1e-46 underflows to 0 in float32: ...
    """

    temperature: float = param(
        1.0,
        "0 = greedy; T > 0 divides the logits, then samples",
        float,
        range=Range(0, math.inf, high_open=True),
        divisor=True,
        api="temperature",
        flag="--temperature",
    )
    top_k: int = param(
        0,
        "keep the tokens with fewer than K tokens above them (0: off)",
        int,
        range=COUNT,
        api="top_k",
        flag="--top-k",
    )
    top_p: float = param(
        1.0,
        "keep the tokens with less than P probability mass above them (1: off)",
        float,
        range=Range(0, 1, low_open=True),
        api="top_p",
        flag="--top-p",
    )
    min_p: float = param(
        0.0,
        "keep the tokens at least M times as likely as the most likely (0: off)",
        float,
        range=Range(0, 1),
        api="min_p",
        flag="--min-p",
    )
    repetition_penalty: float = param(
        1.0,
        "divide the positive logits (multiply the negative) of tokens seen so far (1: off)",
        float,
        range=Range(0, math.inf, low_open=True, high_open=True),
        divisor=True,
        api="repetition_penalty",
        flag="--repetition-penalty",
    )
    frequency_penalty: float = param(
        0.0,
        "subtract this times each token's count in the output",
        float,
        range=Range(-2, 2),
        api="frequency_penalty",
        flag="--frequency-penalty",
    )
    presence_penalty: float = param(
        0.0,
        "subtract this from the tokens present in the output",
        float,
        range=Range(-2, 2),
        api="presence_penalty",
        flag="--presence-penalty",
    )
    logit_bias: Mapping[int, float] = param(
        {}, "token id -> bias added to its logit", dict, range=Range(-100, 100), api="logit_bias"
    )
    max_tokens: int | None = param(
        16,
        "the most tokens to generate (None: until the context is full)",
        int,
        range=Range(1, math.inf, high_open=True),
        optional=True,
        api="max_tokens",
        flag="--max-tokens",
    )
    min_tokens: int = param(
        0, "hold the stop tokens back until this many tokens", int, api="min_tokens"
    )
    seed: int | None = param(
        None,
        "the random numbers' seed, in [0, 2**64) (default: drawn, and reported)",
        int,
        optional=True,
        api="seed",
        flag="--seed",
    )
    stop: Sequence[str] = param(
        (), "stop string (repeatable)", tuple, api="stop", flag="--stop", metavar="TEXT"
    )
    stop_token_ids: Sequence[int] = param(
        (), "token ids that end the output", tuple, api="stop_token_ids"
    )
    ignore_eos: bool = param(
        False,
        "do not stop at the end-of-sequence tokens",
        bool,
        api="ignore_eos",
        flag="--ignore-eos",
    )
    top_logprobs: int | None = param(
        None,
        "logprobs with the top N (0-20)",
        int,
        range=Range(0, MAX_TOP_LOGPROBS),
        optional=True,
        flag="--logprobs",
        metavar="N",
    )
    logprobs_mode: Literal["raw", "processed"] = param(
        "raw",
        "raw: the model's distribution; processed: the one the token is drawn from",
        str,
        api="logprobs_mode",
    )

    def __post_init__(self) -> None:
        # Every field is checked, in declaration order, and stored normalised (Python
        # numbers, tuples, a dict), so the frozen object is really immutable.
        for f in dataclasses.fields(self):
            value, declared = getattr(self, f.name), f.metadata["param"]
            if value is None and declared.optional:
                continue
            own_check = getattr(self, f"_check_{f.name}", None)
            if own_check is not None:
                value = own_check(value)
            else:
                value = _check_declared(f.name, value, declared)
            object.__setattr__(self, f.name, value)

    def stop_ids(self, eos_token_ids: Iterable[int]) -> frozenset[int]:
        """Stop token ids: EOS ids (unless ignore_eos) ∪ the user's stop_token_ids."""
        eos = () if self.ignore_eos else tuple(eos_token_ids)
        return frozenset(eos) | frozenset(self.stop_token_ids)

    # The fields that take more than a number: each one's own check.

    def _check_logit_bias(self, value: object) -> dict[int, float]:
        if not isinstance(value, Mapping):
            raise ParameterTypeError(
                "logit_bias",
                "logit_bias must be a mapping from token ids to biases, got "
                f"{shown(value)} ({type_name(value)})",
            )
        bias_range = PARAMETERS["logit_bias"].range
        logit_bias = {}
        for key, bias in value.items():
            token_id = check_token_id("logit_bias key", key)
            logit_bias[token_id] = check_float(f"logit_bias[{token_id}]", bias, bias_range)
        return logit_bias

    def _check_min_tokens(self, value: object) -> int:
        min_tokens = check_integer("min_tokens", value)
        if self.max_tokens is None:
            high, bound = INT64_MAX, "2**63 - 1 (an int64)"
        else:
            high, bound = self.max_tokens, f"max_tokens={self.max_tokens}"
        if not 0 <= min_tokens <= high:
            raise ParameterError(
                "min_tokens", f"min_tokens must be in [0, {bound}], got {shown(value)}"
            )
        return min_tokens

    def _check_seed(self, value: object) -> int:
        seed = check_integer("seed", value)
        if not 0 <= seed < 2**64:
            raise ParameterError("seed", f"seed must be in [0, 2**64), got {shown(value)}")
        return seed

    def _check_stop(self, value: object) -> tuple[str, ...]:
        stop = value
        if isinstance(stop, str):
            stop = (stop,)
        elif isinstance(stop, (bytes, bytearray, Mapping, Tensor)) or not isinstance(
            stop, Iterable
        ):
            raise ParameterTypeError(
                "stop",
                f"stop must be a str or a sequence of str, got {shown(stop)} ({type_name(stop)})",
            )
        stop = tuple(stop)
        for i, s in enumerate(stop):
            if not isinstance(s, str):
                raise ParameterTypeError(
                    "stop", f"stop[{i}] must be a str, got {shown(s)} ({type_name(s)})"
                )
            if not s:
                raise ParameterError(
                    "stop", f"stop strings must be non-empty strings, got {s!r} (stop[{i}])"
                )
        return tuple(str(s) for s in stop)

    def _check_stop_token_ids(self, value: object) -> tuple[int, ...]:
        stop_ids = check_int_list("stop_token_ids", value)
        for i, token_id in enumerate(stop_ids):
            check_token_id(f"stop_token_ids[{i}]", token_id)
        return tuple(stop_ids)

    def _check_logprobs_mode(self, mode: object) -> str:
        if not isinstance(mode, str):
            raise ParameterTypeError(
                "logprobs_mode",
                "logprobs_mode must be 'raw' or 'processed', "
                f"got {shown(mode)} ({type_name(mode)})",
            )
        if mode not in ("raw", "processed"):
            raise ParameterError(
                "logprobs_mode", f"logprobs_mode must be 'raw' or 'processed', got {mode!r}"
            )
        return str(mode)


# Every parameter's declaration, by field name, in declaration order.
PARAMETERS: dict[str, Param] = {
    f.name: f.metadata["param"] for f in dataclasses.fields(SamplingParams)
}

# The valid values of every parameter that has a range and of `sample`'s other
# per-row tensors (PARAM-RANGE-1): the one table the spec checks both against
# (kernels/sampling.py keeps a copy, `_RANGES`, that tests/test_project.py compares).
RANGES: dict[str, Range] = {
    **{name: p.range for name, p in PARAMETERS.items() if p.range is not None},
    "min_tokens": COUNT,
    "step": COUNT,
    "output_counts": COUNT,
}


def _check_declared(name: str, value: object, declared: Param) -> object:
    """A number or a flag checked against its declaration: type, range, tensor."""
    if declared.type is bool:
        if not isinstance(value, bool):
            raise ParameterTypeError(
                name, f"{name} must be a bool, got {shown(value)} ({type_name(value)})"
            )
        return value
    assert declared.range is not None, f"{name} declares no range"
    if declared.type is float:
        return check_float(name, value, declared.range, divisor=declared.divisor)
    number = check_integer(name, value)
    declared.range.check(name, number)
    check_int64(name, number)
    return number


# ---------------------------------------------------------------------------
# A request against a model


def validate_request(
    params: SamplingParams,
    prompt_token_ids: Sequence[int] | Tensor,
    *,
    vocab_size: int,
    max_context: int,
) -> None:
    """Check a request against a model (PARAM-REQUEST-1).

    Raises:
        ParameterError: naming the field, `ContextLengthError` when the request
            cannot fit the model's context.
        ParameterTypeError: prompt ids that are not integers (see `check_token_ids`).
    """
    if not isinstance(params, SamplingParams):
        raise ParameterTypeError(
            "params", f"params must be a SamplingParams, got {type_name(params)}"
        )
    n = len(check_token_ids("prompt_token_ids", prompt_token_ids, vocab_size))
    outside = [i for i in params.logit_bias if not 0 <= i < vocab_size]
    if outside:
        raise ParameterError(
            "logit_bias",
            f"logit_bias holds ids outside the vocabulary [0, {vocab_size}): {outside[:8]}",
        )
    check_token_ids("stop_token_ids", params.stop_token_ids, vocab_size)
    if n == 0:
        raise ParameterError("prompt_token_ids", "prompt_token_ids must hold at least one token")
    if n >= max_context:
        raise ContextLengthError(
            "prompt_token_ids",
            f"prompt_token_ids has {n} tokens; the model's context of {max_context} "
            "leaves no room to generate",
        )
    if params.max_tokens is not None and n + params.max_tokens > max_context:
        raise ContextLengthError(
            "max_tokens",
            f"max_tokens={params.max_tokens} with a {n}-token prompt exceeds the model's "
            f"context of {max_context} (at most {max_context - n}, or None to fill it)",
        )
    if n + params.min_tokens > max_context:
        raise ContextLengthError(
            "min_tokens",
            f"min_tokens={params.min_tokens} with a {n}-token prompt can never be reached "
            f"within the model's context of {max_context} (at most {max_context - n})",
        )


def resolve_seed(params: SamplingParams, generator: torch.Generator) -> SamplingParams:
    """Give a request without a seed one drawn from `generator` (SAMPLE-SEED-1)."""
    if params.seed is not None:
        return params
    low, high = torch.randint(0, 2**32, (2,), generator=generator, dtype=torch.int64).tolist()
    return dataclasses.replace(params, seed=high << 32 | low)


def seed_to_int64(seed: int) -> int:
    """The int64 holding the bit pattern of a seed in [0, 2^64) (tensors are signed)."""
    return seed - 2**64 if seed >= 2**63 else seed


# ---------------------------------------------------------------------------
# The tensors of a batch


@dataclass(frozen=True, eq=False)
class SamplingTensors(Mapping[str, Tensor]):
    """The per-row tensors of a batch, as `sample` takes them (built by `sampling_tensors`).

    A mapping of the tensors that are set (an optional one no row needs is
    None and left out), so `sample(logits, **tensors)` passes them as keyword
    arguments; `process_logits_args` is the same without the seed, for
    `process_logits(logits, **tensors.process_logits_args)`.

    Example:
        >>> t = sampling_tensors([SamplingParams(seed=7), SamplingParams(temperature=0)],
        ...     vocab_size=4, prompt_token_ids=[[1], [2]], output_token_ids=[[], [3]])
        >>> list(t)
        ['temperature', 'top_k', 'top_p', 'min_p', 'seed', 'step']
        >>> t.rows([1])["step"], "seed" in t.process_logits_args
        (tensor([1]), False)
    """

    temperature: Tensor
    top_k: Tensor
    top_p: Tensor
    min_p: Tensor
    seed: Tensor
    step: Tensor
    token_bitmask: Tensor | None = None
    logit_bias: Tensor | None = None
    stop_token_mask: Tensor | None = None
    min_tokens: Tensor | None = None
    prompt_mask: Tensor | None = None
    output_counts: Tensor | None = None
    repetition_penalty: Tensor | None = None
    frequency_penalty: Tensor | None = None
    presence_penalty: Tensor | None = None

    def __getitem__(self, name: str) -> Tensor:
        value = getattr(self, name) if name in self._names() else None
        if value is None:
            raise KeyError(name)
        return value

    def __iter__(self) -> Iterator[str]:
        return (name for name in self._names() if getattr(self, name) is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    @classmethod
    def _names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    def rows(self, indices: Sequence[int] | Tensor) -> SamplingTensors:
        """The tensors of some rows, in the order of `indices`."""
        return SamplingTensors(**{name: t[indices] for name, t in self.items()})

    @property
    def process_logits_args(self) -> dict[str, Tensor]:
        """The keyword arguments of `process_logits`: every tensor but the seed."""
        return {name: t for name, t in self.items() if name != "seed"}


def sampling_tensors(
    params: Sequence[SamplingParams],
    *,
    vocab_size: int,
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    eos_token_ids: Iterable[int] = (),
    device: torch.device | str = "cpu",
    token_bitmask: Tensor | None = None,
) -> SamplingTensors:
    """The per-row tensors `sample` takes, for a batch of requests.

    Optional tensors are left out when no row needs them, so the common case
    (no bias, no penalties, no min_tokens) reads nothing of size vocab.
    Seeds must be resolved first (`resolve_seed`) for rows that sample.
    `token_bitmask`, the rows' grammar masks filled by their matchers
    (MASK-SAMPLE-1), is passed through as it is, moved to `device`.

    Returns:
        the tensors, to pass as `sample(logits, **tensors)`.
    """
    batch = len(params)
    if len(prompt_token_ids) != batch or len(output_token_ids) != batch:
        raise ValueError("params, prompt_token_ids and output_token_ids must have one entry a row")
    for p in params:
        if p.seed is None and p.temperature > 0:
            raise ValueError("a sampled row needs a seed: call resolve_seed first")
    eos = tuple(eos_token_ids)

    def per_row(values: list, dtype: torch.dtype) -> Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    tensors = {
        "temperature": per_row([p.temperature for p in params], torch.float32),
        "top_k": per_row([p.top_k for p in params], torch.int64),
        "top_p": per_row([p.top_p for p in params], torch.float32),
        "min_p": per_row([p.min_p for p in params], torch.float32),
        "seed": per_row([seed_to_int64(p.seed or 0) for p in params], torch.int64),
        "step": per_row([len(out) for out in output_token_ids], torch.int64),
    }
    if token_bitmask is not None:
        tensors["token_bitmask"] = token_bitmask.to(device)
    if any(p.logit_bias for p in params):
        bias = torch.zeros(batch, vocab_size, dtype=torch.float32)
        for row, p in enumerate(params):
            for token_id, value in p.logit_bias.items():
                bias[row, token_id] = value
        tensors["logit_bias"] = bias.to(device)
    if any(p.min_tokens > 0 for p in params):
        mask = torch.zeros(batch, vocab_size, dtype=torch.bool)
        for row, p in enumerate(params):
            mask[row, list(p.stop_ids(eos))] = True
        tensors["stop_token_mask"] = mask.to(device)
        tensors["min_tokens"] = per_row([p.min_tokens for p in params], torch.int64)
    if any(
        p.repetition_penalty != 1 or p.frequency_penalty != 0 or p.presence_penalty != 0
        for p in params
    ):
        prompt_mask = torch.zeros(batch, vocab_size, dtype=torch.bool)
        counts = torch.zeros(batch, vocab_size, dtype=torch.int32)
        for row in range(batch):
            prompt_mask[row, list(prompt_token_ids[row])] = True
            out = torch.as_tensor(list(output_token_ids[row]), dtype=torch.int64)
            counts[row] = torch.bincount(out, minlength=vocab_size)[:vocab_size].to(torch.int32)
        tensors["prompt_mask"] = prompt_mask.to(device)
        tensors["output_counts"] = counts.to(device)
        tensors["repetition_penalty"] = per_row(
            [p.repetition_penalty for p in params], torch.float32
        )
        tensors["frequency_penalty"] = per_row([p.frequency_penalty for p in params], torch.float32)
        tensors["presence_penalty"] = per_row([p.presence_penalty for p in params], torch.float32)
    return SamplingTensors(**tensors)
