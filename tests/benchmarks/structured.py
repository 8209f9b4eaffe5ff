"""CPU benchmark of structured outputs on the bundled model: `make bench-structured`.

What it measures (issue 28, item 7): whether a JSON Schema given as a
structured output makes the model's answers valid, and what the grammar's
token mask costs per token. The issue's goal: every constrained answer
schema-valid, and the mask under 10% of the decode time per token.

How:

- 50 chat prompts over four schemas (a flat object, a nested object, an
  enum field, an array), each asking for a JSON object and naming its keys in
  words (the schema itself is not in the prompt);
- each prompt runs twice with the same sampling parameters (temperature
  0.7, its own seed, `max_tokens` 150): unconstrained, and constrained by
  `StructuredOutput.json_schema` of its schema. Per mode, one fresh engine
  takes all 50 requests at once and steps until they finish (continuous
  batching);
- validity: the strict rate parses the whole text with `json.loads` and
  checks it with `jsonschema`; for the unconstrained answers the lenient
  rate also accepts the first fenced ```json block; finish reasons counted;
- speed: the decode phase is the steps after every request has its first
  token; decode tokens/s is its tokens over its wall time. The engine is
  timed from outside (nothing in `reference/` changes): `LogitsState.fill_bitmask`
  (the matcher filling one row's mask, for every token of a constrained
  request) and `Sampler.sample` are wrapped with timers; each masked sampling
  call is paired with the same call on the same logits without the mask (its
  time left out of the step's). Mask cost per token = fill time per token +
  (masked - unmasked sampling time per token); its share of the constrained
  run's decode time per token is checked against the 10% bar;
- the matchers side by side: the constrained answers' token sequences are
  replayed through xgrammar (the engine's) and llguidance on one thread, with
  the same schemas, whitespace allowed between tokens, timing the vocabulary tables, each
  schema's compile and every mask fill, and counting the masks on which the
  two differ; then again with the schemas' `maxLength` bounds removed (the
  same tokens still match), since xgrammar unrolls a bounded string.
  Anchor: llguidance states about 50 µs per mask for a 128k vocabulary on
  one core.

Missed targets are reported, never fatal. The summary goes to
`results/structured-cpu.json` and a table to stdout; `docs/structured.md`
and the performance page render it. The default is one torch thread: on a
2-core machine that other work shares, two threads run several times slower
(an OpenMP thread waits for its descheduled partner). `--smoke` runs 4
prompts for a few tokens: it checks the command end to end and measures
nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path

import torch

from decodespec.reference.backend import SERVE_BACKEND
from decodespec.reference.engine import Engine
from decodespec.reference.grammar import StructuredOutput
from decodespec.reference.logits_state import LogitsState
from decodespec.reference.request import RequestOutput
from decodespec.spec.forward import ModelWeights
from decodespec.spec.params import SamplingParams
from tests.benchmarks.gpu import print_targets, write_json
from tests.benchmarks.grammar_libraries import compare_matchers
from tests.benchmarks.speculative import load
from tests.benchmarks.structured_tasks import TASKS, Case, cases, check
from tests.benchmarks.test_cpu_engine import cpu_report_header

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = ROOT / "results" / "structured-cpu.json"
COMMAND = "python -m tests.benchmarks.structured"
TEMPERATURE = 0.7
OVERHEAD_BAR_PERCENT = 10.0
ANCHOR = {
    "source": "llguidance (README)",
    "statement": "about 50 µs of CPU time per mask for a 128k-token vocabulary on one core",
    "us_per_mask": 50.0,
    "vocab_size": 128_000,
}
SMOKE_NOTE = (
    "--smoke: 4 prompts, a few tokens each, one pass of the replay; "
    "these numbers check the command end to end and are not measurements."
)


# ---------------------------------------------------------------- timing the engine


@dataclass
class Timers:
    """Wraps the engine's mask fill and sampling with timers for one run.

    Each sampling call with a mask is paired with the same call without it
    (same logits, same rows, in alternating order; the unmasked result is
    dropped), so masked and unmasked sampling are compared on identical inputs;
    the extra call's time is kept apart (`extra_ns`) and left out of the step's.
    """

    engine: Engine
    fill_ns: list[int] = field(default_factory=list)
    masked_ns: int = 0
    unmasked_ns: int = 0
    paired_rows: int = 0
    extra_ns: int = 0

    def __enter__(self) -> Timers:
        self._fill = original_fill = LogitsState.fill_bitmask
        original_sample = self.engine.sampler.sample

        def fill_bitmask(state, bitmask, output):
            start = time.perf_counter_ns()
            original_fill(state, bitmask, output)
            self.fill_ns.append(time.perf_counter_ns() - start)

        def timed(logits, tensors):
            start = time.perf_counter_ns()
            result = original_sample(logits, tensors)
            return result, time.perf_counter_ns() - start

        def sample(logits, tensors):
            if tensors.token_bitmask is None:
                return original_sample(logits, tensors)
            plain = dataclasses.replace(tensors, token_bitmask=None)
            if self.paired_rows % 2:
                _, unmasked_ns = timed(logits, plain)
                result, masked_ns = timed(logits, tensors)
            else:
                result, masked_ns = timed(logits, tensors)
                _, unmasked_ns = timed(logits, plain)
            self.masked_ns += masked_ns
            self.unmasked_ns += unmasked_ns
            self.extra_ns += unmasked_ns
            self.paired_rows += len(logits)
            return result

        LogitsState.fill_bitmask = fill_bitmask
        self.engine.sampler.sample = sample
        return self

    def __exit__(self, *exc: object) -> None:
        LogitsState.fill_bitmask = self._fill
        del self.engine.sampler.sample


@dataclass
class Step:
    seconds: float  # the step's wall time less the timers' extra unmasked sampling
    tokens: int
    fills: list[int]
    masked_ns: int
    unmasked_ns: int
    paired_rows: int
    decode: bool  # every request had its first token before this step


def run_mode(
    weights: ModelWeights,
    tokenizer: object,
    prompts: list[list[int]],
    all_cases: list[Case],
    constrained: bool,
    args: argparse.Namespace,
) -> tuple[list[RequestOutput], dict]:
    """All requests added to one fresh engine, then stepped until done."""
    engine = Engine(weights, tokenizer, backend=args.backend, seed=0)
    steps: list[Step] = []
    with Timers(engine) as timers:
        start = time.perf_counter()
        ids = [
            engine.add_request(
                prompt,
                SamplingParams(temperature=TEMPERATURE, seed=case.seed, max_tokens=args.max_tokens),
                structured_output=StructuredOutput.json_schema(case.task.schema, "bench")
                if constrained
                else None,
            )
            for prompt, case in zip(prompts, all_cases, strict=True)
        ]
        add_s = time.perf_counter() - start
        started: set[int] = set()
        while engine.has_unfinished():
            decode = len(started) == len(ids)
            fills, extra = len(timers.fill_ns), timers.extra_ns
            masked, unmasked, rows = timers.masked_ns, timers.unmasked_ns, timers.paired_rows
            begin = time.perf_counter()
            outputs = engine.step()
            seconds = time.perf_counter() - begin - (timers.extra_ns - extra) / 1e9
            emitted = [o for o in outputs if o.token_id is not None]
            started.update(o.request_id for o in emitted)
            if len(steps) % 25 == 24:
                print(
                    f"    step {len(steps) + 1}, {time.perf_counter() - start:.0f} s",
                    file=sys.stderr,
                    flush=True,
                )
            steps.append(
                Step(
                    seconds,
                    len(emitted),
                    timers.fill_ns[fills:],
                    timers.masked_ns - masked,
                    timers.unmasked_ns - unmasked,
                    timers.paired_rows - rows,
                    decode,
                )
            )
        wall_s = time.perf_counter() - start - timers.extra_ns / 1e9
    results = [engine.output(i) for i in ids]
    return results, speed(steps, add_s, wall_s, results)


def speed(steps: list[Step], add_s: float, wall_s: float, outputs: list[RequestOutput]) -> dict:
    """A run's speed: end to end, in its decode phase, its mask fills and sampling."""
    decode = [s for s in steps if s.decode]
    decode_s = sum(s.seconds for s in decode)
    decode_tokens = sum(s.tokens for s in decode)
    fills = [ns / 1000 for s in decode for ns in s.fills]
    rows = sum(s.paired_rows for s in decode)
    per_request = [o.tokens_per_s for o in outputs if o.tokens_per_s]
    return {
        "add_requests_s": add_s,
        "wall_s": wall_s,
        "steps": len(steps),
        "completion_tokens": sum(len(o.token_ids) for o in outputs),
        "end_to_end_tokens_per_s": sum(len(o.token_ids) for o in outputs) / wall_s,
        "decode_steps": len(decode),
        "decode_s": decode_s,
        "decode_tokens": decode_tokens,
        "decode_tokens_per_s": decode_tokens / decode_s if decode_s else None,
        "decode_us_per_token": decode_s / decode_tokens * 1e6 if decode_tokens else None,
        "median_request_decode_tokens_per_s": statistics.median(per_request)
        if per_request
        else None,
        "mask_fills": len(fills),
        "fill_us_per_token": statistics.fmean(fills) if fills else None,
        "fill_us_median": statistics.median(fills) if fills else None,
        "fill_us_max": max(fills) if fills else None,
        "masked_sample_us_per_token": sum(s.masked_ns for s in decode) / 1000 / rows
        if rows
        else None,
        "unmasked_sample_us_per_token": sum(s.unmasked_ns for s in decode) / 1000 / rows
        if rows
        else None,
    }


def mode_summary(outputs: list[RequestOutput], all_cases: list[Case], timing: dict) -> dict:
    """Validity rates (all prompts and per schema), finish reasons, speed."""
    checks = [check(o.text, c.task.schema) for o, c in zip(outputs, all_cases, strict=True)]

    def rates(indices: list[int]) -> dict:
        return {
            key: sum(checks[i][key] for i in indices) / len(indices)
            for key in ("json", "schema", "json_or_fenced", "schema_or_fenced")
        }

    by_task = {}
    for task in TASKS:
        indices = [i for i, c in enumerate(all_cases) if c.task is task]
        if indices:
            by_task[task.name] = {"prompts": len(indices), **rates(indices)}
    examples = {}
    for output, case in zip(outputs, all_cases, strict=True):
        examples.setdefault(case.task.name, output.text[:400])
    return {
        "requests": len(outputs),
        "valid_json_rate": rates(list(range(len(outputs))))["json"],
        "schema_valid_rate": rates(list(range(len(outputs))))["schema"],
        "valid_json_rate_with_fenced": rates(list(range(len(outputs))))["json_or_fenced"],
        "schema_valid_rate_with_fenced": rates(list(range(len(outputs))))["schema_or_fenced"],
        "by_schema": by_task,
        "finish_reasons": dict(Counter(o.finish_reason for o in outputs)),
        "completion_tokens_per_request": statistics.fmean(len(o.token_ids) for o in outputs),
        **timing,
        "examples": examples,
    }


# ---------------------------------------------------------------- the report


def overhead(constrained: dict) -> dict:
    """The mask's cost per token of the constrained run, and its share of decode time."""
    fill = constrained["fill_us_per_token"]
    sample_delta = None
    if constrained["masked_sample_us_per_token"] is not None:
        sample_delta = (
            constrained["masked_sample_us_per_token"] - constrained["unmasked_sample_us_per_token"]
        )
    mask = None if fill is None else fill + (sample_delta or 0.0)
    decode = constrained["decode_us_per_token"]
    return {
        "fill_us_per_token": fill,
        "masked_sample_us_per_token": constrained["masked_sample_us_per_token"],
        "unmasked_sample_us_per_token": constrained["unmasked_sample_us_per_token"],
        "masked_minus_unmasked_sampling_us_per_token": sample_delta,
        "mask_us_per_token": mask,
        "decode_us_per_token": decode,
        "percent_of_decode": None if mask is None or not decode else 100 * mask / decode,
    }


def targets(constrained: dict, cost: dict) -> list[dict]:
    rate = constrained["schema_valid_rate"]
    percent = cost["percent_of_decode"]
    return [
        {
            "target": f"constrained answers 100% schema-valid (measured {rate:.0%})",
            "measured": rate,
            "met": rate == 1.0,
        },
        {
            "target": f"mask overhead < {OVERHEAD_BAR_PERCENT:.0f}% of decode time per token "
            f"(measured {percent:.1f}%: {cost['mask_us_per_token']:.0f} µs of "
            f"{cost['decode_us_per_token']:.0f} µs)"
            if percent is not None
            else f"mask overhead < {OVERHEAD_BAR_PERCENT:.0f}% of decode time per token "
            "(not measured: no decode step)",
            "measured": percent,
            "met": None if percent is None else percent < OVERHEAD_BAR_PERCENT,
        },
    ]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results JSON file")
    parser.add_argument("--max-tokens", type=int, default=150, help="new tokens per request")
    parser.add_argument("--backend", default=SERVE_BACKEND, help="the engine's backend")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="4 prompts, a few tokens: checks the command, measures nothing",
    )
    return parser.parse_args(argv)


def print_report(summary: dict) -> None:
    print(f"{summary['device']}, {summary['threads']} threads; {summary['batching']}")
    print(
        f"{'mode':>13} {'JSON':>5} {'schema':>6} {'+fenced':>7} {'tokens':>6} "
        f"{'decode tok/s':>12} {'fill µs/tok':>11}  finish reasons"
    )
    for mode in ("unconstrained", "constrained"):
        m = summary[mode]
        fill = "-" if m["fill_us_per_token"] is None else f"{m['fill_us_per_token']:.1f}"
        decode = "-" if m["decode_tokens_per_s"] is None else f"{m['decode_tokens_per_s']:.1f}"
        print(
            f"{mode:>13} {m['valid_json_rate']:>5.0%} {m['schema_valid_rate']:>6.0%} "
            f"{m['schema_valid_rate_with_fenced']:>7.0%} {m['completion_tokens']:>6} "
            f"{decode:>12} {fill:>11}  {m['finish_reasons']}"
        )
    cost = summary["mask_overhead"]
    if cost["mask_us_per_token"] is not None:
        print(
            f"mask per token: {cost['mask_us_per_token']:.1f} µs (fill "
            f"{cost['fill_us_per_token']:.1f} µs) of {cost['decode_us_per_token']:.0f} µs "
            f"decode = {cost['percent_of_decode']:.2f}% (bar: < {OVERHEAD_BAR_PERCENT:.0f}%)"
        )
    peers = summary["matchers"]
    for name in ("xgrammar", "llguidance"):
        lib = peers[name]
        fill = lib["fill"] or {"median_us": math.nan, "max_us": math.nan, "masks": 0}
        print(
            f"{name:>10}: tables {lib['tables_ms']:.0f} ms, fill median "
            f"{fill['median_us']:.1f} µs, max {fill['max_us']:.0f} µs over {fill['masks']} "
            f"masks (anchor: {ANCHOR['us_per_mask']:.0f} µs per "
            "mask, 128k vocabulary)"
        )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.smoke:
        args.max_tokens = min(args.max_tokens, 24)
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    weights, tokenizer, model = load(False)
    all_cases = cases(args.smoke)
    prompts = [
        tokenizer.encode(
            tokenizer.apply_chat_template([{"role": "user", "content": c.task.prompt(c.subject)}]),
            add_special_tokens=False,
        )
        for c in all_cases
    ]
    modes = {}
    outputs_of = {}
    for constrained in (False, True):
        name = "constrained" if constrained else "unconstrained"
        print(f"  {name}: {len(prompts)} requests ...", file=sys.stderr, flush=True)
        outputs, timing = run_mode(weights, tokenizer, prompts, all_cases, constrained, args)
        outputs_of[name] = outputs
        modes[name] = mode_summary(outputs, all_cases, timing)
    sequences: dict[str, list[list[int]]] = {}
    for output, case in zip(outputs_of["constrained"], all_cases, strict=True):
        sequences.setdefault(case.task.name, []).append(list(output.token_ids))
    print(
        "  replaying the constrained answers through xgrammar and llguidance ...", file=sys.stderr
    )
    matchers = compare_matchers(
        tokenizer, weights.config.vocab_size, sequences, repeats=1 if args.smoke else 5
    )
    cost = overhead(modes["constrained"])
    header = cpu_report_header(
        "structured-cpu", " ".join([COMMAND, *argv]), SMOKE_NOTE if args.smoke else None
    )
    header["software"].update(
        {name: version(name) for name in ("xgrammar", "llguidance", "jsonschema")}
    )
    summary = {
        **header,
        "load_average": [round(x, 2) for x in (*load_before, *os.getloadavg())],
        "load_average_note": "1, 5 and 15-minute load averages before, then after the run; "
        "the machine is shared, so timings are noisy",
        "model": model,
        "backend": args.backend,
        "batching": f"per mode, one fresh engine takes all {len(prompts)} requests at once, "
        "then steps until they finish (continuous batching)",
        "sampling": f"temperature {TEMPERATURE}, a seed per prompt (the same in both modes), "
        f"max_tokens {args.max_tokens}",
        "speed_note": "decode tok/s of the two modes is no like-for-like comparison: the "
        "constrained answers are shorter, so its batch empties sooner, and the machine's load "
        "differs between the runs; the mask's cost is the paired measurement",
        "prompts": len(prompts),
        "schemas": {task.name: task.schema for task in TASKS},
        "prompt_examples": {task.name: task.prompt(task.subjects[0]) for task in TASKS},
        "unconstrained": modes["unconstrained"],
        "constrained": modes["constrained"],
        "mask_overhead": cost,
        "matchers": matchers,
        "anchor": ANCHOR,
        "targets": targets(modes["constrained"], cost),
    }
    write_json(args.out, summary)
    print_report(summary)
    print_targets(summary["targets"])
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
