"""Argument checks shared by the kernels' wrappers.

Kernels never check anything (`tl.device_assert` is off in normal builds and
never fires in the interpreter), so a wrong shape, dtype, device or index
must be caught here, before a launch turns it into an out-of-bounds access.
Every error is a ValueError whose message names the argument; an argument
that is not a tensor at all raises `ArgumentTypeError`, a TypeError that is
also a ValueError (the spec's SOFTMAX-VALID-1: SAMPLE-VALID-3, ATTN-VALID-1,
APPEND-VALID-1, VERIFY-VALID-1).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)

# Triton reads TRITON_INTERPRET when the kernels are decorated, that is when this
# package is imported: CPU tensors are only usable when it was set by then.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


class ArgumentTypeError(TypeError, ValueError):
    """An argument that must be a tensor and is not (the spec's class of the same name).

    A `TypeError`, and a `ValueError` too, so that callers catching the
    ValueErrors of these checks catch this one as well.
    """


def check_tensor(name: str, value: object) -> Tensor:
    """`value` if it is a `torch.Tensor`; else `ArgumentTypeError` naming `name`."""
    if not isinstance(value, Tensor):
        raise ArgumentTypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def check_vocabulary(name: str, t: Tensor) -> int:
    """The size of the last dimension of `t`, the vocabulary, if it is at least 1; else
    ValueError naming `name`: a row of no column would launch a loop of step 0."""
    if t.dim() == 0 or t.shape[-1] == 0:
        raise ValueError(
            f"{name} must have at least one column (vocabulary size 0), got shape {list(t.shape)}"
        )
    return t.shape[-1]


def check_kernel_device(name: str, t: Tensor) -> None:
    """Raise unless `t` lives where the kernels can run: a GPU, or the CPU in the interpreter."""
    if t.device.type == "cpu" and not INTERPRET:
        raise ValueError(
            f"{name} is on the CPU: the Triton kernels need GPU tensors, or the Triton "
            "interpreter (set TRITON_INTERPRET=1 before importing kernels)"
        )


def check_index_tensor(name: str, t: Tensor, shape: list[int], device: torch.device) -> None:
    """Raise unless `t` is an int32/int64 tensor of `shape` on `device`."""
    check_tensor(name, t)
    if list(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {list(t.shape)}")
    if t.dtype not in INDEX_DTYPES:
        raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")


def check_caches(k_cache: Tensor, v_cache: Tensor) -> tuple[int, int, int, int]:
    """Two equal, contiguous 4-D float caches on one device.

    Returns:
        `(num_blocks, block_size, num_kv_heads, head_dim)`.
    """
    check_tensor("k_cache", k_cache)
    check_tensor("v_cache", v_cache)
    if k_cache.dim() != 4:
        raise ValueError(
            "k_cache must have shape [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {list(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(
            f"v_cache must have k_cache's shape {list(k_cache.shape)}, got {list(v_cache.shape)}"
        )
    if k_cache.dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"k_cache must be float16, bfloat16, float32 or float64, got {k_cache.dtype}"
        )
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache must have k_cache's dtype {k_cache.dtype}, got {v_cache.dtype}")
    if v_cache.device != k_cache.device:
        raise ValueError(f"v_cache is on {v_cache.device}, k_cache on {k_cache.device}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous (slots are rows of a flat view)")
    check_kernel_device("k_cache", k_cache)
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    if block_size < 1 or num_kv_heads < 1 or head_dim < 1:
        raise ValueError(
            "k_cache must have block_size, num_kv_heads and head_dim >= 1, "
            f"got shape {list(k_cache.shape)}"
        )
    return num_blocks, block_size, num_kv_heads, head_dim


LOGITS_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_logits(logits: Tensor) -> None:
    """A `[batch, vocab]` float tensor with a vocabulary (SAMPLE-VALID-3): a row of no
    column would launch a loop of step 0."""
    check_tensor("logits", logits)
    if logits.dim() != 2:
        raise ValueError(f"logits must be [batch, vocab], got shape {list(logits.shape)}")
    if logits.dtype not in LOGITS_DTYPES:
        raise ValueError(
            f"logits must be float16, bfloat16 or float32 for the Triton kernels, got "
            f"{logits.dtype}"
        )
    check_vocabulary("logits", logits)
    check_kernel_device("logits", logits)


# ---------------------------------------------------------------- error words
#
# A wrapper checks on the host only what the host already knows: shapes, dtypes,
# devices. A *value* (a parameter's range, an index, a NaN in the logits) lives on the
# device, and reading it there is a device-to-host sync that stalls the launch queue.
# So the kernel checks values and writes one int32 error word per row of its call (0:
# fine; otherwise bits its module names), and a value that would index memory is
# masked first, so a bad one never reads or writes outside its tensors. The caller
# reads the words when it chooses: pass `errors=` and no wrapper syncs; omit it and the
# wrapper reads them once after its launch and raises, with the message its host
# checks give (`raise_for_errors`).


def error_words(errors: Tensor | None, rows: int, device: torch.device) -> Tensor:
    """The `[rows]` int32 error words a launch writes: `errors`, checked, or new ones,
    zeroed (the wrapper reads those itself: a word no program wrote reads as fine,
    never as stale memory)."""
    if errors is None:
        return torch.zeros(rows, dtype=torch.int32, device=device)
    check_tensor("errors", errors)
    if list(errors.shape) != [rows] or errors.dtype != torch.int32 or not errors.is_contiguous():
        raise ValueError(
            f"errors must be a contiguous [{rows}] int32 tensor, got "
            f"{list(errors.shape)} {errors.dtype}"
        )
    if errors.device != device:
        raise ValueError(f"errors is on {errors.device}, expected {device}")
    return errors


def raise_for_errors(errors: Tensor, explain) -> None:
    """One device-to-host read of `errors`; if a word is nonzero, `explain()` raises the
    error that names the argument and the row (it may read the device freely: this is
    the failing path). An `explain` that finds nothing is a kernel bug, said so."""
    if not bool(errors.any()):
        return
    explain()
    raise RuntimeError(f"a kernel reported error words {errors.tolist()} that no check explains")
