"""CPU benchmark of prefix caching on the bundled model: `make bench-prefix`.

What it measures (issue 18): the time to first token of short questions that
follow one long system prompt, with the engine's prefix caching on and off.
The claim checked: prompt caching cuts the cost of a repeated input — the
questions after the first should not pay for prefilling the system prompt
again.

How:

- a system prompt of exactly 512, 1,024 and 2,048 tokens (an encoded text,
  cut), then a short question of its own per request; raw token ids, greedy,
  `ignore_eos`, a few new tokens;
- for each length and each setting (cache off, cache on), a fresh engine
  (built outside the timing) answers the questions one after another: the
  first is cold in both settings; the later ones ("warm") find the system
  prompt's blocks cached when the cache is on;
- TTFT is `RequestOutput.ttft_s` (from `add_request` to the first token);
  a setting's figure is the median TTFT of its warm questions, and rounds
  are interleaved (off, on, off, on, ...) with the fastest round of each kept
  (noise only ever makes a run slower); cached tokens, hit rate (cached over
  prompt tokens of the warm questions) and the speedup (off over on) are
  recorded;
- prefix caching must not change a token: every question's tokens with the
  cache on are compared with the cache off, and the command exits with
  status 1 if any differs.

The summary goes to `results/prefix-cpu.json` and a table to stdout; the
site draws its figure from it. `--smoke` runs the same stages on a tiny
random model with a byte tokenizer: it checks the command end to end and
measures nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from decodespec.reference.backend import DEFAULT_BACKEND
from decodespec.reference.engine import Engine
from decodespec.reference.request import RequestOutput
from decodespec.spec.forward import ModelWeights
from decodespec.spec.params import SamplingParams
from tests.benchmarks.gpu import print_targets, write_json
from tests.benchmarks.speculative import PARAGRAPH, load
from tests.benchmarks.test_cpu_engine import cpu_report_header
from tests.engine.test_prefix_cache import one_after_another

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = ROOT / "results" / "prefix-cpu.json"
COMMAND = "python -m tests.benchmarks.prefix"
SYSTEM_LENGTHS = (512, 1024, 2048)
QUESTIONS = (
    "\nQuestion: Who kept the light burning?\nAnswer:",
    "\nQuestion: What is the lighthouse today?\nAnswer:",
    "\nQuestion: Why did ships need the beam?\nAnswer:",
    "\nQuestion: Who learned the names of the ships?\nAnswer:",
)
SMOKE_NOTE = (
    "--smoke: a tiny random model and a byte tokenizer, short prompts, one round; "
    "these numbers check the command end to end and are not measurements."
)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results JSON file")
    parser.add_argument("--max-tokens", type=int, default=4, help="new tokens per question")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; the fastest is kept")
    parser.add_argument("--backend", default=DEFAULT_BACKEND, help="the engine's backend")
    parser.add_argument(
        "--threads", type=int, default=torch.get_num_threads(), help="torch CPU threads"
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny random model, short prompts, one round: checks the command, measures nothing",
    )
    return parser.parse_args(argv)


def system_prompt(tokenizer: object, length: int) -> list[int]:
    """Exactly `length` token ids of a long instruction text."""
    text = "You are the archivist of a seaside village. Here is its history. "
    ids = tokenizer.encode(text, add_special_tokens=False)
    while len(ids) < length:
        ids += tokenizer.encode(f" {PARAGRAPH}", add_special_tokens=False)
    return ids[:length]


def answer_all(
    weights: ModelWeights,
    tokenizer: object,
    prompts: list[list[int]],
    params: SamplingParams,
    prefix_caching: bool,
    backend: str,
) -> list[RequestOutput]:
    """A fresh engine answers the prompts one after another."""
    engine = Engine(
        weights,
        tokenizer,
        backend=backend,
        cache_tokens=8192,
        prefix_caching=prefix_caching,
    )
    return one_after_another(engine, prompts, params)


def summarize(rounds: list[list[RequestOutput]]) -> dict:
    """A setting's fastest round: its cold TTFT, the median TTFT of its warm questions."""

    def warm_ttft(outputs: list[RequestOutput]) -> float:
        return statistics.median(o.ttft_s for o in outputs[1:])

    best = min(rounds, key=warm_ttft)
    warm = best[1:]
    prompt_tokens = sum(o.prompt_tokens for o in warm)
    cached = sum(o.cached_tokens for o in warm)
    return {
        "cold_ttft_ms": best[0].ttft_s * 1000,
        "warm_ttft_ms": warm_ttft(best) * 1000,
        "warm_ttft_ms_all_rounds": [warm_ttft(r) * 1000 for r in rounds],
        "warm_cached_tokens": [o.cached_tokens for o in warm],
        "warm_prompt_tokens": [o.prompt_tokens for o in warm],
        "hit_rate": cached / prompt_tokens,
    }


def measure_length(
    weights: ModelWeights, tokenizer: object, length: int, args: argparse.Namespace
) -> dict:
    system = system_prompt(tokenizer, length)
    questions = QUESTIONS[:2] if args.smoke else QUESTIONS
    prompts = [system + tokenizer.encode(q, add_special_tokens=False) for q in questions]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    runs: dict[bool, list[list[RequestOutput]]] = {False: [], True: []}
    for round_ in range(args.rounds):
        for prefix_caching in (False, True):
            outputs = answer_all(weights, tokenizer, prompts, params, prefix_caching, args.backend)
            runs[prefix_caching].append(outputs)
            ttfts = " ".join(f"{o.ttft_s * 1000:7.0f}" for o in outputs)
            print(
                f"  {length} tokens, round {round_ + 1}/{args.rounds}, cache "
                f"{'on ' if prefix_caching else 'off'}: TTFT ms {ttfts}",
                file=sys.stderr,
                flush=True,
            )
    reference = [o.token_ids for o in runs[False][0]]
    same = all([o.token_ids for o in r] == reference for rs in runs.values() for r in rs)
    off, on = summarize(runs[False]), summarize(runs[True])
    return {
        "system_tokens": length,
        "questions": len(prompts),
        "question_tokens": [len(p) - length for p in prompts],
        "cache_off": off,
        "cache_on": on,
        "warm_speedup": off["warm_ttft_ms"] / on["warm_ttft_ms"],
        "same_tokens": same,
    }


def targets(lengths: list[dict]) -> list[dict]:
    """The claim, per length: with the cache, a warm question's TTFT is below half of
    its TTFT without (the repeated system prompt is not prefilled again)."""
    return [
        {
            "target": f"{row['system_tokens']}-token system prompt: warm TTFT with the cache "
            f"< half of without (measured {row['cache_on']['warm_ttft_ms']:.0f} ms vs "
            f"{row['cache_off']['warm_ttft_ms']:.0f} ms, {row['warm_speedup']:.1f}x)",
            "system_tokens": row["system_tokens"],
            "speedup": row["warm_speedup"],
            "met": row["warm_speedup"] > 2,
        }
        for row in lengths
    ]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    lengths = SYSTEM_LENGTHS
    if args.smoke:
        args.rounds, args.max_tokens, lengths = 1, 2, (24, 40)
    torch.set_num_threads(args.threads)
    weights, tokenizer, model = load(args.smoke)
    rows = [measure_length(weights, tokenizer, length, args) for length in lengths]
    summary = {
        **cpu_report_header(
            "prefix-cpu", " ".join([COMMAND, *argv]), SMOKE_NOTE if args.smoke else None
        ),
        "model": model,
        "backend": args.backend,
        "block_size": 16,
        "sampling": f"greedy, ignore_eos, {args.max_tokens} new tokens, raw token ids",
        "rounds": args.rounds,
        "statistic": "one run (--smoke)"
        if args.smoke
        else f"median TTFT of the warm questions, fastest of {args.rounds} interleaved rounds",
        "lengths": rows,
        "targets": targets(rows),
        "same_tokens": all(row["same_tokens"] for row in rows),
    }
    write_json(args.out, summary)
    print(f"{summary['device']}, {summary['threads']} threads; {summary['statistic']}")
    print(
        f"{'system':>7} {'cold ms':>8} {'warm off ms':>11} {'warm on ms':>10} {'speedup':>7}"
        f" {'cached':>7} {'hit rate':>8}  same tokens"
    )
    for row in rows:
        off, on = row["cache_off"], row["cache_on"]
        print(
            f"{row['system_tokens']:>7} {off['cold_ttft_ms']:>8.0f} {off['warm_ttft_ms']:>11.0f} "
            f"{on['warm_ttft_ms']:>10.0f} {row['warm_speedup']:>6.1f}x "
            f"{statistics.median(on['warm_cached_tokens']):>7.0f} {on['hit_rate']:>8.0%}  "
            f"{row['same_tokens']}"
        )
    print_targets(summary["targets"])
    print(f"\nwrote {args.out}")
    if not summary["same_tokens"]:
        print("FAILED: prefix caching changed the greedy tokens", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
