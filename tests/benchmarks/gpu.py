"""Shared pieces of the GPU benchmarks (`make bench-attention`, ...); the JSON and
table helpers (`write_json`, `fmt`, `print_targets`) serve the CPU benchmarks too.

How to measure (ARCHITECTURE.md, "Performance: how to measure"): the bytes an
operation must move over its median time, compared with the device's measured
copy bandwidth; peers timed in the same process on the same inputs with
`triton.testing.do_bench` (median, L2 flushed between calls); results written
as JSON with the device and software versions.

Each benchmark also has a `--smoke` mode that runs tiny shapes on the CPU
through the Triton interpreter, timed once with `time.perf_counter`, so that a
test can check the command end to end without a GPU. Those numbers are never
measurements. Triton is imported only inside the functions that use it: the
interpreter must be switched on (TRITON_INTERPRET=1) before Triton is first
imported.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import math
import os
import platform
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "results"
COPY_BYTES = 1 << 30  # large enough that the L2 cache plays no part
SMOKE_COPY_BYTES = 1 << 24
SMOKE_NOTE = (
    "--smoke: tiny shapes on the CPU through the Triton interpreter, each timed once; "
    "these numbers check the command end to end and are not measurements."
)


def require_cuda(command: str) -> None:
    """Exit with status 2 and a clear message unless a CUDA GPU is present."""
    if not torch.cuda.is_available():
        print(
            f"{command}: a CUDA GPU is required (torch.cuda.is_available() is False). "
            "It measures kernels against the GPU's copy bandwidth and GPU peers; timings "
            "in the Triton interpreter are not measurements. Use --smoke to check the "
            "command on the CPU.",
            file=sys.stderr,
        )
        raise SystemExit(2)


def describe_environment(device: torch.device) -> dict:
    """The device and software a run measured on, and when (UTC)."""
    import triton

    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["device"] = props.name
        info["device_memory_GiB"] = round(props.total_memory / 2**30, 1)
        info["multiprocessors"] = props.multi_processor_count
        info["compute_capability"] = f"{props.major}.{props.minor}"
    else:
        info["device"] = f"cpu ({platform.processor() or platform.machine()})"
    return info


def median_ms(fn: Callable[[], object], warmup_ms: int = 25, rep_ms: int = 200) -> float:
    """Median time of `fn` in milliseconds on the GPU, L2 flushed before each call."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def single_call_ms(fn: Callable[[], object]) -> float:
    """Wall time of one call of `fn` in milliseconds (the --smoke timer: not a measurement)."""
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def measure_copy_bandwidth(
    device: torch.device, nbytes: int = COPY_BYTES, timer: Callable = median_ms
) -> dict:
    """Device-to-device copy of an `nbytes` buffer: bytes read plus written over the time."""
    source = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    target = torch.empty_like(source)
    ms = timer(lambda: target.copy_(source))
    return {"bytes": nbytes, "median_ms": ms, "GBps": 2 * nbytes / (ms * 1e-3) / 1e9}


class PeerUnavailable(Exception):
    """A peer that cannot run a case on this machine; the message says why."""


def time_peer(prepare: Callable[[], Callable[[], object]], timer: Callable = median_ms) -> dict:
    """`{"median_ms": ...}` of the call `prepare` returns, or `{"unavailable": reason}`.

    Preparing (imports, planning, compiling) and one first call stay outside the
    timing. A peer that is missing or fails is a result, not the end of the run.
    """
    try:
        call = prepare()
        call()
        ms = timer(call)
    except PeerUnavailable as reason:
        return {"unavailable": str(reason)}
    except Exception as error:
        return {"unavailable": f"{type(error).__name__}: {error}"}
    return {"median_ms": ms}


def portable_path(text: str) -> str:
    """`text` with this machine's paths made portable: the repository's relative to it,
    the home folder's as `~`, a virtual environment's packages as `site-packages/`."""
    text = text.replace(f"{ROOT}/", "")
    text = re.sub(r"/\S*?/(?:lib|Lib)/python[\d.]+/site-packages/", "site-packages/", text)
    return text.replace(f"{Path.home()}/", "~/")


def _strict_json(value: object) -> object:
    """`value` with each non-finite float replaced by its name ("nan", "inf", "-inf") and
    each string's paths made portable (`portable_path`): a results file never holds
    the measuring machine's absolute paths."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, str):
        return portable_path(value)
    if isinstance(value, dict):
        return {key: _strict_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict_json(item) for item in value]
    return value


def fmt(value: float | None, spec: str = ".0f") -> str:
    """A table cell: `value` formatted with `spec`, or "-" where there is none."""
    return "-" if value is None else format(value, spec)


def print_targets(targets: list[dict]) -> None:
    """The report's targets, each marked met or NOT met."""
    print("\nTargets:")
    for target in targets:
        print(f"  {'met' if target['met'] else 'NOT met'}: {target['target']}")


def write_json(path: Path, results: dict) -> None:
    """Write `results` as indented, strictly valid JSON, creating the folder if needed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_strict_json(results), indent=2, allow_nan=False) + "\n")


def parse_args(
    command: str, description: str, default_out: Path, argv: list[str] | None
) -> argparse.Namespace:
    """`--out PATH` and `--smoke`, the options every benchmark command takes."""
    parser = argparse.ArgumentParser(prog=command, description=description)
    parser.add_argument("--out", type=Path, default=default_out, help="results JSON file")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny shapes on the CPU, Triton interpreter: checks the command, measures nothing",
    )
    return parser.parse_args(argv)


@dataclass(frozen=True)
class Run:
    """Where and how a benchmark command measures."""

    smoke: bool
    device: torch.device
    timer: Callable[[Callable[[], object]], float]
    kernels: ModuleType
    copy_bandwidth: dict


def start_run(command: str, smoke: bool) -> Run:
    """Refuse without CUDA (unless smoke), import the kernels, measure copy bandwidth.

    Smoke runs switch the Triton interpreter on first: Triton reads it when the
    kernels are decorated, at their import.
    """
    if smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        require_cuda(command)
    kernels = importlib.import_module("decodespec.kernels")
    device = torch.device("cpu" if smoke else "cuda")
    timer = single_call_ms if smoke else median_ms
    torch.manual_seed(0)
    copy = measure_copy_bandwidth(device, SMOKE_COPY_BYTES if smoke else COPY_BYTES, timer)
    return Run(smoke, device, timer, kernels, copy)


def device_report_header(
    benchmark: str, command: str, smoke_note: str | None, device: torch.device
) -> dict:
    """How a results file of a run on `device` starts: the benchmark, its command,
    whether it was a smoke run (and the note saying so), the device and software."""
    return {
        "benchmark": benchmark,
        "command": command,
        "smoke": smoke_note is not None,
        **({"note": smoke_note} if smoke_note is not None else {}),
        "environment": describe_environment(device),
    }


def report_header(benchmark: str, make_target: str, run: Run) -> dict:
    """The fields every kernel results file starts with, and the copy bandwidth."""
    note = SMOKE_NOTE if run.smoke else None
    return {
        **device_report_header(benchmark, f"make {make_target}", note, run.device),
        "statistic": "one call" if run.smoke else "median (triton.testing.do_bench, L2 flushed)",
        "copy_bandwidth": run.copy_bandwidth,
    }
