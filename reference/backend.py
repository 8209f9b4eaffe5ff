"""Backends: the stage functions the engine calls, spec, batched PyTorch or kernels.

The spec and the kernels provide the same operations with the same
signatures (ARCHITECTURE.md, "The stage contract"), so the engine's code is
one for all; a backend is the table of functions it calls:

- `spec`: the spec's functions, the definition itself;
- `torch`: the spec's functions, but attention batched across sequences
  (`batched_attention`), projections on the C products (`cpu_linear`), every
  pass in C between them (`native_step`), and a lone row's sampling stages on
  one thread (`lone_row_on_one_thread`): the fast choice on a CPU, the commands' default, and a
  request's bits its own whatever the batch;
- `triton`: the kernels (the Triton interpreter without a GPU), quantized
  projections included (`KernelLinear`).
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TypeVar

import torch
from torch import Tensor

from decodespec.spec import append, attention, sampling, speculative
from decodespec.spec.forward import ModelWeights
from decodespec.spec.quant import QuantizedWeight
from decodespec.spec.sampling import InvalidLogitsError

from . import batched_attention, cpu_linear, native_step
from .weight_formats import map_quantized

BACKENDS = ("spec", "torch", "triton")
# `generate`'s and `serve`'s default: the fastest that conforms (the spec's stages, with
# attention batched and the decode step native, checked by the conformance suite).
DEFAULT_BACKEND = "torch"

STAGE_OPERATIONS = (
    "paged_attention",
    "append_kv",
    "sample",
    "process_logits",
    "compute_logprobs",
    "verify_drafts",
)


@dataclass(frozen=True)
class Backend:
    """The stage functions the engine calls (spec and kernels share their signatures).

    `kernel_ops` names the stages that run as Triton kernels; the others run
    the spec's PyTorch. `invalid_logits_error` is the class `sample` raises
    for invalid rows (SAMPLE-VALID-2: each implementation has its own).
    `native_step(weights)` gives a whole forward pass's replacement for short
    passes of prepared `weights` (`native_step.NativeStep`), or None: then
    every pass runs the spec's decoder with this table's stages.
    """

    name: str
    paged_attention: Callable[..., Tensor]
    append_kv: Callable[..., None]
    sample: Callable[..., Tensor]
    process_logits: Callable[..., Tensor]
    compute_logprobs: Callable[..., sampling.Logprobs]
    verify_drafts: Callable[..., speculative.Verification]
    invalid_logits_error: type[ValueError] = InvalidLogitsError
    kernel_ops: tuple[str, ...] = ()
    prepare_weights: Callable[[ModelWeights], ModelWeights] = lambda weights: weights
    native_step: Callable[[ModelWeights], native_step.NativeStep | None] = lambda weights: None


class KernelLinear:
    """A quantized projection multiplied by the kernels' `quantized_linear` (the same
    signature as the spec's, QUANT-LINEAR-1): the triton backend's."""

    def __init__(self, weight: QuantizedWeight, quantized_linear: Callable[..., Tensor]) -> None:
        self.weight = weight
        self.quantized_linear = quantized_linear
        self.shape, self.bits, self.group_size = weight.shape, weight.bits, weight.group_size
        self.nbytes = weight.nbytes

    def linear(self, x: Tensor) -> Tensor:
        w = self.weight
        return self.quantized_linear(
            x, w.qweight, w.scales, w.offsets, group_size=w.group_size, bits=w.bits
        )

    def dequantize(self) -> Tensor:
        return self.weight.dequantize()

    def to(self, device: torch.device | str) -> KernelLinear:
        return KernelLinear(self.weight.to(device), self.quantized_linear)


T = TypeVar("T")


def lone_row_on_one_thread(stage: Callable[..., T]) -> Callable[..., T]:
    """`stage` (whose first argument's rows are the batch) with a batch of one row run
    on one intra-op thread: a row's sums then never split across threads.

    PyTorch reduces the rows of a `[rows, vocab]` tensor one thread each, every row
    by the loop one thread runs, but splits the one row of a `[1, vocab]` tensor
    between its threads, in another order: a request's logprobs alone differed in
    their last bits from the same row beside others (9.5e-7, issue 60). On one
    thread a lone row is reduced by that same loop. Only a lone row: a batch keeps
    its threads (all on one thread, 16 streams served 0.66x as fast: sampling there
    is most of a step). `tests/engine/test_batch_invariance.py` checks every stage,
    a row alone against batches of 2 to 16, on 2 and 3 threads."""

    @functools.wraps(stage)
    def run(rows: Tensor, *args: object, **kwargs: object) -> T:
        threads = torch.get_num_threads()
        if threads == 1 or rows.shape[0] != 1:
            return stage(rows, *args, **kwargs)
        torch.set_num_threads(1)
        try:
            return stage(rows, *args, **kwargs)
        finally:
            torch.set_num_threads(threads)

    return run


def prepare_for_torch(weights: ModelWeights) -> ModelWeights:
    """The torch backend's weights: projections on the CPU kernels (`cpu_linear`) when
    the model is on the CPU; elsewhere the definition."""
    return cpu_linear.pack_for_cpu(weights) if weights.device.type == "cpu" else weights


SPEC_BACKEND = Backend(
    "spec",
    attention.paged_attention,
    append.append_kv,
    sampling.sample,
    sampling.process_logits,
    sampling.compute_logprobs,
    speculative.verify_drafts,
)


TORCH_BACKEND = replace(
    SPEC_BACKEND,
    name="torch",
    paged_attention=batched_attention.paged_attention,
    append_kv=batched_attention.append_kv,
    sample=lone_row_on_one_thread(sampling.sample),
    process_logits=lone_row_on_one_thread(sampling.process_logits),
    compute_logprobs=lone_row_on_one_thread(sampling.compute_logprobs),
    verify_drafts=lone_row_on_one_thread(speculative.verify_drafts),
    prepare_weights=prepare_for_torch,
    native_step=native_step.native_step,
)


def get_backend(name: str) -> Backend:
    """`spec` (the spec's PyTorch), `torch` (the spec's, attention batched across
    sequences) or `triton` (the kernels; the interpreter without a GPU).

    The triton backend takes every stage `kernels` provides and the spec's
    function for any it lacks (a partial vendored copy, say): they share the
    signatures. Without a CUDA device it selects the Triton interpreter,
    which has to happen before `kernels` is first imported.
    """
    if name == "spec":
        return SPEC_BACKEND
    if name == "torch":
        return TORCH_BACKEND
    if name != "triton":
        raise ValueError(f"unknown backend {name!r}: choose one of {', '.join(BACKENDS)}")
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    kernels = importlib.import_module("decodespec.kernels")
    provided = tuple(op for op in STAGE_OPERATIONS if hasattr(kernels, op))
    functions = {
        op: getattr(kernels if op in provided else SPEC_BACKEND, op) for op in STAGE_OPERATIONS
    }
    error = kernels.InvalidLogitsError if "sample" in provided else InvalidLogitsError
    prepare = SPEC_BACKEND.prepare_weights
    if hasattr(kernels, "quantized_linear"):
        provided = (*provided, "quantized_linear")

        def prepare(weights: ModelWeights) -> ModelWeights:
            return map_quantized(weights, lambda w: KernelLinear(w, kernels.quantized_linear))

    return Backend(
        "triton", **functions, invalid_logits_error=error, kernel_ops=provided,
        prepare_weights=prepare,
    )  # fmt: skip


def check_backend_device(backend: Backend, device: torch.device) -> None:
    """Raise ValueError unless the backend's kernels can run on tensors on `device`."""
    if not backend.kernel_ops or device.type != "cpu":
        return
    if not importlib.import_module("decodespec.kernels.checks").INTERPRET:
        raise ValueError(
            "the triton backend needs the model on a GPU (device 'cuda'), or the Triton "
            "interpreter (TRITON_INTERPRET=1) for a model on the CPU"
        )
