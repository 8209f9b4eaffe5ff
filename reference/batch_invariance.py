"""Batch-invariant mode: a request's logits are bitwise a function of the request alone.

Without it, a seeded request's tokens and logprobs can depend on what else the
engine is running (issue 40): the same row of a projection comes out of a
CPU GEMM in different bits when the GEMM has 1, 2, 3 or 5 rows than when it
has 16 or more (the BLAS picks another kernel and another summation order);
the torch backend's batched attention pads every sequence of a group to the
group's longest, which changes the length of each row's sums; and the native
decode step runs only passes of a few tokens, so a request's token takes the
C loops alone and the PyTorch path beside a prefill. Each is fixed here, for
every backend:

- every projection, the output one included, multiplies a multiple of
  `ROW_STEP` rows when it has fewer than `ROW_BLOCK`: the rest are zero rows,
  whose outputs are dropped (`RowBlockLinear`); a quantized one multiplies at
  most `ROW_BLOCK` rows a call, the row counts the tests check (the C product's
  rows are their own at any count; PyTorch's weight-only kernels, where the C
  library cannot be had, are another matter). A row's bits then depend on the
  row alone — measured on PyTorch 2.13's CPU GEMM for M = 1 … 2,048 and the
  model's shapes, and checked by `tests/engine/test_batch_invariance.py` on the
  machine that runs it;
- the KV append is the spec's own, and attention computes every query row as a
  sequence of its own (`rows_alone`): a row's bits would otherwise depend on
  how many rows its sequence has in the pass (ATTN-INVARIANT-1), which a cached
  prefix changes (a prompt's last token alone after the cache, among all of
  them without). On the CPU in float32 that is the native step's C attention,
  which computes each (row, head) alone in one order; elsewhere the spec's
  (`spec.attention.paged_attention`), one row at a time;
- the sampling stages (processors, sampling, logprobs, verification) run on one
  thread (`one_thread`): PyTorch splits a lone row's sums between threads;
- no native step: every pass takes the same PyTorch path;
- on the triton backend, quantized projections by the spec's definition, not the
  Triton `quantized_linear`, which computes fewer than 8 rows by another kernel
  than 8 or more.

The norms, RoPE and the MLP's elementwise steps already compute each row by
itself. `Engine(batch_invariant=True)`, `--batch-invariant` on
`generate` and `serve`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import fields, replace
from typing import TypeVar

import torch
from torch import Tensor

from decodespec.spec import append, attention
from decodespec.spec.forward import ModelWeights, Weight

from . import native_attention
from .backend import SPEC_BACKEND, Backend
from .native_library import NativeUnavailable

# A projection multiplies its rows as they are from ROW_BLOCK rows up; fewer are
# padded to a multiple of ROW_STEP, whose rows come out in the same bits (measured:
# 1, 2, 3, 5, 6, 9 or 10 rows do not, and padding all to 16 costs 16x at batch 1).
ROW_BLOCK = 16
ROW_STEP = 4
T = TypeVar("T")


class RowBlockLinear:
    """A projection that multiplies a multiple of `ROW_STEP` rows below `ROW_BLOCK`.

    Wraps a dense weight `[N, K]` or a quantized one (anything with `linear`);
    `unwrapped` is the wrapped one, whose `shape`, `nbytes`, `bits` and
    `group_size` it answers with.

    Example:
        >>> w = torch.randn(8, 4)
        >>> x = torch.randn(3, 4)
        >>> torch.allclose(RowBlockLinear(w).linear(x), x @ w.T)
        True
    """

    def __init__(self, weight: Weight) -> None:
        self.unwrapped = weight
        self.shape = tuple(weight.shape)

    def __getattr__(self, name: str) -> object:  # bits, group_size, nbytes, dtype, ...
        return getattr(self.__dict__["unwrapped"], name)

    def linear(self, x: Tensor) -> Tensor:
        rows = x.shape[0]
        if rows < ROW_BLOCK and rows % ROW_STEP:
            padded = x.new_zeros((-(-rows // ROW_STEP) * ROW_STEP, *x.shape[1:]))
            padded[:rows] = x
            return self._product(padded)[:rows]
        # A strided view (a slice of a wider tensor) takes another GEMM path than a
        # contiguous one: every call gets a contiguous input, whatever made it.
        return self._product(x.contiguous())

    def _product(self, x: Tensor) -> Tensor:
        if isinstance(self.unwrapped, Tensor):
            return x @ self.unwrapped.T
        if x.shape[0] > ROW_BLOCK:
            # A long pass goes to a quantized kernel `ROW_BLOCK` rows at a time, each
            # block's rows in the bits they have in any block.
            return torch.cat([self.linear(block) for block in x.split(ROW_BLOCK)])
        return self.unwrapped.linear(x)

    def dequantize(self) -> Tensor:
        return self.unwrapped if isinstance(self.unwrapped, Tensor) else self.unwrapped.dequantize()

    def to(self, device: torch.device | str) -> RowBlockLinear:
        return RowBlockLinear(self.unwrapped.to(device))


def row_blocked(weights: ModelWeights) -> ModelWeights:
    """`weights` with every projection and the output one a `RowBlockLinear` (the
    embedding, norms and biases as they are; a tied output still reads the
    embedding's tensor)."""

    def wrap(weight: Weight | None) -> Weight | None:
        if weight is None or isinstance(weight, RowBlockLinear):
            return weight
        return RowBlockLinear(weight)

    layers = [
        replace(layer, **{f.name: wrap(getattr(layer, f.name)) for f in fields(layer)
                          if f.name.endswith("_proj")})
        for layer in weights.layers
    ]  # fmt: skip
    return replace(weights, layers=layers, output=wrap(weights.output))


def one_thread(stage: Callable[..., T]) -> Callable[..., T]:
    """`stage` run on one intra-op thread: a row's sums then never split across threads.

    PyTorch reduces a `[rows, vocab]` tensor's rows in parallel when it has enough
    rows, and splits the one row of a `[1, vocab]` tensor between the threads
    otherwise, in another order: a request's logprobs alone then differ in their
    last bits from the same row beside others. On one thread every row is summed
    the same way. The sampling stages are a small part of a step's time."""

    @functools.wraps(stage)
    def on_one_thread(*args: object, **kwargs: object) -> T:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return stage(*args, **kwargs)
        finally:
            torch.set_num_threads(threads)

    return on_one_thread


def rows_alone(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    query_start: Tensor,
    *,
    scale: float | None = None,
    return_lse: bool = False,
    validate: bool = True,
) -> Tensor | tuple[Tensor, Tensor]:
    """`spec.attention.paged_attention` with each query row computed as a sequence of
    its own: the row at position p of a sequence attends to its p + 1 first
    positions as a one-row sequence of length p + 1 would (the causal mask's
    result, ATTN-CAUSAL-1). A row's bits then depend on the row, its position
    and the cache alone, never on how many rows its sequence runs in the pass:
    a prompt prefilled whole, in chunks or after a cached prefix gives each
    position the same keys and values, and its last token the same logits.
    Arguments, results and errors are `paged_attention`'s.

    On the CPU in float32 the native step's C attention computes it
    (`native_attention.paged_attention`): it computes each (row, head) alone, in
    one order whatever the rows beside it (tested per row in
    `tests/engine/test_native_step.py`). A 500-token int4 prompt on the torch
    backend reached its first token in 3.9-4.3 s, against 7.6-8.2 s by the
    spec's attention a row at a time. Elsewhere, or where the C library cannot
    be built, the spec's attention a row at a time."""
    if validate:
        attention.check_attention_args(
            q, k_cache, v_cache, block_table, seq_lens, query_start, scale
        )
    on_cpu = all(t.device.type == "cpu" for t in (q, k_cache, v_cache))
    if on_cpu and q.dtype == k_cache.dtype == v_cache.dtype == torch.float32:
        try:
            return native_attention.paged_attention(
                q, k_cache, v_cache, block_table, seq_lens, query_start,
                scale=scale, return_lse=return_lse, validate=False,
            )  # fmt: skip
        except NativeUnavailable:
            pass  # the spec's attention below: the same rows' bits, slower
    lens, starts = seq_lens.tolist(), query_start.tolist()
    sequence_of_row, length_of_row = [], []
    for b, seq_len in enumerate(lens):
        q_len = starts[b + 1] - starts[b]
        sequence_of_row += [b] * q_len
        length_of_row += range(seq_len - q_len + 1, seq_len + 1)
    index = torch.tensor(sequence_of_row, dtype=torch.int64, device=block_table.device)
    return attention.paged_attention(
        q,
        k_cache,
        v_cache,
        block_table.index_select(0, index),
        torch.tensor(length_of_row, dtype=seq_lens.dtype, device=seq_lens.device),
        torch.arange(len(sequence_of_row) + 1, dtype=query_start.dtype, device=query_start.device),
        scale=scale,
        return_lse=return_lse,
        validate=False,
    )


def batch_invariant_backend(backend: Backend) -> Backend:
    """`backend` with `rows_alone`'s attention and the spec's KV append, its sampling
    stages on one thread, no native step, and quantized projections on the CPU kernels
    or the spec's definition, never the Triton `quantized_linear` (a GEMV below 8 rows
    and a GEMM from 8: a row's bits would depend on its batch)."""
    prepare = backend.prepare_weights
    if "quantized_linear" in backend.kernel_ops:
        prepare = SPEC_BACKEND.prepare_weights
    return replace(
        backend,
        prepare_weights=prepare,
        paged_attention=rows_alone,
        append_kv=append.append_kv,
        sample=one_thread(backend.sample),
        process_logits=one_thread(backend.process_logits),
        compute_logprobs=one_thread(backend.compute_logprobs),
        verify_drafts=one_thread(backend.verify_drafts),
        native_step=lambda weights: None,
        kernel_ops=tuple(
            op
            for op in backend.kernel_ops
            if op not in ("paged_attention", "append_kv", "quantized_linear")
        ),
    )
