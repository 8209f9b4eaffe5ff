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

_CALLS: list[str] = []
_KEEP = 3  # the last few calls are enough to rerun a failure


def clear() -> None:
    _CALLS.clear()


def last_calls() -> list[str]:
    return list(_CALLS)


def _number(x: float | int | bool) -> str:
    if isinstance(x, float) and not math.isfinite(x):
        return f'float("{x}")'
    return repr(x)


def source(value: Any) -> str:
    """Python source that rebuilds `value` (tensors exactly, with dtype and device)."""
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
        arguments = [source(a) for a in args] + [f"{k}={source(v)}" for k, v in kwargs.items()]
        _CALLS.append(f"import torch\nfrom {module} import {name}\n{name}({', '.join(arguments)})")
        del _CALLS[:-_KEEP]
        return function(*args, **kwargs)

    return call
