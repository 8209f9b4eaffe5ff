"""CPU benchmark of speculative decoding on the bundled model: `make bench-speculative`.

What it measures (issue 7, "Performance"): on SmolLM2-135M-Instruct on the
CPU, whether prompt lookup (`speculate="ngram"`) makes generation faster end
to end on a task that repeats its input, and how much it costs where the
drafts are mostly rejected, against plain cached decode in the same process.

How:

- two workloads, each one chat-templated prompt, greedy, `ignore_eos`, a fixed
  number of new tokens: "repeat" asks the model to repeat a paragraph word for
  word (it does: its output is the paragraph, so prompt lookup finds long
  runs), "novel" asks for a story (little of it is in the prompt);
- configurations: plain cached decode (`speculate=None`), prompt lookup with
  each K of `--num-draft`, and the model's first N layers as the drafter
  (`layers:N`, for information);
- one round runs every configuration once on the workload, a fresh engine
  each time (built outside the timing); rounds are interleaved so that a slow
  spell of the machine hits every configuration alike, and the fastest round
  of each configuration is kept (noise only ever makes a run slower);
- end to end: completion tokens over the wall time of `Engine.generate`,
  prefill included; speedup = a configuration's end-to-end tokens/s over
  plain decode's on the same workload. Also recorded: decode-only tokens/s,
  time to first token, drafts proposed and accepted, acceptance rate and
  tokens per target forward pass (from `RequestOutput`);
- greedy speculation must emit exactly plain decode's tokens: every round of
  every configuration is compared with plain decode's, and the command exits
  with status 1 if any differs. Missed speed targets are reported, not fatal.

The summary goes to `results/cpu-speculative.json` and a table to stdout.
Give `--threads` no more than the cores that are idle: when other work takes
a core, an OpenMP thread of every parallel op waits for its descheduled
partner, and runs become up to 20 times slower (seen on a 2-core machine).
`--smoke` runs the same stages on a tiny random model with a byte tokenizer
(no model files): it checks the command end to end and measures nothing.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from decodespec.reference.cli_options import prompt_ids
from decodespec.reference.engine import Engine
from decodespec.reference.request import RequestOutput
from decodespec.spec.forward import ModelWeights
from decodespec.spec.params import SamplingParams
from tests.benchmarks.gpu import fmt, print_targets, write_json
from tests.benchmarks.test_cpu_engine import cpu_report_header

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = ROOT / "results" / "cpu-speculative.json"
COMMAND = "python -m tests.benchmarks.speculative"
CACHE_TOKENS = 2048  # room for one request: prompt + max_tokens + drafts
SMOKE_NOTE = (
    "--smoke: a tiny random model and a byte tokenizer, a few tokens, one round; "
    "these numbers check the command end to end and are not measurements."
)

PARAGRAPH = (
    "The old lighthouse stood at the edge of the cliff for more than a century. Every night "
    "its keeper climbed the narrow stairs, trimmed the wick and wound the clockwork that "
    "turned the great lens. Ships passing in the dark relied on its steady beam to find the "
    "harbour entrance and avoid the rocks below. When the keeper retired, the village decided "
    "to keep the light burning, and volunteers took turns climbing the stairs each evening. "
    "Children learned the names of the ships from the old logbooks, and fishermen still raise "
    "a hand to the tower when they sail home. Today the lighthouse is a small museum, but its "
    "lamp still shines over the water on winter nights."
)


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    prompt: str
    target_speedup: float  # the bound on ngram's end-to-end speedup over plain


WORKLOADS = [
    Workload(
        "repeat",
        "Repeat a 118-word paragraph verbatim: the output is in the prompt",
        f"Repeat the following paragraph exactly, word for word:\n\n{PARAGRAPH}",
        target_speedup=1.5,
    ),
    Workload(
        "novel",
        "An open-ended story: drafts are mostly rejected",
        "Invent a short story about a dragon who is afraid of the dark. "
        "Give the dragon a name and describe its home.",
        target_speedup=0.9,
    ),
]


@dataclass(frozen=True)
class Config:
    name: str
    speculate: str | None
    num_draft: int = 4


# ---------------------------------------------------------------- setup


def draft_counts(text: str) -> list[int]:
    """`--num-draft`: one K or a comma-separated list of them."""
    counts = [int(part) for part in text.split(",") if part.strip()]
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"--num-draft needs integers >= 1, got {text!r}")
    return counts


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results JSON file")
    parser.add_argument(
        "--num-draft", type=draft_counts, default=[4], help="K for prompt lookup, e.g. 4 or 2,4,6"
    )
    parser.add_argument("--draft-layers", type=int, default=8, help="N of the layers:N row")
    parser.add_argument("--max-tokens", type=int, default=128, help="new tokens per request")
    parser.add_argument(
        "--threads", type=int, default=torch.get_num_threads(), help="torch CPU threads"
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds; the fastest is kept")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny random model, a few tokens, one round: checks the command, measures nothing",
    )
    return parser.parse_args(argv)


def load(smoke: bool) -> tuple[ModelWeights, object, str]:
    """The weights, the tokenizer and a description of the model."""
    if smoke:
        from tests.engine.toy import ByteTokenizer, random_weights, small_config

        return random_weights(small_config()), ByteTokenizer(), "random toy model (--smoke)"
    from decodespec.reference.loader import load_model
    from decodespec.reference.model_files import bundled_model_path

    weights, tokenizer = load_model(bundled_model_path())
    dtype = str(weights.dtype).removeprefix("torch.")
    return weights, tokenizer, f"SmolLM2-135M-Instruct (bundled GGUF, dequantized to {dtype})"


def workload_prompt(tokenizer: object, workload: Workload, smoke: bool) -> list[int]:
    """The chat-templated prompt ids (smoke: the first 48 bytes, to fit the toy's context)."""
    ids = prompt_ids(tokenizer, workload.prompt, raw=False)
    return ids[:48] if smoke else ids


def configurations(num_drafts: list[int], draft_layers: int) -> list[Config]:
    """Plain decode first (the reference), then prompt lookup per K, then layers:N."""
    configs = [Config("plain", None)]
    configs += [Config(f"ngram K={k}", "ngram", k) for k in num_drafts]
    k = 4 if 4 in num_drafts else num_drafts[0]
    configs.append(Config(f"layers:{draft_layers} K={k}", f"layers:{draft_layers}", k))
    return configs


# ---------------------------------------------------------------- measuring


def run_once(
    weights: ModelWeights,
    tokenizer: object,
    config: Config,
    ids: list[int],
    params: SamplingParams,
) -> tuple[float, RequestOutput]:
    """One request on a fresh engine: the wall time of `generate` and its output."""
    engine = Engine(
        weights,
        tokenizer,
        speculate=config.speculate,
        num_draft=config.num_draft,
        cache_tokens=CACHE_TOKENS,
    )
    request_id = -1
    start = time.perf_counter()
    for event in engine.generate(ids, params):
        request_id = event.request_id
    wall = time.perf_counter() - start
    return wall, engine.output(request_id)


def measure(
    weights: ModelWeights,
    tokenizer: object,
    configs: list[Config],
    ids: list[int],
    params: SamplingParams,
    rounds: int,
    warm_up: bool,
) -> dict[str, list[tuple[float, RequestOutput]]]:
    """Every configuration once per round (after one short warm-up run each, if `warm_up`)."""
    for config in configs if warm_up else []:
        short = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        run_once(weights, tokenizer, config, ids, short)
    runs: dict[str, list[tuple[float, RequestOutput]]] = {c.name: [] for c in configs}
    for round_ in range(rounds):
        for config in configs:
            wall, output = run_once(weights, tokenizer, config, ids, params)
            runs[config.name].append((wall, output))
            print(
                f"  round {round_ + 1}/{rounds} {config.name:<16} {wall:7.2f} s",
                file=sys.stderr,
                flush=True,
            )
    return runs


def summarize(
    config: Config, runs: list[tuple[float, RequestOutput]], plain: list[int], plain_tps: float
) -> dict:
    """A configuration's fastest round, its speedup and whether every round matched plain."""
    wall, output = min(runs, key=lambda run: run[0])
    tokens_per_s = output.completion_tokens / wall
    return {
        "configuration": config.name,
        "speculate": config.speculate,
        "num_draft": config.num_draft if config.speculate else None,
        "wall_s": wall,
        "wall_s_all_rounds": [run[0] for run in runs],
        "completion_tokens": output.completion_tokens,
        "end_to_end_tokens_per_s": tokens_per_s,
        "speedup_vs_plain": tokens_per_s / plain_tps,
        "decode_tokens_per_s": output.tokens_per_s,
        "ttft_s": output.ttft_s,
        "draft_tokens": output.draft_tokens,
        "accepted_tokens": output.accepted_tokens,
        "acceptance_rate": output.acceptance_rate,
        "tokens_per_target_pass": output.tokens_per_target_pass,
        "same_tokens_as_plain": all(run[1].token_ids == plain for run in runs),
    }


def run_workload(
    weights: ModelWeights,
    tokenizer: object,
    workload: Workload,
    configs: list[Config],
    args: argparse.Namespace,
) -> dict:
    """Measure every configuration on one workload; rows in `configs` order."""
    ids = workload_prompt(tokenizer, workload, args.smoke)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    print(f"{workload.name}: {len(ids)} prompt tokens", file=sys.stderr, flush=True)
    runs = measure(weights, tokenizer, configs, ids, params, args.rounds, not args.smoke)
    plain_wall, plain_output = min(runs["plain"], key=lambda run: run[0])
    plain_tps = plain_output.completion_tokens / plain_wall
    return {
        "name": workload.name,
        "description": workload.description,
        "prompt": workload.prompt,
        "prompt_tokens": len(ids),
        "target_speedup": workload.target_speedup,
        "output_text": plain_output.text,
        "results": [
            summarize(config, runs[config.name], plain_output.token_ids, plain_tps)
            for config in configs
        ],
    }


# ---------------------------------------------------------------- the report


def targets(workloads: list[dict]) -> list[dict]:
    """The issue's bounds on each prompt-lookup configuration's end-to-end speedup."""
    checks = []
    for workload in workloads:
        bound = workload["target_speedup"]
        for row in workload["results"]:
            if row["speculate"] != "ngram":
                continue
            checks.append(
                {
                    "target": f"{workload['name']}, {row['configuration']}: end-to-end speedup "
                    f">= {bound}x over plain (measured {row['speedup_vs_plain']:.2f}x)",
                    "workload": workload["name"],
                    "configuration": row["configuration"],
                    "bound": bound,
                    "speedup": row["speedup_vs_plain"],
                    "met": row["speedup_vs_plain"] >= bound,
                }
            )
    return checks


def report(args: argparse.Namespace, argv: Sequence[str], model: str, workloads: list) -> dict:
    """The results file: what, where, how, then the workloads and the targets."""
    return {
        **cpu_report_header(
            "cpu-speculative", " ".join([COMMAND, *argv]), SMOKE_NOTE if args.smoke else None
        ),
        "model": model,
        "sampling": "greedy (temperature 0), ignore_eos, chat template",
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "statistic": "one run (--smoke)"
        if args.smoke
        else f"fastest end-to-end wall time of {args.rounds} interleaved rounds",
        "workloads": workloads,
        "targets": targets(workloads),
        "same_tokens": all(r["same_tokens_as_plain"] for w in workloads for r in w["results"]),
    }


def print_table(summary: dict) -> None:
    """One table per workload, then the targets."""
    header = (
        f"{'configuration':<16} {'accept':>7} {'tok/pass':>8} {'e2e tok/s':>9} "
        f"{'decode tok/s':>12} {'speedup':>7}  same tokens"
    )
    print(f"{summary['device']}, {summary['threads']} threads; {summary['statistic']}")
    for workload in summary["workloads"]:
        print(f"\n{workload['name']} ({workload['prompt_tokens']} prompt tokens): ", end="")
        print(workload["description"])
        print(header)
        for row in workload["results"]:
            print(
                f"{row['configuration']:<16} {fmt(row['acceptance_rate'], '.0%'):>7} "
                f"{fmt(row['tokens_per_target_pass'], '.2f'):>8} "
                f"{row['end_to_end_tokens_per_s']:>9.2f} "
                f"{fmt(row['decode_tokens_per_s'], '.2f'):>12} "
                f"{row['speedup_vs_plain']:>6.2f}x  {row['same_tokens_as_plain']}"
            )
    print_targets(summary["targets"])


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.smoke:
        args.max_tokens, args.rounds, args.draft_layers = 6, 1, 1
    torch.set_num_threads(args.threads)
    weights, tokenizer, model = load(args.smoke)
    configs = configurations(args.num_draft, args.draft_layers)
    workloads = [run_workload(weights, tokenizer, w, configs, args) for w in WORKLOADS]
    summary = report(args, argv, model, workloads)
    write_json(args.out, summary)
    print_table(summary)
    print(f"\nwrote {args.out}")
    if not summary["same_tokens"]:
        print("FAILED: speculative decoding changed the greedy tokens", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
