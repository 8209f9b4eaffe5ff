"""CPU benchmark of `decodespec serve` under concurrent streaming clients: `make bench-serve`.

In the style of vLLM's `benchmark_serving`: a live server (uvicorn on
127.0.0.1, the bundled model, `tests/serve/live.py`) and asyncio clients
streaming `/v1/completions` over loopback (`tests/serve/load.py`), all in one
process. At each concurrency (1, 4 and 16) a fixed number of requests (4, 8
and 16) is sent at most that many at a time; each is greedy, `ignore_eos`, 32
tokens, on one of 16 different short prompts. Recorded per run, from the
client's side:

- output tokens/s: all output tokens over the run's wall time (first request
  sent to last stream closed), prefill included;
- TTFT: request sent to the first chunk carrying text (mean, p50, p99);
- ITL: the gaps between chunks carrying text (mean, p50, p99).

Each concurrency runs in every round (rounds interleaved, so that a slow
spell of the machine hits every concurrency alike); the round with the most
output tokens/s is kept, as the other CPU benchmarks keep their fastest. The
baseline is the engine itself, driven in-process with the same 16 requests
added at once (`load.in_process`); the targets are the issue's: at 16
streams, at least 5× the tokens/s of one stream and 80% of the in-process
engine's. Missed targets are reported, not fatal.

The summary goes to `results/serve-cpu.json` and a table to stdout.
`--smoke` runs every stage with a few tokens, one request per client and one
round: it checks the command end to end and measures nothing.
"""

from __future__ import annotations

import argparse
import platform
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

import torch

from decodespec.reference.backend import DEFAULT_BACKEND
from tests.benchmarks.gpu import fmt, print_targets, write_json
from tests.benchmarks.test_cpu_engine import cpu_report_header
from tests.serve import load
from tests.serve.live import LiveServer

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = ROOT / "results" / "serve-cpu.json"
COMMAND = "python -m tests.benchmarks.serve"
MAKE_COMMAND = "make bench-serve"
CONCURRENCY = [1, 4, 16]
# Requests per run. At 16 they are the 16 requests of the bound (and of the
# in-process baseline) sent at once; below, each client sends a few in turn.
REQUESTS = {1: 4, 4: 8, 16: 16}
DEADLINE_S = 300.0  # per run; a run that overstays it fails the command
SPEEDUP_OVER_SINGLE = 5.0
FRACTION_OF_IN_PROCESS = 0.8
SMOKE_NOTE = (
    "--smoke: a few tokens, one request per client, one round; these numbers check "
    "the command end to end and are not measurements."
)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results JSON file")
    parser.add_argument("--max-tokens", type=int, default=load.MAX_TOKENS, help="per request")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; the fastest is kept")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="a few tokens, one request per client, one round: checks the command only",
    )
    return parser.parse_args(argv)


def run_level(server: LiveServer, concurrency: int, requests: int, max_tokens: int) -> dict:
    """One run at `concurrency`: `requests` greedy streams; every one must complete."""
    run = load.run_load(
        server.base_url, load.greedy_requests(requests, max_tokens), concurrency, DEADLINE_S
    )
    failed = load.failures(run)
    if failed:
        raise SystemExit(f"{len(failed)} requests failed at concurrency {concurrency}: {failed}")
    summary = load.summarize(run)
    if summary["output_tokens"] != requests * max_tokens:
        raise SystemExit(f"expected {requests * max_tokens} tokens, got {summary['output_tokens']}")
    server.wait_idle()
    if server.free_blocks() != server.total_blocks():
        raise SystemExit("cache blocks leaked after the run")
    return summary


def measure(args: argparse.Namespace) -> tuple[str, list[dict], float, list[float]]:
    """The model, each concurrency's fastest run, and the in-process baseline (best, all)."""
    requests = {c: c for c in CONCURRENCY} if args.smoke else REQUESTS
    with LiveServer() as server:
        weights, tokenizer = server.engine.runner.weights, server.tokenizer
        dtype = str(weights.dtype).removeprefix("torch.")
        model = f"SmolLM2-135M-Instruct (bundled GGUF, dequantized to {dtype})"
        prompts = load.PROMPTS[: max(CONCURRENCY)]
        if not args.smoke:  # warm up the server and the in-process engine
            run_level(server, max(CONCURRENCY), max(CONCURRENCY), 4)
            load.in_process(weights, tokenizer, prompts, max_tokens=4)
        runs: dict[int, list[dict]] = {c: [] for c in CONCURRENCY}
        in_process = []
        for round_ in range(args.rounds):
            for concurrency in CONCURRENCY:
                summary = run_level(server, concurrency, requests[concurrency], args.max_tokens)
                runs[concurrency].append(summary)
                print(
                    f"  round {round_ + 1}/{args.rounds} concurrency {concurrency:>2}: "
                    f"{summary['output_tokens_per_s']:7.1f} tok/s",
                    file=sys.stderr,
                    flush=True,
                )
            in_process.append(load.in_process(weights, tokenizer, prompts, args.max_tokens))
            print(
                f"  round {round_ + 1}/{args.rounds} in-process engine at {len(prompts)}: "
                f"{in_process[-1]:7.1f} tok/s",
                file=sys.stderr,
                flush=True,
            )
    best = []
    for concurrency in CONCURRENCY:
        rates = [run["output_tokens_per_s"] for run in runs[concurrency]]
        row = runs[concurrency][rates.index(max(rates))]
        row["output_tokens_per_s_all_rounds"] = rates
        best.append(row)
    return model, best, max(in_process), in_process


def targets(runs: list[dict], in_process: float) -> list[dict]:
    """The issue's bounds on the aggregate tokens/s at 16 concurrent streams."""
    by_concurrency = {run["concurrency"]: run for run in runs}
    single = by_concurrency[1]["output_tokens_per_s"]
    top = max(CONCURRENCY)
    aggregate = by_concurrency[top]["output_tokens_per_s"]
    return [
        {
            "target": f"{top} streams: >= {SPEEDUP_OVER_SINGLE:g}x the tokens/s of one stream "
            f"(measured {aggregate / single:.2f}x)",
            "bound": SPEEDUP_OVER_SINGLE,
            "ratio": aggregate / single,
            "met": aggregate >= SPEEDUP_OVER_SINGLE * single,
        },
        {
            "target": f"{top} streams: >= {FRACTION_OF_IN_PROCESS:.0%} of the in-process "
            f"engine's tokens/s at {top} (measured {aggregate / in_process:.0%})",
            "bound": FRACTION_OF_IN_PROCESS,
            "ratio": aggregate / in_process,
            "met": aggregate >= FRACTION_OF_IN_PROCESS * in_process,
        },
    ]


def versions() -> dict:
    """Python, torch and the HTTP stack, server and client."""
    software = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("starlette", "uvicorn", "httpx"):
        software[name] = metadata.version(name)
    return software


def report(args: argparse.Namespace, argv: Sequence[str]) -> dict:
    model, runs, in_process, in_process_all = measure(args)
    return {
        **cpu_report_header(
            "serve-cpu",
            " ".join([COMMAND, *argv]) if argv else MAKE_COMMAND,
            SMOKE_NOTE if args.smoke else None,
        ),
        "software": versions(),
        "model": model,
        "backend": DEFAULT_BACKEND,
        "client": "httpx.AsyncClient streaming /v1/completions over loopback (its connections "
        "opened before the clock starts), in the server's process (uvicorn in a thread)",
        "sampling": "greedy (temperature 0), ignore_eos, raw prompts (no chat template)",
        "max_tokens": args.max_tokens,
        "prompts": len(load.PROMPTS),
        "rounds": args.rounds,
        "statistic": "one run (--smoke)"
        if args.smoke
        else f"per concurrency, the run with the most output tokens/s of {args.rounds} "
        "interleaved rounds",
        "runs": runs,
        "in_process_concurrency": max(CONCURRENCY),
        "in_process_tokens_per_s": in_process,
        "in_process_tokens_per_s_all_rounds": in_process_all,
        "targets": targets(runs, in_process),
    }


def print_table(summary: dict) -> None:
    print(f"{summary['device']}, {summary['cores']} cores; {summary['statistic']}")
    print(
        f"{'concurrency':>11} {'requests':>8} {'tok/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'ITL p50':>8} {'ITL p99':>8}  (ms)"
    )
    for run in summary["runs"]:
        ttft, itl = run["ttft_ms"], run["itl_ms"]
        print(
            f"{run['concurrency']:>11} {run['requests']:>8} {run['output_tokens_per_s']:>7.1f} "
            f"{fmt(ttft['p50']):>9} {fmt(ttft['p99']):>9} {fmt(itl['p50']):>8} "
            f"{fmt(itl['p99']):>8}"
        )
    print(
        f"in-process engine, {summary['in_process_concurrency']} requests: "
        f"{summary['in_process_tokens_per_s']:.1f} tok/s"
    )
    print_targets(summary["targets"])


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.smoke:
        args.max_tokens, args.rounds = 4, 1
    summary = report(args, argv)
    write_json(args.out, summary)
    print_table(summary)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
