"""Checking one parameter value: its type, its interval, and what its tensor can hold.

`SamplingParams` (`decodespec.spec.params`) runs each field through these
checks, and `sample` its per-row tensors through `check_range`. Every error
names the parameter, in its message and as `.param`.

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
"""

from __future__ import annotations

import math
import numbers
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

FLOAT32_TINY = 2.0**-126  # the smallest normal float32
SCALE_MAX = 2.0**126  # the largest divisor whose float32 reciprocal is normal
INT64_MAX = 2**63 - 1


class ParameterError(ValueError):
    """An invalid parameter (PARAM-RANGE-1). `.param` is the field at fault: the
    name in the message without an entry's index or key ("logit_bias" for
    "logit_bias[5]" and "logit_bias key"), so that a server can name it."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.param = name.partition("[")[0].removesuffix(" key")


class ParameterTypeError(ParameterError, TypeError):
    """A parameter of the wrong type (PARAM-TYPE-1).

    A `TypeError`, and a `ValueError` too, so that code reporting invalid
    parameters by catching `ValueError` (the CLI, an engine failing one
    request) reports this one as well.
    """


class ContextLengthError(ParameterError):
    """A request that cannot fit the model's context (PARAM-REQUEST-1)."""


@dataclass(frozen=True)
class Range:
    """The interval of a parameter's valid values; an open end excludes its bound."""

    low: float
    high: float
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, x: float) -> bool:
        low, high = self.low, self.high
        return (x > low if self.low_open else x >= low) and (
            x < high if self.high_open else x <= high
        )

    def __str__(self) -> str:
        left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
        return f"{left}{self.low:g}, {self.high:g}{right}"

    def check(self, name: str, values: Tensor | float) -> None:
        """`check_range` of `values` against this interval."""
        check_range(
            name, values, self.low, self.high, low_open=self.low_open, high_open=self.high_open
        )


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


def check_real(name: str, value: object) -> float:
    """`value` as a float, or ParameterTypeError unless it is a real number (not bool)."""
    number = _scalar(value)
    if isinstance(number, bool) or not isinstance(number, numbers.Real):
        raise ParameterTypeError(
            name, f"{name} must be a real number, got {shown(value)} ({type_name(value)})"
        )
    try:
        return float(number)
    except OverflowError:  # an int beyond float64: the largest float, as far out as that
        return sys.float_info.max if number > 0 else -sys.float_info.max  # type: ignore[operator]


def check_range(
    name: str,
    values: Tensor | float,
    low: float,
    high: float,
    *,
    low_open: bool = False,
    high_open: bool = False,
) -> None:
    """Raise `ParameterError` naming `name` (and the row) if a value is outside the
    interval.

    NaN is outside every interval; so is ±inf unless an open end is infinite.
    A scalar that is not a real number raises `ParameterTypeError`.
    """
    interval = Range(low, high, low_open, high_open)
    if not isinstance(values, Tensor):
        if check_real(name, values) not in interval:
            raise ParameterError(name, f"{name} must be in {interval}, got {shown(values)}")
        return
    v = torch.as_tensor(values, dtype=torch.float64).cpu()
    ok = (v > low if low_open else v >= low) & (v < high if high_open else v <= high)
    if bool(ok.all()):
        return
    bad = (~ok).nonzero()[0].tolist()
    where = "" if v.dim() == 0 else "[" + ", ".join(map(str, bad)) + "]"
    # The offending value as given (an int stays an int in the message).
    value = values.cpu()[tuple(bad)].item()
    raise ParameterError(name, f"{name}{where} must be in {interval}, got {value!r}")


def check_integer(name: str, value: object) -> int:
    """`value` as an int, or `ParameterTypeError` naming `name` unless it is an
    integer (not bool; numpy integers and 0-d integer tensors are) (PARAM-TYPE-1)."""
    number = _scalar(value)
    if type(number) is int:
        return number
    if isinstance(number, bool) or not isinstance(number, numbers.Integral):
        raise ParameterTypeError(
            name, f"{name} must be an integer, got {shown(value)} ({type_name(value)})"
        )
    return int(number)


def check_int64(name: str, value: int) -> None:
    if value > INT64_MAX:
        raise ParameterError(
            name,
            f"{name} must be at most 2**63 - 1 = {INT64_MAX} (it becomes an int64), "
            f"got {shown(value)}",
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
    raise ParameterError(name, f"{name} {shown(value)} {what}: it must be {rule}{hint}")


def check_float(name: str, value: object, valid: Range, *, divisor: bool = False) -> float:
    """A real parameter: its type, its range, then its float32 rounding."""
    x = check_real(name, value)
    if x not in valid:
        raise ParameterError(name, f"{name} must be in {valid}, got {shown(value)}")
    return _check_float32(name, value, x, divisor=divisor, zero=0.0 in valid)


def check_int_list(name: str, ids: object) -> list[int]:
    """Integer entries of a sequence (or 1-D integer tensor) as a list of Python ints."""
    if isinstance(ids, Tensor):
        if ids.dtype == torch.bool or ids.dtype.is_floating_point or ids.dtype.is_complex:
            raise ParameterTypeError(
                name, f"{name} must hold integer token ids, got a tensor of dtype {ids.dtype}"
            )
        if ids.dim() != 1:
            raise ParameterError(
                name, f"{name} must be 1-D, got a tensor of shape {list(ids.shape)}"
            )
        return ids.tolist()
    if isinstance(ids, (str, bytes, bytearray, Mapping)) or not isinstance(ids, Iterable):
        raise ParameterTypeError(
            name,
            f"{name} must be a sequence of integer token ids, got {shown(ids)} ({type_name(ids)})",
        )
    return [t if type(t) is int else check_integer(f"{name}[{i}]", t) for i, t in enumerate(ids)]


def check_token_ids(name: str, ids: Sequence[int] | Tensor, vocab_size: int) -> list[int]:
    """Validate token ids and return them as a list of Python ints (PARAM-REQUEST-1).

    Each id must be an integer (not a bool, float or str; numpy integers and
    integer tensors are accepted) inside the vocabulary [0, vocab_size).

    Raises:
        ParameterTypeError: an entry (named by its index) is not an integer,
            or `ids` is not a sequence or is a tensor of a non-integer dtype.
        ParameterError: a tensor that is not 1-D, or ids outside the vocabulary.

    Example:
        >>> check_token_ids("prompt_token_ids", torch.tensor([3, 1]), vocab_size=8)
        [3, 1]
        >>> check_token_ids("ids", [3, 1.0], vocab_size=8)
        Traceback (most recent call last):
        ...
        decodespec.spec.checks.ParameterTypeError: ids[1] must be an integer, got 1.0 (float)
    """
    out = check_int_list(name, ids)
    bad = [i for i, t in enumerate(out) if not 0 <= t < vocab_size]
    if bad:
        listed = ", ".join(shown(out[i]) for i in bad[:8]) + (", ..." if len(bad) > 8 else "")
        raise ParameterError(
            name,
            f"{name} holds ids outside the vocabulary [0, {vocab_size}): [{listed}] "
            f"(the first at index {bad[0]})",
        )
    return out


def check_token_id(name: str, value: object) -> int:
    token_id = check_integer(name, value)
    if token_id < 0:
        raise ParameterError(name, f"{name} must be a token id >= 0, got {shown(value)}")
    check_int64(name, token_id)
    return token_id


def shown(value: object) -> str:
    """The value for an error message: its repr, kept short."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"{'-' if value < 0 else ''}<an integer of {value.bit_length()} bits>"
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}...{text[-12:]}"


def type_name(value: object) -> str:
    """The type's name for an error message (module-qualified unless builtin)."""
    kind = type(value)
    module = kind.__module__.split(".")[0]
    return kind.__qualname__ if module == "builtins" else f"{module}.{kind.__qualname__}"
