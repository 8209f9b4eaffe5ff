"""Copy-paste reproductions of the calls a failing test made.

`Implementation.op` wraps every operation under test with `recorded`; the
harness prints the recorded calls of a failing test (its last examples when
hypothesis shrinks) as a Python snippet that reruns them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch

# The last few calls of the running test, as (module, name, args, kwargs); the
# source text is only written when a test fails (it is slow for large tensors).
_CALLS: list[tuple[str, str, tuple, dict]] = []
_KEEP = 3  # the last few calls are enough to rerun a failure


def clear() -> None:
    _CALLS.clear()


def last_calls() -> list[str]:
    """The recorded calls of the running test, as Python snippets."""
    snippets = []
    for module, name, args, kwargs in _CALLS:
        arguments = [source(a) for a in args] + [f"{k}={source(v)}" for k, v in kwargs.items()]
        snippets.append(
            f"import torch\nfrom {module} import {name}\n{name}({', '.join(arguments)})"
        )
    return snippets


def _snapshot(value: Any) -> Any:
    """A copy of tensors (an operation may write into its arguments, e.g. a cache)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_snapshot(v) for v in value)
    if isinstance(value, dict):
        return {k: _snapshot(v) for k, v in value.items()}
    return value


def _number(x: float | int | bool) -> str:
    if isinstance(x, float) and not math.isfinite(x):
        return f'float("{x}")'
    return repr(x)


def source(value: Any) -> str:
    """Python source that rebuilds `value` (tensors exactly, with dtype and device)."""
    if isinstance(value, torch.Tensor) and value.device.type == "meta":  # no data to copy
        return f'torch.empty({tuple(value.shape)}, dtype={value.dtype}, device="meta")'
    if isinstance(value, torch.Tensor):
        data = value.detach().cpu()
        if data.dtype in (torch.bfloat16, torch.float16):
            data = data.float()  # exact: every value of these dtypes is a float32
        body = _nested(data.tolist())
        device = "" if value.device.type == "cpu" else f', device="{value.device}"'
        return f"torch.tensor({body}, dtype={value.dtype}{device})"
    if isinstance(value, (list, tuple)):
        items = ", ".join(source(v) for v in value)
        return (
            f"[{items}]"
            if isinstance(value, list)
            else f"({items}{',' if len(value) == 1 else ''})"
        )
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {source(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (float, int, bool)):
        return _number(value)
    return repr(value)


def _nested(values: Any) -> str:
    if isinstance(values, list):
        return "[" + ", ".join(_nested(v) for v in values) + "]"
    return _number(values)


def recorded(module: str, name: str, function: Callable) -> Callable:
    """`function`, recording each call as a reproduction snippet."""

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        _CALLS.append((module, name, _snapshot(args), _snapshot(kwargs)))
        del _CALLS[:-_KEEP]
        return function(*args, **kwargs)

    return call
