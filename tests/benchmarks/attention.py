"""GPU benchmark of `decodespec.kernels.paged_attention`: `make bench-attention`.

    python -m tests.benchmarks.attention [--out PATH] [--smoke]

Shapes (issue 4): decode of batch 1, 16 and 64 over contexts of 1k, 8k and 32k
positions (and 64k at batch 1), and a chunked prefill (batch 4, 512 new tokens
after 8192 cached ones); 32 query heads over 8 KV heads, head dim 128,
bfloat16, blocks of 16 positions handed out in a shuffled order, as an
allocator that has run for a while hands them out.

Per shape: our median time (arguments validated once, then timed with
`validate=False`), the split count the heuristic chose, the bytes the
operation must move (every sequence's keys and values read once, the queries
read and the output written once), the achieved GB/s and its share of the
measured copy bandwidth, and the relative error against PyTorch's
`scaled_dot_product_attention`. Peers, timed in the same process on the same
inputs: SDPA and FlexAttention on a contiguous copy of the cache, FlashInfer's
paged decode on the same paged cache. A peer that is missing or fails is
recorded as `{"unavailable": reason}`. The targets of the issue are evaluated
from the measurements. Results: `results/attention-gpu.json`.

Without a CUDA GPU the command refuses (exit status 2) unless `--smoke` asks
for tiny shapes in the Triton interpreter, a check of the command itself.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from types import ModuleType
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from decodespec.spec.registry import OPERATIONS
from tests.benchmarks.gpu import (
    RESULTS,
    PeerUnavailable,
    parse_args,
    report_header,
    start_run,
    write_json,
)

COMMAND = "python -m tests.benchmarks.attention"
DEFAULT_OUT = RESULTS / "attention-gpu.json"
FLASHINFER_WORKSPACE_BYTES = 128 << 20
PEERS = ("sdpa", "flex_attention", "flashinfer")


@dataclass(frozen=True)
class Shape:
    """One benchmark case: `batch` sequences of `seq_len` positions, the last `q_len` new."""

    batch: int
    seq_len: int
    q_len: int
    num_kv_heads: int = 8
    group: int = 4
    head_dim: int = 128
    block_size: int = 16
    dtype: str = "bfloat16"

    @property
    def name(self) -> str:
        if self.q_len == 1:
            return f"decode b{self.batch} ctx{self.seq_len}"
        return f"prefill b{self.batch} q{self.q_len} ctx{self.seq_len}"

    @property
    def num_q_heads(self) -> int:
        return self.num_kv_heads * self.group

    @property
    def num_tokens(self) -> int:
        return self.batch * self.q_len

    @property
    def blocks_per_seq(self) -> int:
        return -(-self.seq_len // self.block_size)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


def issue_shapes() -> list[Shape]:
    """The shapes of issue 4, smallest first."""
    decode = [
        Shape(batch, seq_len, q_len=1) for batch in (1, 16, 64) for seq_len in (1024, 8192, 32768)
    ]
    return [*decode, Shape(1, 65536, q_len=1), Shape(4, 8192 + 512, q_len=512)]


def smoke_shapes() -> list[Shape]:
    """Tiny shapes for the interpreter, in float32 (its bfloat16 arithmetic is wrong).

    The prefill's length is not a multiple of the block size, so its last block
    has unused slots (NaN, like every slot no sequence uses).
    """
    tiny = {"num_kv_heads": 2, "group": 4, "head_dim": 64, "dtype": "float32"}
    return [Shape(2, 64, q_len=1, **tiny), Shape(2, 40, q_len=8, **tiny)]


# Targets of issue 4: (shape, minimum percent of the measured copy bandwidth).
BANDWIDTH_TARGETS = ((Shape(64, 8192, q_len=1), 90.0), (Shape(1, 65536, q_len=1), 85.0))


@dataclass
class Inputs:
    """One shape's tensors: the paged cache and packed queries, and SDPA's contiguous layout."""

    q: Tensor  # [num_tokens, num_q_heads, head_dim]
    k_cache: Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: Tensor
    block_table: Tensor  # [batch, blocks_per_seq], a shuffled permutation of the blocks
    seq_lens: Tensor  # [batch]
    query_start: Tensor  # [batch + 1]
    q_dense: Tensor  # [batch, num_q_heads, q_len, head_dim]
    k_dense: Tensor  # [batch, num_kv_heads, seq_len, head_dim]
    v_dense: Tensor


def to_paged(dense: Tensor, block_table: Tensor, block_size: int) -> Tensor:
    """Scatter `[batch, heads, seq_len, dim]` into a paged cache; unused slots hold NaN."""
    _, heads, seq_len, dim = dense.shape
    num_blocks = block_table.numel()
    cache = torch.full(
        (num_blocks, block_size, heads, dim), math.nan, dtype=dense.dtype, device=dense.device
    )
    position = torch.arange(seq_len, device=dense.device)
    slots = block_table.long()[:, position // block_size] * block_size + position % block_size
    cache.view(-1, heads, dim)[slots.flatten()] = dense.transpose(1, 2).reshape(-1, heads, dim)
    return cache


def make_inputs(shape: Shape, device: torch.device) -> Inputs:
    """Random queries, keys and values (standard normal) for `shape`, in both layouts."""
    dtype = shape.torch_dtype
    kv_shape = (shape.batch, shape.num_kv_heads, shape.seq_len, shape.head_dim)
    k_dense = torch.randn(kv_shape, dtype=dtype, device=device)
    v_dense = torch.randn(kv_shape, dtype=dtype, device=device)
    num_blocks = shape.batch * shape.blocks_per_seq
    block_table = torch.randperm(num_blocks, device=device).int().view(shape.batch, -1)
    q = torch.randn(shape.num_tokens, shape.num_q_heads, shape.head_dim, dtype=dtype, device=device)
    q_dense = q.view(shape.batch, shape.q_len, shape.num_q_heads, shape.head_dim).transpose(1, 2)
    return Inputs(
        q=q,
        k_cache=to_paged(k_dense, block_table, shape.block_size),
        v_cache=to_paged(v_dense, block_table, shape.block_size),
        block_table=block_table,
        seq_lens=torch.full((shape.batch,), shape.seq_len, dtype=torch.int32, device=device),
        query_start=torch.arange(shape.batch + 1, dtype=torch.int32, device=device) * shape.q_len,
        q_dense=q_dense.contiguous(),
        k_dense=k_dense,
        v_dense=v_dense,
    )


def bytes_moved(shape: Shape) -> int:
    """Every sequence's keys and values read once, the queries read, the output written."""
    itemsize = shape.torch_dtype.itemsize
    kv = 2 * shape.batch * shape.seq_len * shape.num_kv_heads * shape.head_dim
    q_and_out = 2 * shape.num_tokens * shape.num_q_heads * shape.head_dim
    return (kv + q_and_out) * itemsize


def relative_error(out: Tensor, reference: Tensor) -> float:
    """‖out − reference‖ / ‖reference‖, in float32."""
    out, reference = out.float(), reference.float()
    return ((out - reference).norm() / reference.norm()).item()


def from_dense(out: Tensor) -> Tensor:
    """SDPA's `[batch, heads, q_len, dim]` output as packed rows `[num_tokens, heads, dim]`."""
    batch, heads, q_len, dim = out.shape
    return out.transpose(1, 2).reshape(batch * q_len, heads, dim)


# ---------------------------------------------------------------- the peers
# Each prepares a call on the inputs (planning and compiling happen there,
# outside the timing); only the call itself is timed.


class PeerCall(NamedTuple):
    """A peer's prepared call, and how its output becomes packed rows (for the error)."""

    call: Callable[[], Tensor]
    to_rows: Callable[[Tensor], Tensor]


def sdpa_call(shape: Shape, inputs: Inputs, smoke: bool) -> PeerCall:
    """PyTorch SDPA; several rows per sequence get a bottom-right causal mask."""
    from torch.nn.attention.bias import causal_lower_right

    mask = causal_lower_right(shape.q_len, shape.seq_len) if shape.q_len > 1 else None

    def call() -> Tensor:
        return F.scaled_dot_product_attention(
            inputs.q_dense, inputs.k_dense, inputs.v_dense, attn_mask=mask, enable_gqa=True
        )

    return PeerCall(call, from_dense)


def flex_attention_call(shape: Shape, inputs: Inputs, smoke: bool) -> PeerCall:
    """FlexAttention, compiled (run eagerly in --smoke); bottom-right causal block mask."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError as error:
        raise PeerUnavailable(f"torch {torch.__version__} has no FlexAttention") from error

    block_mask = None
    if shape.q_len > 1:
        offset = shape.seq_len - shape.q_len

        def causal_bottom_right(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return kv_idx <= q_idx + offset

        block_mask = create_block_mask(
            causal_bottom_right, None, None, shape.q_len, shape.seq_len, device=inputs.q.device
        )
    if smoke:  # eager: the interpreter run checks the call, not its speed
        warnings.filterwarnings("ignore", "flex_attention called without torch.compile")
        attend = flex_attention
    else:
        torch.compiler.reset()  # a fresh compile per shape: no recompile limit, no dynamic shapes
        attend = torch.compile(flex_attention, dynamic=False)

    def call() -> Tensor:
        return attend(
            inputs.q_dense, inputs.k_dense, inputs.v_dense, block_mask=block_mask, enable_gqa=True
        )

    return PeerCall(call, from_dense)


def flashinfer_call(shape: Shape, inputs: Inputs, smoke: bool) -> PeerCall:
    """FlashInfer's batch decode over the same paged cache (NHD layout), planned here."""
    if inputs.q.device.type != "cuda":
        raise PeerUnavailable("FlashInfer runs on CUDA GPUs only")
    if shape.q_len != 1:
        raise PeerUnavailable("the decode wrapper takes one query row per sequence")
    import flashinfer

    device = inputs.q.device
    workspace = torch.empty(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, kv_layout="NHD")
    blocks = shape.blocks_per_seq
    indptr = torch.arange(shape.batch + 1, dtype=torch.int32, device=device) * blocks
    last_block_len = shape.seq_len - (blocks - 1) * shape.block_size
    last_page_len = torch.full((shape.batch,), last_block_len, dtype=torch.int32, device=device)
    wrapper.plan(
        indptr,
        inputs.block_table.flatten(),
        last_page_len,
        shape.num_q_heads,
        shape.num_kv_heads,
        shape.head_dim,
        shape.block_size,
        q_data_type=shape.torch_dtype,
        kv_data_type=shape.torch_dtype,
    )
    return PeerCall(
        lambda: wrapper.run(inputs.q, (inputs.k_cache, inputs.v_cache)), lambda out: out
    )


PEER_CALLS = {
    "sdpa": sdpa_call,
    "flex_attention": flex_attention_call,
    "flashinfer": flashinfer_call,
}


def measure_peer(
    name: str, shape: Shape, inputs: Inputs, smoke: bool, timer: Callable
) -> tuple[dict, Tensor | None]:
    """A peer's median time and output as packed rows, or `{"unavailable": reason}` and None."""
    try:
        peer = PEER_CALLS[name](shape, inputs, smoke)
        out = peer.to_rows(peer.call())
        ms = timer(peer.call)
    except PeerUnavailable as reason:
        return {"unavailable": str(reason)}, None
    except Exception as error:  # a peer's failure is a result, not the end of the run
        return {"unavailable": f"{type(error).__name__}: {error}"}, None
    return {"median_ms": ms}, out


# ---------------------------------------------------------------- ours


def measure_ours(
    shape: Shape, inputs: Inputs, kernels: ModuleType, copy_GBps: float, timer: Callable
) -> tuple[dict, Tensor]:
    """Our time, bandwidth and split count, and the output of one validated call."""
    args = (
        inputs.q,
        inputs.k_cache,
        inputs.v_cache,
        inputs.block_table,
        inputs.seq_lens,
        inputs.query_start,
    )
    out = kernels.paged_attention(*args)  # validated once

    def ours() -> Tensor:
        return kernels.paged_attention(*args, validate=False)

    num_splits = kernels.attention.default_num_splits(
        inputs.q, inputs.k_cache, inputs.block_table, inputs.seq_lens
    )
    ms = timer(ours)
    nbytes = bytes_moved(shape)
    GBps = nbytes / (ms * 1e-3) / 1e9
    measured = {"median_ms": ms, "bytes": nbytes, "GBps": GBps}
    measured["percent_of_copy_bandwidth"] = 100 * GBps / copy_GBps
    measured["num_splits"] = num_splits
    return measured, out


def measure_peers(
    shape: Shape, inputs: Inputs, ours_ms: float, smoke: bool, timer: Callable
) -> tuple[dict, Tensor | None]:
    """Each peer's time and ratio to ours, and SDPA's output (the reference) if it ran."""
    peers = {}
    outputs = {}
    for name in PEERS:
        peers[name], outputs[name] = measure_peer(name, shape, inputs, smoke, timer)
        if "median_ms" in peers[name]:
            peers[name]["ratio"] = peers[name]["median_ms"] / ours_ms
    reference = outputs["sdpa"]
    for name in PEERS:
        if reference is not None and name != "sdpa" and outputs[name] is not None:
            peers[name]["relative_error_vs_sdpa"] = relative_error(outputs[name], reference)
    return peers, reference


def benchmark_shape(
    shape: Shape, kernels: ModuleType, copy_GBps: float, smoke: bool, timer: Callable
) -> dict:
    """Ours and every peer on one shape, on the same inputs; ours checked against SDPA."""
    inputs = make_inputs(shape, torch.device("cpu" if smoke else "cuda"))
    ours, out = measure_ours(shape, inputs, kernels, copy_GBps, timer)
    peers, reference = measure_peers(shape, inputs, ours["median_ms"], smoke, timer)
    if reference is not None:
        rtol = OPERATIONS["paged_attention"].tolerance.rtol[shape.torch_dtype]
        ours["relative_error_vs_sdpa"] = relative_error(out, reference)
        ours["within_tolerance"] = ours["relative_error_vs_sdpa"] <= rtol
    return {"name": shape.name, "shape": asdict(shape), "ours": ours, "peers": peers}


# ---------------------------------------------------------------- targets


def fastest_peer(result: dict) -> tuple[str, float] | None:
    """The name and time of the fastest peer that ran on a shape, or None."""
    times = {
        name: peer["median_ms"] for name, peer in result["peers"].items() if "median_ms" in peer
    }
    if not times:
        return None
    name = min(times, key=times.__getitem__)
    return name, times[name]


def bandwidth_target(results: dict[str, dict], shape: Shape, percent: float) -> dict:
    """At least `percent` of the measured copy bandwidth on `shape` (None: shape not run)."""
    result = results.get(shape.name)
    measured = result["ours"]["percent_of_copy_bandwidth"] if result else None
    return {
        "target": f">= {percent:g}% of the measured copy bandwidth at {shape.name}",
        "threshold_percent": percent,
        "measured_percent": measured,
        "met": None if measured is None else measured >= percent,
    }


def peer_target(results: dict[str, dict]) -> dict:
    """No slower than the fastest peer on any shape (None: no peer ran)."""
    slower, compared = [], 0
    for name, result in results.items():
        fastest = fastest_peer(result)
        if fastest is None:
            continue
        compared += 1
        peer, peer_ms = fastest
        if result["ours"]["median_ms"] > peer_ms:
            slower.append(
                {"shape": name, "peer": peer, "ratio": peer_ms / result["ours"]["median_ms"]}
            )
    return {
        "target": "no slower than the fastest peer on any shape",
        "shapes_compared": compared,
        "slower_than_fastest_peer": slower,
        "met": None if compared == 0 else not slower,
    }


def evaluate_targets(results: list[dict]) -> list[dict]:
    """The targets of issue 4, each with `met` true, false or None (not measured)."""
    by_name = {result["name"]: result for result in results}
    targets = [bandwidth_target(by_name, shape, percent) for shape, percent in BANDWIDTH_TARGETS]
    return [*targets, peer_target(by_name)]


# ---------------------------------------------------------------- the report


TABLE_COLUMNS = f"{'shape':<26}{'splits':>7}{'ours ms':>10}{'GB/s':>8}{'% copy':>8}{'rel err':>10}"


def format_row(result: dict) -> str:
    """One shape as a table row; peers as peer time / our time (> 1: we are faster)."""
    ours = result["ours"]
    error = ours.get("relative_error_vs_sdpa")
    row = (
        f"{result['name']:<26}{ours['num_splits']!s:>7}{ours['median_ms']:>10.4f}"
        f"{ours['GBps']:>8.0f}{ours['percent_of_copy_bandwidth']:>8.1f}"
        f"{'-' if error is None else f'{error:.1e}':>10}"
    )
    for name in PEERS:
        ratio = result["peers"][name].get("ratio")
        row += f"{'n/a' if ratio is None else f'{ratio:.2f}x':>16}"
    return row


def format_summary(report: dict) -> str:
    """Why peers were unavailable, and the targets."""
    lines = []
    reasons = {
        (name, peer["unavailable"])
        for result in report["shapes"]
        for name, peer in result["peers"].items()
        if "unavailable" in peer
    }
    lines += [f"{name} unavailable: {reason}" for name, reason in sorted(reasons)]
    for target in report["targets"]:
        met = {True: "met", False: "NOT met", None: "not measured"}[target["met"]]
        lines.append(f"target {target['target']}: {met}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(COMMAND, __doc__.split("\n\n")[0], DEFAULT_OUT, argv)
    run = start_run(COMMAND, args.smoke)
    copy = run.copy_bandwidth
    print(f"copy bandwidth: {copy['GBps']:.0f} GB/s; peers: peer ms / our ms")
    print(TABLE_COLUMNS + "".join(f"{name:>16}" for name in PEERS))
    results = []
    for shape in smoke_shapes() if args.smoke else issue_shapes():
        results.append(benchmark_shape(shape, run.kernels, copy["GBps"], run.smoke, run.timer))
        print(format_row(results[-1]), flush=True)
        if run.device.type == "cuda":
            torch.cuda.empty_cache()

    report = {
        **report_header("attention-gpu", "bench-attention", run),
        "shapes": results,
        "targets": evaluate_targets(results),
    }
    print(format_summary(report))
    write_json(args.out, report)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
