"""What one call of a kernel wrapper costs the host, counted without a GPU.

`record(call)` runs `call()` with every Triton launch replaced by a recording
stub (nothing runs; the outputs stay as allocated) under a dispatch mode that
sees every PyTorch operation the wrapper issues. It returns a `Recording`:

- `syncs`: operations that make the host wait for the device (`.item()`,
  `bool(t)`, `int(t)`, `.tolist()`, `nonzero`, a copy to the CPU, ...). On a
  GPU each stalls the launch queue and breaks CUDA-graph capture;
- `launches`: each Triton launch, with its kernel, grid, constexprs and the
  compile key Triton would specialise it under (`compile_key`);
- `small_ops`: the other operations that would each launch a kernel of
  PyTorch's (views and allocations are free and not counted).

Run wrappers on `meta` tensors where they accept them: a sync on a meta tensor
cannot even produce a value, so the counter sees what a GPU would.

`memory_traffic(call)` runs `call()` for real, in the Triton interpreter, and
counts the elements its kernels load and store: a kernel's passes over a row.

    rec = record(lambda: kernels.sample(logits, temperature=t, seed=s, errors=e))
    assert rec.syncs == [] and len(rec.launches) == 1
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Operations whose result the host needs before it can go on.
SYNC_OPS = {
    "aten._local_scalar_dense",  # .item(), bool(t), int(t), float(t)
    "aten.is_nonzero",
    "aten.nonzero",  # its output's size depends on the values
    "aten.masked_select",
    "aten.unique_dim",
    "aten._unique2",
    "aten.unique_consecutive",
    "aten.equal",
    "aten.allclose",
    "aten.repeat_interleave",
    "tolist",  # not a dispatched operation: counted by its own hook
}
# Operations that launch nothing on a GPU.
FREE_OPS = {
    "aten.empty",
    "aten.empty_like",
    "aten.empty_strided",
    "aten.detach",
    "aten.lift_fresh",
    "aten.alias",
    "prim.device",
    "aten.sym_size",
    "aten.sym_stride",
    "aten.sym_numel",
    "aten.sym_storage_offset",
    "aten.is_contiguous",
}


@dataclass
class Launch:
    kernel: str
    grid: tuple
    constexprs: dict[str, Any]
    compile_key: tuple


@dataclass
class Recording:
    syncs: list[str] = field(default_factory=list)
    launches: list[Launch] = field(default_factory=list)
    small_ops: list[str] = field(default_factory=list)

    def kernels(self) -> list[str]:
        return [launch.kernel for launch in self.launches]


def _op_name(func: Any) -> str:
    return str(func.overloadpacket) if hasattr(func, "overloadpacket") else str(func)


class _Counter(TorchDispatchMode):
    def __init__(self, recording: Recording) -> None:
        super().__init__()
        self.recording = recording

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _op_name(func)
        copies_to_cpu = name == "aten._to_copy" and _to_cpu(args, kwargs)
        if name in SYNC_OPS or copies_to_cpu:
            self.recording.syncs.append(name)
        elif name not in FREE_OPS and not getattr(func, "is_view", False):
            self.recording.small_ops.append(name)
        return func(*args, **kwargs)


def _to_cpu(args: tuple, kwargs: dict) -> bool:
    source = args[0] if args else None
    target = kwargs.get("device")
    return (
        isinstance(source, torch.Tensor)
        and source.device.type != "cpu"
        and target is not None
        and torch.device(target).type == "cpu"
    )


def _specialisation(value: object, specialise: bool) -> tuple:
    """How Triton's JIT keys an argument: a tensor by dtype (its pointer assumed
    16-byte aligned), an int by its width and, unless told not to, whether it is 1
    or a multiple of 16 (each variant is a separate compile)."""
    if isinstance(value, torch.Tensor):
        return ("*", str(value.dtype))
    if isinstance(value, bool):
        return ("i1",)
    if isinstance(value, int):
        width = "i32" if -(2**31) <= value < 2**31 else "i64"
        if not specialise:
            return (width,)
        return (width, "1" if value == 1 else "16" if value % 16 == 0 else "")
    if isinstance(value, float):
        return ("fp32",)
    return (type(value).__name__,)


def compile_key(kernel: Any, args: tuple, kwargs: dict) -> tuple:
    """The parts of a launch that select a compiled variant of `kernel`."""
    arg_names = list(kernel.arg_names)
    options = getattr(kernel, "kwargs", None) or {}
    not_specialised = set(options.get("do_not_specialize") or ())
    if hasattr(kernel, "do_not_specialize"):  # a JITFunction (no interpreter)
        not_specialised |= set(kernel.do_not_specialize)
    key = []
    for index, (name, value) in enumerate(zip(arg_names, args, strict=False)):
        specialise = name not in not_specialised and index not in not_specialised
        key.append((name, _specialisation(value, specialise)))
    key += sorted((name, repr(value)) for name, value in kwargs.items())
    return tuple(key)


def _stub_run(recording: Recording):
    def run(self, *args, grid, warmup, **kwargs):
        if warmup:
            return None
        resolved = grid(kwargs) if callable(grid) else tuple(grid)
        constexprs = {k: v for k, v in kwargs.items()}
        recording.launches.append(
            Launch(self.__name__, resolved, constexprs, compile_key(self, args, kwargs))
        )
        return None

    return run


@contextlib.contextmanager
def _stubbed_launches(recording: Recording):
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    saved = {cls: cls.run for cls in (InterpretedFunction, JITFunction)}
    saved_tolist = torch.Tensor.tolist

    def tolist(self: torch.Tensor):
        recording.syncs.append("tolist")
        return saved_tolist(self)

    try:
        for cls in saved:
            cls.run = _stub_run(recording)
        torch.Tensor.tolist = tolist
        yield
    finally:
        for cls, run in saved.items():
            cls.run = run
        torch.Tensor.tolist = saved_tolist


def record(call: Callable[[], object]) -> Recording:
    """Run `call()` with launches stubbed out; what it asked of the host and the device."""
    recording = Recording()
    with _stubbed_launches(recording), _Counter(recording):
        call()
    return recording


@dataclass
class Traffic:
    loaded: int = 0
    stored: int = 0


def memory_traffic(call: Callable[[], object]) -> Traffic:
    """The elements `call()`'s kernels load and store (masked-off lanes not counted).
    Needs the Triton interpreter (TRITON_INTERPRET=1 when the kernels were defined),
    whose unmasked loads and stores go through its masked ones."""
    import numpy as np
    from triton.runtime.interpreter import InterpreterBuilder as builder

    traffic = Traffic()
    masked_load, masked_store = builder.create_masked_load, builder.create_masked_store

    def counted_load(self, ptrs, mask, *args):
        traffic.loaded += int(np.count_nonzero(mask.data))
        return masked_load(self, ptrs, mask, *args)

    def counted_store(self, ptrs, value, mask, *args):
        traffic.stored += int(np.count_nonzero(mask.data))
        return masked_store(self, ptrs, value, mask, *args)

    try:
        builder.create_masked_load, builder.create_masked_store = counted_load, counted_store
        call()
    finally:
        builder.create_masked_load, builder.create_masked_store = masked_load, masked_store
    return traffic
