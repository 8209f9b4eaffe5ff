"""Batch-invariant mode, for the engines not batch-invariant by construction.

The default engine (the torch backend on the CPU, with the C library) needs no
mode: every pass runs its native step, which computes each row alone in C (its
products, QUANT-A8-1's or `native_dense.c`'s, sum each row in one order fixed by
the weight's shape; its attention each (row, head) alone), and its sampling
stages run a lone row on one thread (`backend.lone_row_on_one_thread`): a seeded
request's bits are its own whatever the batch (LOOP-INVARIANT-1).
`Engine(batch_invariant=True)` there changes nothing.

Elsewhere (the spec and triton backends, bfloat16 weights, no C library) a
request's tokens and logprobs can depend on what else the engine is running
(issue 40): the same row of a projection comes out of a CPU GEMM in different
bits when the GEMM has 1, 2, 3 or 5 rows than when it has 16 or more (the BLAS
picks another kernel and another summation order); the torch backend's batched
attention pads every sequence of a group to the group's longest, which changes
the length of each row's sums. The mode fixes each, where the machine allows:

- every projection, the output one included, multiplies a multiple of
  `ROW_STEP` rows when it has fewer than `ROW_BLOCK`: the rest are zero rows,
  whose outputs are dropped (`RowBlockLinear`); a quantized one multiplies at
  most `ROW_BLOCK` rows a call. That a row's bits then depend on the row alone
  is a premise about the machine's GEMM, not a property of PyTorch: it held on
  the development machine's CPU (an AMD EPYC, AVX2: PyTorch 2.13's CPU GEMM
  for M = 1 … 2,048 and the model's shapes) and failed on an Intel Xeon
  (AVX-512), whose GEMM sums a row in another order among 16 rows than among 4.
  So the engine checks it where it runs (`require_row_invariance`): every
  product of the model that goes through PyTorch (a dense GEMM, the spec's
  quantized definition, PyTorch's weight-only kernels) is measured once per
  process and shape (`row_invariance`), and where a row's bits change with
  the row count the engine refuses the mode (`BatchInvarianceUnavailable`).
  The C library's products (`cpu_linear.ActivationQuantizedLinear`,
  `cpu_linear.DenseLinear`) compute each row alone by construction, on any
  machine, and are not measured;
- the KV append is the spec's own, and attention computes every query row as a
  sequence of its own (`rows_alone`): a row's bits would otherwise depend on
  how many rows its sequence has in the pass (ATTN-INVARIANT-1), which a cached
  prefix changes (a prompt's last token alone after the cache, among all of
  them without). On the CPU in float32 that is the native step's C attention,
  which computes each (row, head) alone in one order; elsewhere the spec's
  (`spec.attention.paged_attention`), one row at a time;
- the sampling stages (processors, sampling, logprobs, verification) run on one
  thread when it is alone (`lone_row_on_one_thread`): PyTorch splits a lone
  row's sums between threads;
- no native step (there is none where the mode applies): every pass takes the
  same PyTorch path;
- on the triton backend, quantized projections by the spec's definition, not the
  Triton `quantized_linear`, which computes fewer than 8 rows by another kernel
  than 8 or more.

The norms, RoPE and the MLP's elementwise steps already compute each row by
itself. `Engine(batch_invariant=True)`, `--batch-invariant` on
`generate` and `serve` (a refusal is their error, exit status 2).
"""

from __future__ import annotations

import platform
import re
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch
from torch import Tensor

from decodespec.spec import append, attention
from decodespec.spec.forward import ModelWeights, Weight
from decodespec.spec.quant import QuantizedWeight

from . import cpu_linear, native_attention, native_library
from .backend import SPEC_BACKEND, Backend, lone_row_on_one_thread
from .native_library import NativeUnavailable
from .weight_formats import describe

# A projection multiplies its rows as they are from ROW_BLOCK rows up; fewer are
# padded to a multiple of ROW_STEP, whose rows come out in the same bits where the
# premise holds (measured on the development machine: 1, 2, 3, 5, 6, 9 or 10 rows do
# not, and padding all to 16 costs 16x at batch 1; `row_invariance` checks it here).
ROW_BLOCK = 16
ROW_STEP = 4
# The row counts `row_invariance` multiplies a row among, through `RowBlockLinear` as
# the mode does: 2, 5, 10 and 15 are padded to GEMMs of 4, 8, 12 and 16 rows; from 16
# up a dense projection multiplies them as they are (`checked_rows`).
CHECKED_ROWS = (2, 5, 10, 15, 16, 17, 33, 100, 257)
# Beyond 33 rows, a row count is checked where its GEMM costs at most this many flops
# (2 M N K): every count for the projections of a model like the bundled one, up to 33
# for its 49,152-row output projection, whose GEMM of 257 rows would take seconds.
CHECK_FLOPS = 10**9


def dense_product(x: Tensor, weight: Tensor) -> Tensor:
    """`x @ weight.T`: the GEMM through which `RowBlockLinear` multiplies a dense weight,
    and `row_invariance` the spec's dequantized definition (a name of its own, so that
    a test can stand a machine's GEMM in for it)."""
    return x @ weight.T


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
            return dense_product(x, self.unwrapped)
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
        sample=lone_row_on_one_thread(backend.sample),
        process_logits=lone_row_on_one_thread(backend.process_logits),
        compute_logprobs=lone_row_on_one_thread(backend.compute_logprobs),
        verify_drafts=lone_row_on_one_thread(backend.verify_drafts),
        native_step=lambda weights: None,
        kernel_ops=tuple(
            op
            for op in backend.kernel_ops
            if op not in ("paged_attention", "append_kv", "quantized_linear")
        ),
    )


class BatchInvarianceUnavailable(ValueError):
    """The mode's premise fails on this machine for these weights and this backend: a
    row's bits through one of their projections depend on how many rows share the
    call (`require_row_invariance` says which, and what works instead)."""


@dataclass(frozen=True)
class RowInvariance:
    """What `row_invariance` measured for one product: `product` says what multiplies
    (e.g. "float32 GEMM [512, 256]"), `rows` the row counts a row was multiplied among,
    `disagreeing` those at which it came out in other bits than alone."""

    product: str
    rows: tuple[int, ...]
    disagreeing: tuple[int, ...]

    @property
    def holds(self) -> bool:
        return not self.disagreeing


def measure_rows(
    weight: Weight,
    dtype: torch.dtype = torch.float32,
    rows: Sequence[int] | None = None,
    *,
    device: torch.device | str = "cpu",
    product: str = "",
) -> RowInvariance:
    """Whether a row through `RowBlockLinear(weight)` comes out in its bits alone among
    each of `rows` rows, as the mode multiplies it (uncached: `row_invariance`).

    A random row `dtype` on `device` is multiplied alone (padded to `ROW_STEP` rows)
    and then as the first, middle and last row of each batch of `rows` (default
    `checked_rows`), the others random; a batch where any of the three differs from
    alone in any bit disagrees. `weight` is a dense `[N, K]` tensor or anything with
    `shape` and `linear`."""
    blocked = RowBlockLinear(weight)
    if rows is None:
        rows = checked_rows(blocked.shape, dense=isinstance(weight, Tensor))
    columns = blocked.shape[1]
    generator = torch.Generator().manual_seed(0)

    def draw(count: int) -> Tensor:
        return torch.randn(count, columns, generator=generator).to(device=device, dtype=dtype)

    probe = draw(1)
    disagreeing = []
    with torch.no_grad():
        alone = blocked.linear(probe)[0]
        for count in rows:
            batch = draw(count)
            places = sorted({0, count // 2, count - 1})
            batch[places] = probe
            out = blocked.linear(batch)
            if not all(torch.equal(out[place], alone) for place in places):
                disagreeing.append(count)
    return RowInvariance(product or f"{list(blocked.shape)}", tuple(rows), tuple(disagreeing))


def checked_rows(shape: Sequence[int], *, dense: bool = True) -> tuple[int, ...]:
    """The `CHECKED_ROWS` that `measure_rows` tries for a projection `[N, K]`: up to 33
    (16 + 16 + 1) all, beyond only a dense one's whose GEMM costs at most `CHECK_FLOPS`.
    A quantized projection multiplies `ROW_BLOCK` rows a call at most: a longer batch
    would only repeat the calls of 16 rows and of the rest padded.

    Example:
        >>> checked_rows((576, 576)), checked_rows((49152, 576))[-1]
        ((2, 5, 10, 15, 16, 17, 33, 100, 257), 33)
    """
    n, k = shape

    def checked(rows: int) -> bool:
        return rows <= 2 * ROW_BLOCK + 1 or (dense and 2 * rows * n * k <= CHECK_FLOPS)

    return tuple(filter(checked, CHECKED_ROWS))


class _Definition:
    """`spec.quant.quantized_linear`'s GEMM for a quantized weight: its dequantized
    weights (a contiguous `[N, K]`, as the definition makes them every call) multiplied
    in the compute dtype. The same GEMM call, without dequantizing it again each time."""

    def __init__(self, weight: QuantizedWeight, compute: torch.dtype) -> None:
        self.dense = weight.dequantize().to(compute).contiguous()
        self.shape, self.compute = tuple(weight.shape), compute

    def linear(self, x: Tensor) -> Tensor:
        return dense_product(x.to(self.compute), self.dense).to(x.dtype)


# row_invariance's verdicts, by product (kind, shape, dtype, layout, device, threads)
_VERDICTS: dict[tuple, RowInvariance] = {}


def row_invariance(
    weight: Weight, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> RowInvariance | None:
    """`measure_rows` for one of the model's projections in the mode (a
    `RowBlockLinear` or what it wraps) with activations `dtype` on `device`, measured
    once per process for each product: its kind, shape, dtypes and layout, the device
    and PyTorch's thread count (what a GEMM's choice of kernel depends on; the weights'
    values are not). None for the C library's product (`ActivationQuantizedLinear`),
    which computes every row alone by construction.

    What is measured is the product the mode runs: a dense weight through the GEMM, a
    spec-defined quantized one (the spec backend's, the triton backend's in the mode,
    any off the CPU) through its dequantized weights' float32 GEMM, PyTorch's CPU
    weight-only kernels (the torch backend's where the C library cannot be had) and
    anything else through its own `linear`."""
    weight = weight.unwrapped if isinstance(weight, RowBlockLinear) else weight
    member = isinstance(weight, cpu_linear.SharedInputMember)
    kernel = weight.shared.kernel if member else weight
    if isinstance(kernel, cpu_linear.ActivationQuantizedLinear):
        return None
    shape, device = list(kernel.shape), torch.device(device)
    rows, subject = checked_rows(shape, dense=False), lambda: weight
    if isinstance(weight, Tensor):
        what = f"{str(weight.dtype).removeprefix('torch.')} GEMM {shape}"
        key: tuple = ("dense", weight.dtype, weight.stride())
        rows = checked_rows(shape)
    elif isinstance(weight, QuantizedWeight):
        compute = torch.promote_types(dtype, torch.float32)
        what = (f"int{weight.bits} by the spec's definition, a "
                f"{str(compute).removeprefix('torch.')} GEMM {shape}")  # fmt: skip
        key = ("definition", weight.bits, compute)
        subject = lambda: _Definition(weight, compute)  # noqa: E731
    elif isinstance(kernel, (cpu_linear.CpuInt4Linear, cpu_linear.CpuInt8Linear)):
        what = f"int{kernel.bits} by PyTorch's weight-only kernel {shape}"
        key = (type(kernel).__name__, kernel.group_size)
    else:
        what = f"{type(kernel).__name__} {shape}"
        key = (type(kernel).__name__, getattr(kernel, "bits", None),
               getattr(kernel, "group_size", None))  # fmt: skip
    key = (*key, tuple(shape), dtype, str(device), torch.get_num_threads())
    if key not in _VERDICTS:
        _VERDICTS[key] = measure_rows(subject(), dtype, rows, device=device, product=what)
    return _VERDICTS[key]


def premise_failures(weights: ModelWeights) -> list[tuple[tuple[str, ...], RowInvariance]]:
    """The products of `weights` (prepared by the mode's backend) through which a row's
    bits depend on how many rows share the call on this machine, each with the names
    of the projections it multiplies (`q_proj`, ..., `output`); empty where the
    premise holds."""
    named = [(f.name, getattr(layer, f.name)) for layer in weights.layers for f in fields(layer)
             if f.name.endswith("_proj")]  # fmt: skip
    found: dict[str, tuple[list[str], RowInvariance]] = {}
    for name, weight in [*named, ("output", weights.output)]:
        if weight is None:
            continue
        verdict = row_invariance(weight, weights.dtype, weights.device)
        if verdict is None or verdict.holds:
            continue
        names = found.setdefault(verdict.product, ([], verdict))[0]
        if name not in names:
            names.append(name)
    return [(tuple(names), verdict) for names, verdict in found.values()]


def require_row_invariance(backend: str, *models: ModelWeights | None) -> None:
    """Refuse the mode where its premise fails here for `models` (the model and its
    draft model, prepared by the `backend`'s mode and row-blocked).

    Raises:
        BatchInvarianceUnavailable: naming the weights and backend, the machine's
            evidence (which row counts gave a row other bits, through which
            product and projections) and what works instead.
    """
    for model in models:
        if model is None:
            continue
        failures = premise_failures(model)
        if failures:
            raise BatchInvarianceUnavailable(_refusal(backend, model, failures))


def _machine(device: torch.device) -> str:
    """PyTorch's GEMM on `device`, in a few words: the CPU, its vector unit, the BLAS."""
    if device.type == "cuda":
        return f"PyTorch {torch.__version__}'s GEMM on {torch.cuda.get_device_name(device)}"
    cpu = platform.processor() or platform.machine()
    try:
        names = re.findall(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
        cpu = names[0].strip() if names else cpu
    except OSError:
        pass
    found = re.search(r"BLAS_INFO=(\w+)", torch.__config__.show())
    blas, isa = found[1] if found else "?", torch.backends.cpu.get_cpu_capability()
    return f"PyTorch {torch.__version__}'s CPU GEMM on {cpu} ({isa}, BLAS {blas})"


def _what_works() -> str:
    """The configuration whose projections need no premise, and whether it can be had."""
    works = (
        "float32, int8 or int4 weights on the torch backend on the CPU (the commands' "
        "default backend; `Engine(weights, tokenizer, backend='torch')`), batch-invariant "
        "by construction with no option: its native step multiplies each row alone in C "
        "at any row count"
    )
    try:
        if native_library.disabled():
            raise NativeUnavailable("DECODESPEC_NATIVE=0")
        native_library.library()
    except NativeUnavailable as why:
        return f"{works}; but the C library cannot be had here ({why})"
    return works


def _refusal(backend: str, model: ModelWeights, failures: list) -> str:
    """One line: what is refused and why, the evidence by row counts, what works."""
    by_rows: dict[tuple, list[str]] = {}
    for names, verdict in failures:
        products = by_rows.setdefault((verdict.rows, verdict.disagreeing), [])
        products.append(f"{', '.join(names)} ({verdict.product})")
    evidence = "; ".join(
        f"a row alone and among {', '.join(map(str, rows))} rows gave other bits among "
        f"{', '.join(map(str, disagreeing))} through {', '.join(products)}"
        for (rows, disagreeing), products in by_rows.items()
    )
    return (
        f"batch-invariant mode refused for {describe(model)}, backend {backend}: the mode pads "
        f"a projection's rows to a multiple of {ROW_STEP} below {ROW_BLOCK} on the premise "
        f"that a row's bits then do not depend on the row count, which this machine's GEMM "
        f"breaks. Measured on {_machine(model.device)}: {evidence}. What works: "
        f"{_what_works()}."
    )
