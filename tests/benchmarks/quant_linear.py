"""GPU benchmark of `decodespec.kernels.quantized_linear`: a stage of `make gpu-check`.

    python -m tests.benchmarks.quant_linear [--out PATH] [--smoke]

Shapes: decode (M = 1) and prefill (M = 256) through SmolLM2-135M's MLP
projections (gate/up 1536 × 576, down 576 × 1536) and a 4096 × 4096 matrix,
with int4 codes (groups of 32, like GGUF Q4_1) and int8 codes (groups of 32,
like Q8_0), bfloat16 activations.

Per case: our median time, the bytes the operation must move (codes, scales
and offsets read once, x read once, the output written once), the achieved
GB/s and its share of the measured copy bandwidth, and the relative error
against the spec evaluated in float64 (within QUANT-TOL-1's 1e-2 for
bfloat16). Peer, timed in the same process: the dense bfloat16 product
`x @ W.T` on the dequantized weights (what the format saves: its bytes are
`N · K · 2`), with its GB/s and the ratio of its time to ours (> 1: we are
faster). Results: `results/quant_linear-gpu.json`.

Without a CUDA GPU the command refuses (exit status 2) unless `--smoke` asks
for tiny shapes in the Triton interpreter, a check of the command itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from types import ModuleType

import torch

from decodespec.spec import quant
from decodespec.spec.registry import OPERATIONS
from tests.benchmarks.gpu import RESULTS, parse_args, report_header, start_run, write_json

COMMAND = "python -m tests.benchmarks.quant_linear"
DEFAULT_OUT = RESULTS / "quant_linear-gpu.json"


@dataclass(frozen=True)
class Case:
    """`x [m, k] · W[n, k]ᵀ` with `bits`-bit codes in groups of `group_size`."""

    matrix: str
    m: int
    n: int
    k: int
    bits: int
    group_size: int = 32
    dtype: str = "bfloat16"

    @property
    def name(self) -> str:
        phase = "decode" if self.m == 1 else f"prefill m{self.m}"
        return f"{self.matrix} {self.n}x{self.k} int{self.bits} {phase}"

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


MATRICES = (("smollm2 gate/up", 1536, 576), ("smollm2 down", 576, 1536), ("4096", 4096, 4096))


def gpu_cases() -> list[Case]:
    return [
        Case(matrix, m, n, k, bits)
        for matrix, n, k in MATRICES
        for bits in (4, 8)
        for m in (1, 256)
    ]


def smoke_cases() -> list[Case]:
    """Tiny shapes for the interpreter, in float32 (its bfloat16 arithmetic is wrong)."""
    return [
        Case("tiny", m, 48, 64, bits, group_size=16, dtype="float32")
        for bits in (4, 8)
        for m in (1, 20)
    ]


def make_weight(case: Case, device: torch.device) -> quant.QuantizedWeight:
    """Random weights (normal, 0.02 like an initialised projection), quantized by the spec."""
    weight = torch.randn(case.n, case.k, device=device) * 0.02
    return quant.quantize_weight(weight, bits=case.bits, group_size=case.group_size)


def bytes_moved(case: Case, weight: quant.QuantizedWeight) -> int:
    """Codes, scales and offsets read once, x read once, the output written once."""
    itemsize = case.torch_dtype.itemsize
    return weight.nbytes + (case.m * case.k + case.m * case.n) * itemsize


def relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    out, reference = out.double(), reference.double()
    return ((out - reference).norm() / reference.norm()).item()


def benchmark_case(
    case: Case, kernels: ModuleType, device: torch.device, copy_GBps: float, timer: Callable
) -> dict:
    """Ours and the dense product on one case, on the same x; ours checked against the spec."""
    weight = make_weight(case, device)
    x = torch.randn(case.m, case.k, device=device).to(case.torch_dtype)
    args = (x, weight.qweight, weight.scales, weight.offsets)
    kwargs = {"group_size": case.group_size, "bits": case.bits}
    out = kernels.quantized_linear(*args, **kwargs)
    reference = quant.quantized_linear(
        x.double(), weight.qweight, weight.scales.double(), weight.offsets.double(), **kwargs
    )
    ms = timer(lambda: kernels.quantized_linear(*args, **kwargs))
    nbytes = bytes_moved(case, weight)
    error = relative_error(out, reference)
    ours = {
        "median_ms": ms,
        "bytes": nbytes,
        "GBps": nbytes / (ms * 1e-3) / 1e9,
        "relative_error_vs_spec_float64": error,
        "within_tolerance": error <= OPERATIONS["quantized_linear"].tolerance.rtol[x.dtype],
    }
    ours["percent_of_copy_bandwidth"] = 100 * ours["GBps"] / copy_GBps
    dense_weight = weight.dequantize().to(case.torch_dtype)
    dense_ms = timer(lambda: x @ dense_weight.T)
    dense_bytes = dense_weight.numel() * dense_weight.element_size() + nbytes - weight.nbytes
    dense = {
        "median_ms": dense_ms,
        "bytes": dense_bytes,
        "GBps": dense_bytes / (dense_ms * 1e-3) / 1e9,
        "ratio": dense_ms / ms,
    }
    return {"name": case.name, "case": asdict(case), "ours": ours, "dense": dense}


TABLE = (
    f"{'case':<36}{'ours ms':>10}{'GB/s':>8}{'% copy':>8}{'rel err':>10}"
    f"{'dense ms':>10}{'dense GB/s':>12}{'dense/ours':>12}"
)


def format_row(result: dict) -> str:
    ours, dense = result["ours"], result["dense"]
    return (
        f"{result['name']:<36}{ours['median_ms']:>10.4f}{ours['GBps']:>8.0f}"
        f"{ours['percent_of_copy_bandwidth']:>8.1f}"
        f"{ours['relative_error_vs_spec_float64']:>10.1e}{dense['median_ms']:>10.4f}"
        f"{dense['GBps']:>12.0f}{dense['ratio']:>11.2f}x"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(COMMAND, __doc__.split("\n\n")[0], DEFAULT_OUT, argv)
    run = start_run(COMMAND, args.smoke)
    copy = run.copy_bandwidth
    print(f"copy bandwidth: {copy['GBps']:.0f} GB/s; dense: x @ W.T, W dequantized, in x's dtype")
    print(TABLE)
    results = []
    for case in smoke_cases() if args.smoke else gpu_cases():
        results.append(benchmark_case(case, run.kernels, run.device, copy["GBps"], run.timer))
        print(format_row(results[-1]), flush=True)
    report = {
        **report_header("quant_linear-gpu", "gpu-check", run),
        "cases": results,
        "all_within_tolerance": all(r["ours"]["within_tolerance"] for r in results),
    }
    write_json(args.out, report)
    print(f"wrote {args.out}")
    return 0 if report["all_within_tolerance"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
