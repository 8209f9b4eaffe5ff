"""Everything that needs a GPU, in one command: `make gpu-check` (issue 17).

One device call on a lent H100/H200 should run this and bring back its
results. Stages, each in a subprocess with a time limit of its own so that
one that hangs or crashes leaves the others their minutes:

1. `tests`: the conformance suite and the kernel tests with large shapes
   (`DECODESPEC_SIZES=large`: batches to 64, vocabularies to 262,144,
   contexts to 64k, the 64-bit addressing case) in float32, float16 and
   bfloat16 (the suites' own parameters);
2. `attention`, `sampling`, `quant_linear`: the kernel benchmarks against
   their peers (`results/attention-gpu.json`, `results/sampling-gpu.json`,
   `results/quant_linear-gpu.json`: int4/int8 decode and prefill against the
   dense bfloat16 product);
3. `engine`: the bundled model on the GPU with the spec, torch and triton
   backends: greedy tokens must equal the spec backend's on the same GPU;
   TTFT and decode tokens/s of each (`results/engine-gpu.json`).

The summary (`results/gpu-check.json`: device, versions, date, each stage's
status, time and output tail) is written even when stages fail; the command
exits 0 only if every stage passed. Without CUDA it refuses with status 2;
`--smoke` runs every stage on the CPU in the Triton interpreter with small
shapes and a tiny random model (CI does), writing files of the real run's
form that are not measurements.

On the device machine (torch, Triton, pytest, xdist and hypothesis are there;
`gguf`, which the engine imports, is not: carry its wheel in `.whl/`; the
bundled model is not either, and at 93 MB it is too large to carry, so the
engine stage runs random weights of its shapes: `tests/benchmarks/gpu_engine.py`):

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl &&
    export PYTHONPATH=/tmp/site &&
    python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . &&
    python3 -m tests.benchmarks.gpu_check --out-dir "$OUT"
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from tests.benchmarks.gpu import device_report_header, require_cuda, write_json

ROOT = Path(__file__).resolve().parents[2]
COMMAND = "python -m tests.benchmarks.gpu_check"
TAIL_CHARS = 4000
SMOKE_TESTS = ["tests/kernels/test_sampling_kernel.py", "-k", "stream"]
SMOKE_NOTE = (
    "--smoke: the CPU, the Triton interpreter, small shapes and a tiny random model; "
    "these results check the command end to end and are not measurements."
)


def stages(out_dir: Path, smoke: bool) -> list[tuple[str, list[str], dict[str, str], int]]:
    """(name, command, extra environment, time limit in seconds) of each stage.

    The limits add up to 555 s, so that the whole check fits one device call
    (10 minutes at most, installation included). On an H200 on 2026-11-26 the
    whole check, on a fresh machine with a cold Triton cache, took 436 s: tests
    314.8 s (14 workers; 54 s on a warm cache), benchmarks 48.8, 40.3 and 11.9 s,
    engine 11.7 s."""
    python = sys.executable
    smoke_flag = ["--smoke"] if smoke else []
    tests = SMOKE_TESTS if smoke else ["tests/conformance", "tests/kernels"]
    # The device machines have 16 cores: the Triton compilations run in parallel (a
    # cold cache is most of the stage's time).
    workers = [] if smoke else ["-n", str(max(1, min(14, (os.cpu_count() or 1) - 2)))]
    return [
        (
            "tests",
            [
                python,
                "-m",
                "pytest",
                *tests,
                *workers,
                "-q",
                "-p",
                "no:cacheprovider",
                "-W",
                "ignore",
            ],
            {"DECODESPEC_SIZES": "small" if smoke else "large", "HYPOTHESIS_PROFILE": "ci"},
            400,
        ),
        *(
            (
                name,
                [
                    python,
                    "-m",
                    f"tests.benchmarks.{name}",
                    *smoke_flag,
                    "--out",
                    f"{out_dir}/{name}-gpu.json",
                ],
                {},
                limit,
            )
            for name, limit in (("attention", 55), ("sampling", 50), ("quant_linear", 20))
        ),
        (
            "engine",
            [
                python,
                "-m",
                "tests.benchmarks.gpu_engine",
                *smoke_flag,
                "--out",
                f"{out_dir}/engine-gpu.json",
            ],
            {},
            30,
        ),
    ]


def run_stage(command: list[str], env: dict[str, str], limit: int) -> dict:
    """Run one stage from the repository root; its status, time and output tail."""
    start = time.perf_counter()
    environment = {**os.environ, **env, "PYTHONUNBUFFERED": "1"}
    try:
        done = subprocess.run(
            command, cwd=ROOT, env=environment, capture_output=True, text=True, timeout=limit
        )
        code, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as error:
        code = None
        output = f"{_text(error.stdout)}{_text(error.stderr)}\nstopped after {limit} s"
    return {
        "command": " ".join(command[1:]),
        "environment": env,
        "returncode": code,
        "passed": code == 0,
        "seconds": round(time.perf_counter() - start, 1),
        "output_tail": output[-TAIL_CHARS:],
    }


def _earlier_stages(summary_path: Path) -> dict:
    if not summary_path.exists():
        return {}
    return json.loads(summary_path.read_text()).get("stages", {})


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _text(value: bytes | str | None) -> str:
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return value or ""


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out-dir",
        type=Path,
        help="where the results files go (default: results/; with --smoke a new temporary "
        "folder, so that a smoke run never overwrites measurements)",
    )
    parser.add_argument("--smoke", action="store_true", help="CPU, interpreter, small shapes")
    parser.add_argument(
        "--only",
        nargs="+",
        help="run only these stages; the summary keeps the other stages' last results",
    )
    args = parser.parse_args(argv)
    if not args.smoke:
        require_cuda(COMMAND)
    if args.out_dir is None:
        args.out_dir = (
            Path(tempfile.mkdtemp(prefix="gpu-check-")) if args.smoke else ROOT / "results"
        )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    plan = stages(args.out_dir.resolve(), args.smoke)
    unknown = set(args.only or ()) - {name for name, *_ in plan}
    if unknown:
        parser.error(f"--only: no stage {sorted(unknown)}; stages: {[n for n, *_ in plan]}")
    summary_path = args.out_dir / "gpu-check.json"
    # --only reruns some stages: the others keep their last results (each has its date).
    results = _earlier_stages(summary_path) if args.only else {}
    for name, command, env, limit in plan:
        if args.only and name not in args.only:
            continue
        print(f"{name}: {' '.join(command[1:])}", file=sys.stderr, flush=True)
        results[name] = {**run_stage(command, env, limit), "date": _now()}
        status = "passed" if results[name]["passed"] else "FAILED"
        print(f"  {status} in {results[name]['seconds']} s", file=sys.stderr, flush=True)
        if not results[name]["passed"]:
            print(results[name]["output_tail"][-1500:], file=sys.stderr, flush=True)
    device = torch.device("cpu" if args.smoke else "cuda")
    note = SMOKE_NOTE if args.smoke else None
    summary = {
        **device_report_header("gpu-check", " ".join([COMMAND, *argv]), note, device),
        "stages": results,
        "passed": all(stage["passed"] for stage in results.values()),
    }
    write_json(summary_path, summary)
    print(json.dumps({name: stage["passed"] for name, stage in results.items()}))
    print(f"wrote {args.out_dir}")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
