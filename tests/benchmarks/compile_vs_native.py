"""Does `torch.compile` make the native step's C unnecessary? Decode tokens/s on the CPU.

    python -m tests.benchmarks.compile_vs_native [--tokens 64] [--rounds 5] [--threads N]
        [--modes default max-autotune-no-cudagraphs] [--out results/compile-vs-native-cpu.json]

The torch backend's decode step for int4/int8 models is C between PyTorch's
CPU kernels (`reference/native_step.py`), written because the eager
decoder's seventy-odd small operations a layer cost more to dispatch than to
compute. A compiler that fuses those operations would make the C redundant.
This measures, on the bundled model (SmolLM2-135M-Instruct, int4, the torch
backend), one greedy stream's decode tokens/s (after the first token) of:

- `native step`: the engine as it ships (`runner.native`);
- `pytorch`: the same engine without its native step, every pass through the
  spec's decoder with the backend's stages (`cached_hidden_states` with the
  batched attention and append, `runner.hidden_states`);
- `torch.compile (<mode>)`: that same call, `runner.hidden_states`'s
  `cached_hidden_states`, under `torch.compile(mode=<mode>)` (Inductor). Its
  compile time is the first request's wall time (prompt and a few tokens)
  minus the eager path's.

Each compile mode runs in a process of its own (Dynamo's caches belong to the
code objects, which every mode would share), beside its own native-step and
PyTorch baselines: one warm-up request per configuration (compiling where it
compiles), then `--rounds` rounds, each running the three configurations once,
interleaved so that a busy spell of a shared machine slows each alike; the
best round counts (noise only ever makes a run slower). Greedy tokens are
compared with the native step's. Dynamo's recompile limit is raised (64) so
that the prompt and the growing sequence lengths recompile instead of falling
back to eager partway; the graphs it compiled and the graph breaks it took
are recorded, in the warm-up and in the timed rounds.
Give `--threads` no more than the cores that are idle: an OpenMP thread whose
partner is descheduled waits for it, and every configuration slows many times.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the `decodespec` command sets it

import torch

from decodespec.reference.cli_options import prompt_ids
from decodespec.reference.engine import Engine
from decodespec.reference.loader import load_model
from decodespec.reference.model_files import bundled_model_path
from decodespec.reference.native_step import status
from decodespec.spec.forward import cached_hidden_states
from decodespec.spec.params import SamplingParams
from tests.benchmarks.gpu import write_json
from tests.benchmarks.test_cpu_engine import cpu_report_header

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = ROOT / "results" / "compile-vs-native-cpu.json"
COMMAND = "python -m tests.benchmarks.compile_vs_native"
MODES = ("default", "max-autotune-no-cudagraphs")
PROMPT = "Write a short story about a lighthouse keeper."
WARMUP_TOKENS = 8


def engine(weights, tokenizer, native: bool) -> Engine:
    """The torch backend's engine, with or without the native step. Without, its runner
    drops the step it made: every pass takes the PyTorch path, on the same quantized
    products (`DECODESPEC_NATIVE=0` would also put those back on PyTorch's kernels)."""
    made = Engine(weights, tokenizer, backend="torch", cache_tokens=2048, seed=0)
    assert made.runner.native is not None, status(made.runner.weights)
    if not native:
        made.runner.native = None
    return made


def compiled(made: Engine, mode: str) -> Engine:
    """`made`'s PyTorch passes (`runner.hidden_states`: `cached_hidden_states` with the
    backend's attention and append) under `torch.compile(mode=mode)`."""
    runner = made.runner
    forward = torch.compile(
        functools.partial(
            cached_hidden_states,
            runner.weights,
            attention=runner.backend.paged_attention,
            append=runner.backend.append_kv,
        ),
        mode=None if mode == "default" else mode,
    )
    runner.hidden_states = lambda token_ids, paged: forward(token_ids, paged, runner.cache.layers)
    return made


def decode(made: Engine, ids: list[int], tokens: int) -> tuple[float, list[int], float]:
    """Decode tokens/s after the first token, the tokens (greedy), and the wall time."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    start, times, out = time.perf_counter(), [], []
    for event in made.generate(ids, params):
        if event.error is not None:
            raise RuntimeError(event.error)
        if event.token_id is not None:
            times.append(time.perf_counter())
            out.append(int(event.token_id))
    rate = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0
    return rate, out, times[-1] - start


def dynamo_counts() -> dict[str, int]:
    """Graphs Dynamo compiled and graph breaks it took, so far in this process."""
    from torch._dynamo.utils import counters

    return {
        "graphs": int(counters["stats"].get("unique_graphs", 0)),
        "graph_breaks": int(sum(counters["graph_break"].values())),
    }


def measure(tokens: int, rounds: int, modes: tuple[str, ...]) -> dict:
    weights, tokenizer = load_model(bundled_model_path(), weights="int4")
    ids = prompt_ids(tokenizer, PROMPT, raw=False)
    torch._dynamo.config.recompile_limit = 64
    makers: dict[str, Callable[[], Engine]] = {
        "native step": lambda: engine(weights, tokenizer, native=True),
        "pytorch": lambda: engine(weights, tokenizer, native=False),
    }
    for mode in modes:
        makers[f"torch.compile ({mode})"] = functools.partial(
            lambda m: compiled(engine(weights, tokenizer, native=False), m), mode
        )
    engines, warmup = {}, {}
    dynamo = {name: {"warm_up": {}, "timed_rounds": {}} for name in makers}

    def run(name: str, phase: str, count: int) -> tuple[float, list[int], float]:
        before = dynamo_counts()
        result = decode(engines[name], ids, count)
        after, seen = dynamo_counts(), dynamo[name][phase]
        for key in after:
            seen[key] = seen.get(key, 0) + after[key] - before[key]
        return result

    for name, make in makers.items():
        engines[name] = make()
        _, _, warmup[name] = run(name, "warm_up", WARMUP_TOKENS)
        print(f"warm-up {name}: {warmup[name]:.1f} s {dynamo[name]}", file=sys.stderr)
    best: dict[str, float] = {}
    outputs: dict[str, list[int]] = {}
    for round_number in range(rounds):
        for name in engines:
            rate, outputs[name], _ = run(name, "timed_rounds", tokens)
            best[name] = max(best.get(name, 0.0), rate)
            print(f"round {round_number + 1}: {name} {rate:.1f} tokens/s", file=sys.stderr)
    native = best["native step"]
    return {
        "model": "SmolLM2-135M-Instruct (bundled GGUF), int4, torch backend",
        "native_step": engines["native step"].runner.native.description,
        "prompt_tokens": len(ids),
        "decode_tokens": tokens,
        "rounds": rounds,
        "configurations": {
            name: {
                "decode_tokens_per_s": best[name],
                "over_native_step": best[name] / native,
                "first_request_s": warmup[name],
                **(
                    {"compile_s": warmup[name] - warmup["pytorch"], "dynamo": dynamo[name]}
                    if name.startswith("torch.compile")
                    else {}
                ),
                "greedy_tokens_equal_to_native_step": sum(
                    a == b for a, b in zip(outputs[name], outputs["native step"], strict=True)
                ),
            }
            for name in engines
        },
    }


def run_mode(mode: str, args: argparse.Namespace) -> dict:
    """`measure` for one compile mode, in a fresh process (`--child`)."""
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "run.json"
        command = [sys.executable, "-m", "tests.benchmarks.compile_vs_native", "--child",
                   "--modes", mode, "--tokens", str(args.tokens), "--rounds", str(args.rounds),
                   "--out", str(out)]  # fmt: skip
        if args.threads:
            command += ["--threads", str(args.threads)]
        subprocess.run(command, cwd=ROOT, check=True)
        return {"mode": mode, **json.loads(out.read_text())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results JSON file")
    parser.add_argument("--tokens", type=int, default=64, help="decode tokens per request")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (best counts)")
    parser.add_argument("--modes", nargs="*", default=list(MODES), help="torch.compile modes")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child:
        write_json(args.out, measure(args.tokens, args.rounds, tuple(args.modes)))
        return 0
    report = {
        **cpu_report_header("compile_vs_native", COMMAND, None),
        "load_average_at_start": list(os.getloadavg()),
        "note": (
            "measured on a shared machine while other jobs ran: best of interleaved "
            "rounds; compare the configurations of one run with each other, not with "
            "other files"
        ),
        "runs": [run_mode(mode, args) for mode in args.modes],
        "load_average_at_end": list(os.getloadavg()),
    }
    write_json(args.out, report)
    for run in report["runs"]:
        print(f"torch.compile mode {run['mode']}:")
        for name, row in run["configurations"].items():
            extra = f", compile {row['compile_s']:.0f} s" if "compile_s" in row else ""
            print(
                f"  {name:<42} {row['decode_tokens_per_s']:6.1f} tokens/s "
                f"({row['over_native_step']:.2f}x native{extra})"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
