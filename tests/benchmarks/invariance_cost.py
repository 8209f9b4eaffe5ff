"""`make bench-invariance`: what batch invariance by construction costs (issue 60).

The engine of this checkout against the engine of another revision (`--before`, by
default the last commit before the default engine became batch-invariant), side by
side: each measurement in a fresh process importing that tree's `decodespec`, the
two trees interleaved round by round (their order alternating), medians of the
rounds reported. Both run the commands' defaults (`--backend torch`, the bundled
model) in the file's format (int4) and in float32:

- decode, 1 stream: tokens/s after the first token of one request (64 tokens);
- prefill: seconds to the first token of a ~500-token prompt, alone;
- serving, 1 / 4 / 16 streams: aggregate tokens/s of that many requests added at
  once (32 tokens each, first tokens included).

Every request is sampled (temperature 0.8, its own seed) with `top_logprobs` 5, as
the determinism probe's are. Results: `results/invariance-cost-cpu.json`, with the
CPU that measured them.

`--mode` measures instead what the batch-invariant mode costs where the engine is
not invariant by construction (the spec backend, bfloat16 weights): this checkout's
engine with and without `batch_invariant=True`, interleaved the same way, decode and
prefill only (the spec backend decodes about one token a second). Results:
`results/invariance-mode-cost-cpu.json`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from tests.benchmarks.gpu import write_json
from tests.peers import llama_build

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = ROOT / "results" / "invariance-cost-cpu.json"
MODE_OUT = ROOT / "results" / "invariance-mode-cost-cpu.json"
COMMAND = "python -m tests.benchmarks.invariance_cost"
# The last commit whose default engine was not batch-invariant (issue 60's "today").
BEFORE = "719f58e"
FORMATS = ("auto", "float32")
# `--mode`'s configurations, (backend, weights): those the mode is for (batch_invariance).
MODE_CONFIGS = (("spec", "auto"), ("torch", "bfloat16"))

# Run in a fresh interpreter with argv = [tree, weights, backend, batch_invariant (0/1),
# decode-and-prefill-only (0/1)]: imports `decodespec` from `tree` (not the editable
# install's checkout) and prints one JSON object.
CHILD = r"""
import json, sys, time, types
tree, weights_format, backend = sys.argv[1:4]
batch_invariant, light = (flag == "1" for flag in sys.argv[4:6])
sys.meta_path = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
package = types.ModuleType("decodespec")
package.__path__ = [tree]
sys.modules["decodespec"] = package
import torch
from decodespec.reference.engine import Engine
from decodespec.reference.loader import load_model
from decodespec.reference.model_files import bundled_model_path
from decodespec.spec.params import SamplingParams

weights, tokenizer = load_model(bundled_model_path(), weights=weights_format)
PROMPTS = [f"Write a short story about a {w} who finds a map." for w in
           ("cat", "robot", "baker", "pilot", "gardener", "wizard", "child", "sailor",
            "doctor", "painter", "farmer", "king", "student", "dragon", "miner", "poet")]
LONG = "Summarise the following notes. " + "The meeting moved to Thursday. " * 80

def params(seed, tokens):
    return SamplingParams(temperature=0.8, seed=seed, max_tokens=tokens, top_logprobs=5,
                          ignore_eos=True)

def engine():
    mode = {"batch_invariant": True} if batch_invariant else {}
    return Engine(weights, tokenizer, backend=backend, seed=0, **mode)

def run(prompts, tokens):
    e = engine()
    ids = [e.add_request(tokenizer.encode(p), params(i, tokens)) for i, p in enumerate(prompts)]
    start, first = time.perf_counter(), None
    while e.has_unfinished():
        outputs = e.step()
        if first is None and outputs:
            first = time.perf_counter()
    end = time.perf_counter()
    produced = sum(e.output(i).completion_tokens for i in ids)
    return start, first, end, produced

with torch.inference_mode():
    run(PROMPTS[:1], 4)  # warm: the C library loaded, the first allocations made
    start, first, end, produced = run(PROMPTS[:1], 16 if light else 64)
    result = {"decode, 1 stream (tokens/s)": (produced - 1) / (end - first)}
    start, first, end, produced = run([LONG], 1)
    result["prefill, 500 tokens (s)"] = first - start
    for streams in () if light else (1, 4, 16):
        start, first, end, produced = run(PROMPTS[:streams], 32)
        result[f"serving, {streams} streams (tokens/s)"] = produced / (end - start)
    result["path"] = engine().path
print(json.dumps(result))
"""


def measure(
    tree: Path,
    weights_format: str,
    backend: str = "torch",
    mode: bool = False,
    light: bool = False,
) -> dict:
    """One process's measurements of `tree`'s engine in `weights_format` on `backend`,
    in batch-invariant mode or not (`light`: decode and prefill only)."""
    flags = ["1" if mode else "0", "1" if light else "0"]
    run = subprocess.run(
        [sys.executable, "-c", CHILD, str(tree), weights_format, backend, *flags],
        capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    if run.returncode != 0:
        what = f"{tree} ({weights_format}, {backend}{', mode' if mode else ''})"
        raise RuntimeError(f"measuring {what} failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def medians(rounds: list[dict]) -> dict:
    """Each measure's median over the rounds (the path as the rounds reported it)."""
    names = [name for name in rounds[0] if name != "path"]
    return {name: round(statistics.median(r[name] for r in rounds), 3) for name in names}


def relative(after: dict, before: dict) -> dict:
    """after / before per measure, > 1 better: rates as they are, times inverted."""
    return {
        name: round(before[name] / after[name] if "(s)" in name else after[name] / before[name], 3)
        for name in after
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default=BEFORE, help=f"the revision (default {BEFORE})")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    parser.add_argument(
        "--mode",
        action="store_true",
        help="the mode's cost on the spec backend and bfloat16 instead",
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    args.out = args.out or (MODE_OUT if args.mode else DEFAULT_OUT)
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    return args


def header(argv: Sequence[str] | None, benchmark: str) -> dict:
    """What every results file of this bench starts with: the command and the machine."""
    return {
        "benchmark": benchmark,
        "command": " ".join([COMMAND, *(argv if argv is not None else sys.argv[1:])]),
        "machine": llama_build.describe()["cpu"],
        "instruction_sets": llama_build.describe()["instruction_sets"],
    }


def measure_mode(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    """`--mode`: each of `MODE_CONFIGS` with the mode off and on, interleaved."""
    runs: dict[str, dict[str, list[dict]]] = {}
    for r in range(args.rounds):
        order = [False, True] if r % 2 == 0 else [True, False]
        for backend, fmt in MODE_CONFIGS:
            config = runs.setdefault(f"{backend}, {fmt}", {"off": [], "mode": []})
            for mode in order:
                side = "mode" if mode else "off"
                config[side].append(measure(ROOT, fmt, backend, mode, light=True))
                print(f"round {r + 1}, {backend} {fmt}, {side}: {config[side][-1]}", flush=True)
    results = {**header(argv, "batch-invariant mode cost"), "rounds": args.rounds,
               "configurations": {}}  # fmt: skip
    for name, sides in runs.items():
        off, mode = medians(sides["off"]), medians(sides["mode"])
        results["configurations"][name] = {
            "path": {side: sides[side][-1]["path"] for side in sides},
            "off": off,
            "mode": mode,
            "mode_relative": relative(mode, off),
            "all_rounds": sides,
        }
        relative_cost = results["configurations"][name]["mode_relative"]
        print(f"{name}: mode / off (> 1 better): {relative_cost}")
    write_json(args.out, results)
    print(f"wrote {args.out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.mode:
        return measure_mode(args, argv)
    with tempfile.TemporaryDirectory(prefix="decodespec-before-") as scratch:
        before_tree = Path(scratch) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q",
                        str(before_tree), args.before], check=True)  # fmt: skip
        try:
            trees = {"before": before_tree, "after": ROOT}
            runs: dict[str, dict[str, list[dict]]] = {f: {"before": [], "after": []}
                                                      for f in args.formats}  # fmt: skip
            for r in range(args.rounds):
                order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
                for fmt in args.formats:
                    for side in order:
                        runs[fmt][side].append(measure(trees[side], fmt))
                        print(f"round {r + 1}, {fmt}, {side}: {runs[fmt][side][-1]}", flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                            str(before_tree)], check=False)  # fmt: skip
    rev_parse = ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"]
    head = subprocess.run(rev_parse, capture_output=True, text=True).stdout.strip()
    results = {
        **header(argv, "invariance cost"),
        "before": args.before,
        "after": head,
        "rounds": args.rounds,
        "formats": {},
    }
    for fmt, sides in runs.items():
        before, after = medians(sides["before"]), medians(sides["after"])
        results["formats"][fmt] = {
            "path": {side: sides[side][-1]["path"] for side in sides},
            "before": before,
            "after": after,
            "after_relative": relative(after, before),
            "all_rounds": sides,
        }
        print(f"{fmt}: after / before (> 1 better): {results['formats'][fmt]['after_relative']}")
    write_json(args.out, results)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
