"""The torch backend's quantized projections on the CPU: PyTorch's kernels against the C product.

    python -m tests.benchmarks.quantized_product [--threads 2] [--rounds 5]
        [--out results/quantized-product-cpu.json]

For each of SmolLM2-135M's projection shapes stacked to a size that streams
from memory as a decode step does (a whole model's rows do not fit a CPU's
caches; one layer's do), and for the output projection, the milliseconds of:

- `pytorch`: `cpu_linear.CpuInt4Linear` / `CpuInt8Linear`, PyTorch's CPU
  weight-only kernels (bfloat16 activations), the torch backend's path
  without the C library;
- `c`: `cpu_linear.ActivationQuantizedLinear`, QUANT-A8-1's integer product in C
  (`native_quantized.c`), and its multiply-accumulates per second (`c_gmacs`),

at 1, 4, 16, 32, 64 and 128 tokens. Rounds interleave them; the best round counts.
Run it on a quiet machine, with `OMP_WAIT_POLICY=PASSIVE` (as the `decodespec`
command sets it): PyTorch's spinning OpenMP threads would hold the core the C
product's second thread needs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads libgomp

import torch

from decodespec.reference import cpu_linear, native_library
from decodespec.spec.quant import quantize_weight

# (name, bits, rows, in_features, group): SmolLM2-135M's four products a layer,
# 30 layers' rows stacked, and its output projection (the tied Q8_0 embedding,
# int8 per channel as the loader makes it).
SHAPES = (
    ("qkv ×30", 4, 960 * 30, 576, 32),
    ("o ×30", 4, 576 * 30, 576, 32),
    ("gate_up ×30", 4, 3072 * 30, 576, 32),
    ("down ×30", 4, 576 * 30, 1536, 32),
    ("output", 8, 49152, 576, 576),
)
TOKENS = (1, 4, 16, 32, 64, 128)


def best_ms(product, x: torch.Tensor, calls: int) -> float:
    product(x)
    start = time.perf_counter()
    for _ in range(calls):
        product(x)
    return (time.perf_counter() - start) / calls * 1e3


def measure(threads: int, rounds: int) -> list[dict]:
    torch.set_num_threads(threads)
    lib = native_library.library()
    rows = []
    for name, bits, n, k, group in SHAPES:
        weight = quantize_weight(torch.randn(n, k), bits=bits, group_size=group)
        ours = cpu_linear.ActivationQuantizedLinear(weight, lib)
        theirs = cpu_linear.CpuInt4Linear(weight) if bits == 4 else cpu_linear.CpuInt8Linear(weight)
        for tokens in TOKENS:
            x = torch.randn(tokens, k)
            calls = max(1, 16 // tokens)
            routes = {"pytorch": theirs.linear, "c": ours.linear}
            times = {route: [] for route in routes}
            for _ in range(rounds):
                for route, product in routes.items():
                    times[route].append(best_ms(product, x, calls))
            row = {"shape": name, "bits": bits, "rows": n, "in_features": k, "tokens": tokens,
                   **{f"{route}_ms": min(values) for route, values in times.items()}}  # fmt: skip
            row["c_gmacs"] = n * k * tokens / row["c_ms"] / 1e6
            row["speedup"] = row["pytorch_ms"] / row["c_ms"]
            summary = f"PyTorch {row['pytorch_ms']:8.2f} ms, C {row['c_ms']:8.2f} ms"
            print(f"{name:12} {tokens:3} tokens: {summary} ({row['c_gmacs']:.1f} GMAC/s), "
                  f"×{row['speedup']:.2f}", flush=True)  # fmt: skip
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("results/quantized-product-cpu.json"))
    args = parser.parse_args()
    rows = measure(args.threads, args.rounds)
    lib = native_library.library()
    report = {
        "command": f"python -m tests.benchmarks.quantized_product --threads {args.threads} "
        f"--rounds {args.rounds}",
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "threads": args.threads,
            "omp_wait_policy": os.environ["OMP_WAIT_POLICY"],
        },
        "versions": {
            "torch": torch.__version__,
            "compiler": native_library.describe(lib),
            "isa": lib.quantized_isa().decode(),
        },
        "results": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
