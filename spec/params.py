"""Sampling parameters: `SamplingParams`, their checks, and the tensors they become.

A request's parameters are checked once, when its `SamplingParams` is built:
their types, their ranges and what the float32 and int64 tensors they become
can hold. `validate_request` checks them against a model, `resolve_seed` gives
a request without a seed one, and `sampling_tensors` turns a batch of them
into the per-row tensors of `sample` (`decodespec.spec.sampling`, which is
also where `SamplingParams` can still be imported from).

[PARAM-RANGE-1] Invalid parameters raise `ValueError` naming the parameter and
the value: temperature finite and >= 0; top_k an integer >= 0; top_p in
(0, 1]; min_p in [0, 1]; repetition_penalty finite and > 0; frequency and
presence penalties in [-2, 2]; logit bias values in [-100, 100]; max_tokens
>= 1 (or None: until the context is full); 0 <= min_tokens <= max_tokens;
seed in [0, 2^64); stop strings non-empty; top_logprobs in [0, 20]. The
per-row tensors given to `sample` are checked the same way, naming the row.

[PARAM-TYPE-1] A parameter of the wrong type raises `ParameterTypeError`, a
`TypeError` that is also a `ValueError` (so code reporting invalid parameters
by catching `ValueError` reports it too), naming the parameter, the value and
its type. Real parameters take any `numbers.Real` but bool (int, float, numpy
floats): not complex, str or None. Integer parameters take any
`numbers.Integral` but bool: not float, even 2.0. ignore_eos takes a bool;
stop a str or a sequence of str; stop_token_ids a sequence of integers;
logit_bias a mapping from integer token ids to reals; logprobs_mode the str
"raw" or "processed". Numbers are stored as Python int and float.

[PARAM-TENSOR-1] Parameters are validated for the tensors they become
(float32 and int64), so that none turns into inf, 0, a subnormal or an
overflow there. Every float parameter is 0 or rounds in float32 to a normal
number (finite, magnitude >= 2^-126): GPUs may flush subnormals to zero, and a
temperature or top_p of 1e-46 would become 0 (greedy; top-p keeping nothing).
temperature > 0 and repetition_penalty, which divide logits, lie in
[2^-126, 2^126], so that they and their reciprocals are normal float32 numbers
(CUDA's approximate division, `__fdividef`, returns 0 for divisors above
2^126). No bound keeps
z / θ finite for every finite logit z: a penalty that overflows a logit makes
its row invalid (SAMPLE-VALID-1). The integers top_k, max_tokens, min_tokens
and token ids become int64 and are at most 2^63 - 1; token ids are >= 0. The
seed, in [0, 2^64), becomes the int64 holding its bit pattern.

[PARAM-REQUEST-1] Against a model: token ids in the prompt, in logit_bias and
in stop_token_ids must be inside the vocabulary; the prompt must hold at least
one token and leave room for one generated token; prompt + max_tokens must fit
the model's context, and so must prompt + min_tokens. Prompt token ids are
integers (not bool, float or str; a tensor of an integer dtype, 1-D), checked
by `check_token_ids`, which an engine uses to turn them into Python ints.

[SAMPLE-SEED-1] A request without a seed gets one drawn from the engine's
generator (`resolve_seed`), and the seed used is reported back, so any
generation can be replayed.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

MAX_TOP_LOGPROBS = 20
FLOAT32_TINY = 2.0**-126  # the smallest normal float32
SCALE_MAX = 2.0**126  # the largest divisor whose float32 reciprocal is normal
INT64_MAX = 2**63 - 1


class ParameterTypeError(TypeError, ValueError):
    """A parameter of the wrong type (PARAM-TYPE-1).

    A `TypeError`, and a `ValueError` too, so that code reporting invalid
    parameters by catching `ValueError` (the CLI, an engine failing one
    request) reports this one as well.
    """


def _show(value: object) -> str:
    """The value for an error message: its repr, kept short."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"{'-' if value < 0 else ''}<an integer of {value.bit_length()} bits>"
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}...{text[-12:]}"


def _kind(value: object) -> str:
    """The type's name for an error message (module-qualified unless builtin)."""
    kind = type(value)
    module = kind.__module__.split(".")[0]
    return kind.__qualname__ if module == "builtins" else f"{module}.{kind.__qualname__}"


def _scalar(value: object) -> object:
    """A 0-d tensor of a real dtype as a Python number; anything else as is."""
    if (
        isinstance(value, Tensor)
        and value.dim() == 0
        and value.dtype != torch.bool
        and not value.dtype.is_complex
    ):
        return value.item()
    return value


def _check_real(name: str, value: object) -> float:
    """`value` as a float, or ParameterTypeError unless it is a real number (not bool)."""
    number = _scalar(value)
    if isinstance(number, bool) or not isinstance(number, numbers.Real):
        raise ParameterTypeError(
            f"{name} must be a real number, got {_show(value)} ({_kind(value)})"
        )
    try:
        return float(number)
    except OverflowError:  # an int beyond float64: the largest float, as far out as that
        return sys.float_info.max if number > 0 else -sys.float_info.max  # type: ignore[operator]


def _interval(low: float, high: float, low_open: bool, high_open: bool) -> str:
    return f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"


def _inside(x: float, low: float, high: float, low_open: bool, high_open: bool) -> bool:
    return (x > low if low_open else x >= low) and (x < high if high_open else x <= high)


def check_range(
    name: str,
    values: Tensor | float,
    low: float,
    high: float,
    *,
    low_open: bool = False,
    high_open: bool = False,
) -> None:
    """Raise ValueError naming `name` (and the row) if a value is outside the interval.

    NaN is outside every interval; so is ±inf unless an open end is infinite.
    A scalar that is not a real number raises `ParameterTypeError`.
    """
    if not isinstance(values, Tensor):
        if not _inside(_check_real(name, values), low, high, low_open, high_open):
            raise ValueError(
                f"{name} must be in {_interval(low, high, low_open, high_open)}, "
                f"got {_show(values)}"
            )
        return
    v = torch.as_tensor(values, dtype=torch.float64).cpu()
    ok = (v > low if low_open else v >= low) & (v < high if high_open else v <= high)
    if bool(ok.all()):
        return
    bad = (~ok).nonzero()[0].tolist()
    where = "" if v.dim() == 0 else "[" + ", ".join(map(str, bad)) + "]"
    # The offending value as given (an int stays an int in the message).
    value = values.cpu()[tuple(bad)].item()
    raise ValueError(
        f"{name}{where} must be in {_interval(low, high, low_open, high_open)}, got {value!r}"
    )


def check_integer(name: str, value: object) -> int:
    """`value` as an int, or `ParameterTypeError` naming `name` unless it is an
    integer (not bool; numpy integers and 0-d integer tensors are) (PARAM-TYPE-1)."""
    number = _scalar(value)
    if type(number) is int:
        return number
    if isinstance(number, bool) or not isinstance(number, numbers.Integral):
        raise ParameterTypeError(f"{name} must be an integer, got {_show(value)} ({_kind(value)})")
    return int(number)


def _check_int64(name: str, value: int) -> None:
    if value > INT64_MAX:
        raise ValueError(
            f"{name} must be at most 2**63 - 1 = {INT64_MAX} (it becomes an int64), "
            f"got {_show(value)}"
        )


def _float32(x: float) -> float:
    """x rounded to float32, as `sampling_tensors` stores it."""
    return torch.tensor(x, dtype=torch.float32).item()


def _check_float32(
    name: str, value: object, x: float, *, divisor: bool = False, zero: bool = True
) -> float:
    """Check that x (a finite, in-range `value`) survives float32 (PARAM-TENSOR-1).

    x must be 0 or round to a normal float32; a divisor must round into
    [2^-126, 2^126], so that its reciprocal is normal too. Returns x, with -0.0 as 0.0.
    """
    if x == 0:
        return 0.0
    f = abs(_float32(x))
    if f == 0:
        what = "underflows to 0 in float32"
    elif f < FLOAT32_TINY:
        what = "is a float32 subnormal, which GPUs may flush to 0"
    elif math.isinf(f):
        what = "overflows to inf in float32"
    elif divisor and f > SCALE_MAX:
        what = "is too large (its float32 reciprocal is subnormal)"
    else:
        return x
    if divisor:
        rule = "in [2**-126, 2**126] (1.1754944e-38 to 8.507059e+37), as it divides logits"
    else:
        rule = "at least 2**-126 = 1.1754944e-38 in magnitude (a normal float32)"
    hint = "; use 0 for greedy" if name == "temperature" and f < FLOAT32_TINY else ""
    rule = f"0 or {rule}" if zero else rule
    raise ValueError(f"{name} {_show(value)} {what}: it must be {rule}{hint}")


def _check_float(
    name: str,
    value: object,
    low: float,
    high: float,
    *,
    low_open: bool = False,
    high_open: bool = False,
    divisor: bool = False,
) -> float:
    """A real parameter: its type, its range, then its float32 rounding."""
    x = _check_real(name, value)
    if not _inside(x, low, high, low_open, high_open):
        raise ValueError(
            f"{name} must be in {_interval(low, high, low_open, high_open)}, got {_show(value)}"
        )
    zero = _inside(0.0, low, high, low_open, high_open)
    return _check_float32(name, value, x, divisor=divisor, zero=zero)


def _int_list(name: str, ids: object) -> list[int]:
    """Integer entries of a sequence (or 1-D integer tensor) as a list of Python ints."""
    if isinstance(ids, Tensor):
        if ids.dtype == torch.bool or ids.dtype.is_floating_point or ids.dtype.is_complex:
            raise ParameterTypeError(
                f"{name} must hold integer token ids, got a tensor of dtype {ids.dtype}"
            )
        if ids.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got a tensor of shape {list(ids.shape)}")
        return ids.tolist()
    if isinstance(ids, (str, bytes, bytearray, Mapping)) or not isinstance(ids, Iterable):
        raise ParameterTypeError(
            f"{name} must be a sequence of integer token ids, got {_show(ids)} ({_kind(ids)})"
        )
    return [t if type(t) is int else check_integer(f"{name}[{i}]", t) for i, t in enumerate(ids)]


def check_token_ids(name: str, ids: Sequence[int] | Tensor, vocab_size: int) -> list[int]:
    """Validate token ids and return them as a list of Python ints (PARAM-REQUEST-1).

    Each id must be an integer (not a bool, float or str; numpy integers and
    integer tensors are accepted) inside the vocabulary [0, vocab_size).

    Raises:
        ParameterTypeError: an entry (named by its index) is not an integer,
            or `ids` is not a sequence or is a tensor of a non-integer dtype.
        ValueError: a tensor that is not 1-D, or ids outside the vocabulary.

    Example:
        >>> check_token_ids("prompt_token_ids", torch.tensor([3, 1]), vocab_size=8)
        [3, 1]
        >>> check_token_ids("ids", [3, 1.0], vocab_size=8)
        Traceback (most recent call last):
        ...
        decodespec.spec.params.ParameterTypeError: ids[1] must be an integer, got 1.0 (float)
    """
    out = _int_list(name, ids)
    bad = [i for i, t in enumerate(out) if not 0 <= t < vocab_size]
    if bad:
        shown = ", ".join(_show(out[i]) for i in bad[:8]) + (", ..." if len(bad) > 8 else "")
        raise ValueError(
            f"{name} holds ids outside the vocabulary [0, {vocab_size}): [{shown}] "
            f"(the first at index {bad[0]})"
        )
    return out


def _check_token_id(name: str, value: object) -> int:
    token_id = check_integer(name, value)
    if token_id < 0:
        raise ValueError(f"{name} must be a token id >= 0, got {_show(value)}")
    _check_int64(name, token_id)
    return token_id


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops (PARAM-RANGE-1).

    Construction validates every field: a wrong type raises
    `ParameterTypeError` (PARAM-TYPE-1), a bad value `ValueError`
    (PARAM-RANGE-1, PARAM-TENSOR-1), naming the field and the value.
    Vocabulary- and model-dependent checks are in `validate_request`.

    Example:
        >>> SamplingParams(temperature=0.7, top_p=0.9, seed=1234, stop=["\\n\\n"]).stop
        ('\\n\\n',)
        >>> SamplingParams(temperature=1e-46)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: temperature 1e-46 underflows to 0 in float32: it must be 0 or ...
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    max_tokens: int | None = 16
    min_tokens: int = 0
    seed: int | None = None
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    top_logprobs: int | None = None
    logprobs_mode: Literal["raw", "processed"] = "raw"

    def __post_init__(self) -> None:
        # Every field is checked and stored normalised (Python numbers, tuples, a
        # dict), so the frozen object is really immutable.
        def put(name: str, value: object) -> None:
            object.__setattr__(self, name, value)

        inf = math.inf
        temperature = _check_float(
            "temperature", self.temperature, 0, inf, high_open=True, divisor=True
        )
        put("temperature", temperature)
        top_k = check_integer("top_k", self.top_k)
        _check_int64("top_k", top_k)
        check_range("top_k", top_k, 0, inf, high_open=True)
        put("top_k", top_k)
        put("top_p", _check_float("top_p", self.top_p, 0, 1, low_open=True))
        put("min_p", _check_float("min_p", self.min_p, 0, 1))
        put(
            "repetition_penalty",
            _check_float(
                "repetition_penalty",
                self.repetition_penalty,
                0,
                inf,
                low_open=True,
                high_open=True,
                divisor=True,
            ),
        )
        for name in ("frequency_penalty", "presence_penalty"):
            put(name, _check_float(name, getattr(self, name), -2, 2))

        if not isinstance(self.logit_bias, Mapping):
            raise ParameterTypeError(
                "logit_bias must be a mapping from token ids to biases, got "
                f"{_show(self.logit_bias)} ({_kind(self.logit_bias)})"
            )
        logit_bias = {}
        for key, bias in self.logit_bias.items():
            token_id = _check_token_id("logit_bias key", key)
            logit_bias[token_id] = _check_float(f"logit_bias[{token_id}]", bias, -100, 100)
        put("logit_bias", logit_bias)

        if self.max_tokens is not None:
            max_tokens = check_integer("max_tokens", self.max_tokens)
            _check_int64("max_tokens", max_tokens)
            check_range("max_tokens", max_tokens, 1, inf, high_open=True)
            put("max_tokens", max_tokens)
        min_tokens = check_integer("min_tokens", self.min_tokens)
        if self.max_tokens is None:
            high, bound = INT64_MAX, "2**63 - 1 (an int64)"
        else:
            high, bound = self.max_tokens, f"max_tokens={self.max_tokens}"
        if not 0 <= min_tokens <= high:
            raise ValueError(f"min_tokens must be in [0, {bound}], got {_show(self.min_tokens)}")
        put("min_tokens", min_tokens)
        if self.seed is not None:
            seed = check_integer("seed", self.seed)
            if not 0 <= seed < 2**64:
                raise ValueError(f"seed must be in [0, 2**64), got {_show(self.seed)}")
            put("seed", seed)

        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        elif isinstance(stop, (bytes, bytearray, Mapping, Tensor)) or not isinstance(
            stop, Iterable
        ):
            raise ParameterTypeError(
                f"stop must be a str or a sequence of str, got {_show(stop)} ({_kind(stop)})"
            )
        stop = tuple(stop)
        for i, s in enumerate(stop):
            if not isinstance(s, str):
                raise ParameterTypeError(f"stop[{i}] must be a str, got {_show(s)} ({_kind(s)})")
            if not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r} (stop[{i}])")
        put("stop", tuple(str(s) for s in stop))
        stop_ids = _int_list("stop_token_ids", self.stop_token_ids)
        for i, token_id in enumerate(stop_ids):
            _check_token_id(f"stop_token_ids[{i}]", token_id)
        put("stop_token_ids", tuple(stop_ids))
        if not isinstance(self.ignore_eos, bool):
            eos = self.ignore_eos
            raise ParameterTypeError(f"ignore_eos must be a bool, got {_show(eos)} ({_kind(eos)})")
        if self.top_logprobs is not None:
            top_logprobs = check_integer("top_logprobs", self.top_logprobs)
            check_range("top_logprobs", top_logprobs, 0, MAX_TOP_LOGPROBS)
            put("top_logprobs", top_logprobs)
        mode = self.logprobs_mode
        if not isinstance(mode, str):
            raise ParameterTypeError(
                f"logprobs_mode must be 'raw' or 'processed', got {_show(mode)} ({_kind(mode)})"
            )
        if mode not in ("raw", "processed"):
            raise ValueError(f"logprobs_mode must be 'raw' or 'processed', got {mode!r}")
        put("logprobs_mode", str(mode))

    def stop_ids(self, eos_token_ids: Iterable[int]) -> frozenset[int]:
        """Stop token ids: EOS ids (unless ignore_eos) ∪ the user's stop_token_ids."""
        eos = () if self.ignore_eos else tuple(eos_token_ids)
        return frozenset(eos) | frozenset(self.stop_token_ids)


def validate_request(
    params: SamplingParams,
    prompt_token_ids: Sequence[int] | Tensor,
    *,
    vocab_size: int,
    max_context: int,
) -> None:
    """Check a request against a model (PARAM-REQUEST-1); raise ValueError naming the field.

    A prompt whose ids are not integers raises `ParameterTypeError` (see
    `check_token_ids`).
    """
    if not isinstance(params, SamplingParams):
        raise ParameterTypeError(f"params must be a SamplingParams, got {_kind(params)}")
    n = len(check_token_ids("prompt_token_ids", prompt_token_ids, vocab_size))
    outside = [i for i in params.logit_bias if not 0 <= i < vocab_size]
    if outside:
        raise ValueError(
            f"logit_bias holds ids outside the vocabulary [0, {vocab_size}): {outside[:8]}"
        )
    check_token_ids("stop_token_ids", params.stop_token_ids, vocab_size)
    if n == 0:
        raise ValueError("prompt_token_ids must hold at least one token")
    if n >= max_context:
        raise ValueError(
            f"prompt_token_ids has {n} tokens; the model's context of {max_context} "
            "leaves no room to generate"
        )
    if params.max_tokens is not None and n + params.max_tokens > max_context:
        raise ValueError(
            f"max_tokens={params.max_tokens} with a {n}-token prompt exceeds the model's "
            f"context of {max_context} (at most {max_context - n}, or None to fill it)"
        )
    if n + params.min_tokens > max_context:
        raise ValueError(
            f"min_tokens={params.min_tokens} with a {n}-token prompt can never be reached "
            f"within the model's context of {max_context} (at most {max_context - n})"
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
) -> SamplingTensors:
    """The per-row tensors `sample` takes, for a batch of requests.

    Optional tensors are left out when no row needs them, so the common case
    (no bias, no penalties, no min_tokens) reads nothing of size vocab.
    Seeds must be resolved first (`resolve_seed`) for rows that sample.

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
