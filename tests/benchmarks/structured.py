"""CPU benchmark of structured outputs on the bundled model: `make bench-structured`.

What it measures (issues 28 and 37): whether each grammar backend (llguidance, the
engine's default, and xgrammar; `reference/grammar_backends.py`) is sound and how
much of JSON Schema it covers, whether a JSON Schema given as a structured output
makes the model's answers valid, which JSON layout the engine should use, and what
the grammar's token mask costs per token. In order:

1. the JSON Schema Test Suite (draft 2020-12), per backend, no model
   (`structured_coverage.suite_coverage`): invalid instances admitted (soundness,
   MASK-SOUND-1: must be 0, printed loudly if not), valid instances accepted over
   those run (completeness), schemas refused per keyword; per group of the suite
   (`maxLength`, `format/date`, ...) a row of the keyword × backend table;
2. the JSONSchemaBench subset (126 real-world schemas, 14 of each of 9 sets), per
   backend, no model (`structured_coverage.compile_coverage`): schemas compiled, per
   set, refusals per keyword, compile time per schema (median, p90; xgrammar's
   compiler cache cleared before each);
3. the same schemas with the model, per backend (`structured_generation`): one
   greedy constrained answer per schema, the schema's text in the prompt, all of a
   backend's requests in one engine; the rate of answers that finished "stop" and
   are schema-valid (`jsonschema`, formats checked), the finish reasons, and any
   answer that finished "stop" yet is invalid (a soundness bug: printed loudly).
   The schemas are capped (the same for both backends; the file says how) to keep
   the bench within about 20 minutes on a shared 2-core CPU;
4. 50 chat prompts over four schemas (a flat object, a nested object, an enum
   field, an array; tests/benchmarks/structured_tasks.py), each asking for a JSON
   object and naming its keys in words (the schema itself is not in the prompt),
   run with the default backend twice with the same sampling parameters
   (temperature 0.7, its own seed, `max_tokens` 150): unconstrained, and
   constrained by `StructuredOutput.json_schema` of its schema. Per mode, one
   fresh engine takes all 50 requests at once and steps until they finish
   (continuous batching). Validity: the strict rate parses the whole text with
   `json.loads` and checks it with `jsonschema`; for the unconstrained answers the
   lenient rate also accepts the first fenced ```json block; finish reasons counted;
5. the JSON layout decision: the constrained run again with at most 24 (the old
   layout), 4, 1 and 0 (compact) whitespace characters wherever JSON allows
   whitespace. The bench sets `decodespec.reference.grammar_backends.MAX_JSON_WHITESPACE`
   before adding the requests (compile reads it then) and restores it after; the
   engine's own value is the constrained run of item 4. Per layout: the "stop" rate
   (the bar: at least 99% for the engine's layout) and the schema-valid rate;
6. speed, for the default backend: the decode phase is the steps after every
   request has its first token; decode tokens/s is its tokens over its wall time.
   The engine is timed from outside (nothing in `reference/` changes):
   `LogitsState.grammar_rows` (the matcher's sweep filling a constrained request's
   mask rows of a pass: one row per token here, without speculation) and
   `Sampler.sample` are wrapped with timers; each masked sampling call is paired
   with the same call on the same logits without the mask (its time left out of
   the step's). Mask cost per token = fill time per token + (masked - unmasked
   sampling time per token); its share of the constrained run's decode time per
   token is checked against the 10% bar;
7. the matchers side by side (`grammar_libraries.compare_matchers`): the
   constrained answers' token sequences replayed through both backends' own
   compile and matchers on one thread, timing the vocabulary tables, each schema's
   compile and every mask fill, and counting the masks on which the two differ;
   then again with the schemas' `maxLength` bounds removed (the same tokens still
   match), since xgrammar unrolls a bounded string. Anchor: llguidance states
   about 50 µs per mask for a 128k vocabulary on one core.

Missed targets are reported, never fatal. The summary goes to
`results/structured-cpu.json` and a table to stdout; `docs/structured.md`
and the performance page render it. The default is one torch thread: on a
2-core machine that other work shares, two threads run several times slower
(an OpenMP thread waits for its descheduled partner). `--smoke` runs a few of
the suite's groups, one JSONSchemaBench schema per set, 1 of them with the model
and 4 prompts, a few tokens each: it checks the command end to end and measures
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

from decodespec.reference import grammar_backends
from decodespec.reference.backend import DEFAULT_BACKEND as ENGINE_BACKEND
from decodespec.reference.engine import Engine
from decodespec.reference.grammar import (
    DEFAULT_BACKEND,
    GrammarCompiler,
    GrammarError,
    StructuredOutput,
)
from decodespec.reference.grammar_backends import BACKENDS
from decodespec.reference.logits_state import LogitsState
from decodespec.reference.request import RequestOutput
from decodespec.reference.request_options import RequestOptions
from decodespec.spec.forward import ModelWeights
from decodespec.spec.params import SamplingParams
from tests.benchmarks.gpu import print_targets, write_json
from tests.benchmarks.grammar_libraries import compare_matchers
from tests.benchmarks.speculative import load
from tests.benchmarks.structured_coverage import (
    bench_schemas,
    bench_source,
    compile_coverage,
    suite_coverage,
    suite_source,
)
from tests.benchmarks.structured_generation import PROMPT, generate, select
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
    "--smoke: a few groups of the Test Suite, one JSONSchemaBench schema per set (1 of them "
    "with the model), 4 prompts, a few tokens each, one pass of the replay; "
    "these numbers check the command end to end and are not measurements."
)
# The JSON layouts compared: at most this many whitespace characters wherever JSON
# allows whitespace (grammar_backends.MAX_JSON_WHITESPACE); 24 was the old layout.
LAYOUTS = (24, 4, 1, 0)
STOP_BAR = 0.99  # the engine's layout: at least this share of constrained answers stop


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
        self._fill = original_fill = LogitsState.grammar_rows
        original_sample = self.engine.sampler.sample

        def grammar_rows(state, draft_tokens, words):
            start = time.perf_counter_ns()
            result = original_fill(state, draft_tokens, words)
            if state.matcher is not None:
                self.fill_ns.append(time.perf_counter_ns() - start)
            return result

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

        LogitsState.grammar_rows = grammar_rows
        self.engine.sampler.sample = sample
        return self

    def __exit__(self, *exc: object) -> None:
        LogitsState.grammar_rows = self._fill
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
    engine = Engine(
        weights, tokenizer, backend=args.backend, seed=0, grammar_backend=args.grammar_backend
    )
    steps: list[Step] = []
    with Timers(engine) as timers:
        start = time.perf_counter()
        ids = [
            engine.add_request(
                prompt,
                SamplingParams(temperature=TEMPERATURE, seed=case.seed, max_tokens=args.max_tokens),
                RequestOptions(
                    structured_output=StructuredOutput.json_schema(case.task.schema, "bench")
                    if constrained
                    else None
                ),
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
        "stop_rate": sum(o.finish_reason == "stop" for o in outputs) / len(outputs),
        "whitespace_per_answer": statistics.fmean(json_whitespace(o.text) for o in outputs),
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


def json_whitespace(text: str) -> int:
    """The whitespace characters of `text` outside JSON strings (the layout's share)."""
    count, in_string, escaped = 0, False, False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in " \n\r\t":
            count += 1
    return count


def layout_runs(
    weights: ModelWeights,
    tokenizer: object,
    prompts: list[list[int]],
    all_cases: list[Case],
    args: argparse.Namespace,
    engine_run: dict,
) -> dict:
    """The constrained run once per layout of LAYOUTS: `MAX_JSON_WHITESPACE` set before
    the requests are added (compile reads it there), restored after. The engine's own
    value is `engine_run`, the constrained run already made."""
    engine_value = grammar_backends.MAX_JSON_WHITESPACE
    runs = []
    for value in sorted({*LAYOUTS, engine_value}, reverse=True):
        if value == engine_value:
            summary = engine_run
        else:
            print(f"  layout: at most {value} whitespace ...", file=sys.stderr, flush=True)
            grammar_backends.MAX_JSON_WHITESPACE = value
            try:
                outputs, timing = run_mode(weights, tokenizer, prompts, all_cases, True, args)
            except GrammarError as error:  # xgrammar takes no bound of 0
                runs.append({"max_whitespace": value, "engine": False, "refused": str(error)})
                continue
            finally:
                grammar_backends.MAX_JSON_WHITESPACE = engine_value
            summary = mode_summary(outputs, all_cases, timing)
        runs.append(
            {
                "max_whitespace": value,
                "engine": value == engine_value,
                "requests": summary["requests"],
                "stop_rate": summary["stop_rate"],
                "schema_valid_rate": summary["schema_valid_rate"],
                "valid_json_rate": summary["valid_json_rate"],
                "finish_reasons": summary["finish_reasons"],
                "completion_tokens_per_request": summary["completion_tokens_per_request"],
                "whitespace_per_answer": summary["whitespace_per_answer"],
                "by_schema": {name: task["schema"] for name, task in summary["by_schema"].items()},
                "example": next(iter(summary["examples"].values()), ""),
                "wall_s": summary["wall_s"],
            }
        )
    return {
        "engine_max_whitespace": engine_value,
        "backend": args.grammar_backend,
        "method": "the constrained run of the prompts (same sampling, same seeds) once per "
        "layout: the bench sets decodespec.reference.grammar_backends.MAX_JSON_WHITESPACE "
        "before adding the requests (compile reads it then) and restores it after",
        "max_tokens": args.max_tokens,
        "stop_bar": STOP_BAR,
        "runs": runs,
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


def checks(suite: dict, generation: dict, layouts: dict) -> list[dict]:
    """Soundness per backend (the Test Suite's invalid instances, the model's stopped
    answers) and the engine layout's stop rate: beside the targets, never fatal."""
    found = []
    for name, result in suite["backends"].items():
        admitted = result["invalid_admitted"]
        found.append(
            {
                "check": f"{name}: no invalid instance of the JSON Schema Test Suite admitted "
                f"({admitted} of {result['invalid_run']})",
                "met": admitted == 0,
            }
        )
    for name, result in generation["backends"].items():
        bad = len(result["stop_but_invalid"])
        found.append(
            {
                "check": f'{name}: no JSONSchemaBench answer that finished "stop" is '
                f"schema-invalid ({bad} of {result['finish_reasons'].get('stop', 0)})",
                "met": bad == 0,
            }
        )
    engine = next(run for run in layouts["runs"] if run["engine"])
    found.append(
        {
            "check": f"the engine's layout (at most {engine['max_whitespace']} whitespace): "
            f'at least {STOP_BAR:.0%} of constrained answers finish "stop" at max_tokens '
            f"{layouts['max_tokens']} (measured {engine['stop_rate']:.0%})",
            "met": engine["stop_rate"] >= STOP_BAR,
        }
    )
    return found


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results JSON file")
    parser.add_argument("--max-tokens", type=int, default=150, help="new tokens per request")
    parser.add_argument("--backend", default=ENGINE_BACKEND, help="the engine's backend")
    parser.add_argument(
        "--grammar-backend",
        default=DEFAULT_BACKEND,
        choices=BACKENDS,
        help="the grammar backend of the 50 prompts, the layouts and the mask's cost",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument(
        "--generate-per-set",
        type=int,
        default=2,
        help="JSONSchemaBench with the model: schemas per set (0: every schema each backend "
        "compiles, uncapped)",
    )
    parser.add_argument(
        "--generate-max-bytes",
        type=int,
        default=1500,
        help="JSONSchemaBench with the model: the longest schema text in a prompt",
    )
    parser.add_argument(
        "--generate-max-tokens",
        type=int,
        default=256,
        help="JSONSchemaBench with the model: new tokens per answer",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="a few schemas and prompts, a few tokens: checks the command, measures nothing",
    )
    return parser.parse_args(argv)


def loud(lines: list[str]) -> None:
    """A soundness failure, where nobody can miss it."""
    bar = "!" * 78
    print("\n".join([bar, *(f"!! {line}" for line in lines), bar]), file=sys.stderr, flush=True)
    print("\n".join([bar, *(f"!! {line}" for line in lines), bar]), flush=True)


def coverage(tokenizer: object, vocab_size: int, smoke: bool) -> tuple[dict, dict]:
    """The Test Suite and JSONSchemaBench's compile coverage, per backend (no model)."""
    suite, bench = {}, {}
    schemas = bench_schemas(smoke)
    for name in BACKENDS:
        print(f"  {name}: JSON Schema Test Suite ...", file=sys.stderr, flush=True)
        suite[name] = suite_coverage(GrammarCompiler(tokenizer, vocab_size, name), smoke)
        if suite[name]["unsound"]:
            loud(
                [f"SOUNDNESS: {name} admits invalid instances of the JSON Schema Test Suite:"]
                + [f"{u['case']}: {u['instance']}: {u['text']}" for u in suite[name]["unsound"]]
            )
        print(f"  {name}: JSONSchemaBench compile ...", file=sys.stderr, flush=True)
        bench[name] = compile_coverage(GrammarCompiler(tokenizer, vocab_size, name), schemas)
    keyword_table = {}
    for name in BACKENDS:
        for group, row in suite[name].pop("groups").items():
            keyword_table.setdefault(group, {})[name] = row
    test_suite = {
        "source": suite_source(),
        "method": "Every case's schema checked and compiled as a request's "
        "(`GrammarCompiler.compile`); for a compiled one, each instance written in the grammar's "
        "layout and fed to a fresh matcher token by token, then the stop token "
        "(tests/grammar/schema_suite.py). Invalid admitted: soundness, must be 0; valid "
        "accepted / run: completeness",
        "backends": suite,
        "keywords": dict(sorted(keyword_table.items())),
    }
    jsonschemabench = {
        "source": bench_source(),
        "schemas": len(schemas),
        "method": "Each schema compiled as a request's (`GrammarCompiler.compile`: meta-schema "
        "check, schema policy, the library), one at a time on one thread, xgrammar's compiler "
        "cache cleared before each (llguidance keeps none); compile time of every schema, refused "
        "ones included",
        "backends": bench,
    }
    return test_suite, jsonschemabench


def model_answers(weights, tokenizer, bench: dict, args: argparse.Namespace) -> dict:
    """JSONSchemaBench's schemas with the model, per backend (`structured_generation`)."""
    schemas = bench_schemas(args.smoke)
    compiled = {name: bench["backends"][name]["compiled_schemas"] for name in BACKENDS}
    max_tokens = min(args.generate_max_tokens, 8) if args.smoke else args.generate_max_tokens
    if args.generate_per_set > 0 or args.smoke:
        keys = select(schemas, compiled, max(args.generate_per_set, 1), args.generate_max_bytes)
        keys = keys[:1] if args.smoke else keys
        chosen = dict.fromkeys(BACKENDS, keys)
        cap = (
            f"capped to keep the bench within about 20 minutes on this CPU: the same "
            f"{len(keys)} schemas for both backends, those both compile, the first "
            f"{args.generate_per_set} of each set (in the file's order) whose JSON text is at "
            f"most {args.generate_max_bytes} bytes (the schema is in the prompt, and a long "
            "prompt slows every step of the batch)"
        )
    else:
        chosen = compiled
        cap = None
    results = {}
    for name in BACKENDS:
        print(f"  {name}: {len(chosen[name])} JSONSchemaBench answers ...", file=sys.stderr)
        results[name] = generate(
            weights, tokenizer, name, schemas, chosen[name], max_tokens, args.backend
        )
        if results[name]["stop_but_invalid"]:
            loud(
                [f'SOUNDNESS: {name} let answers finish "stop" that the schema rejects:']
                + [
                    f"{b['schema']}: {b['why']}: {b['text']}"
                    for b in results[name]["stop_but_invalid"]
                ]
            )
    return {
        "prompt": PROMPT,
        "sampling": f"greedy (temperature 0), max_tokens {max_tokens}",
        "looping_note": "an answer that finished length is counted as looping when its last 60 "
        "characters repeat one unit of at most 24 (a loop no larger max_tokens would end)",
        "batching": "per backend, one fresh engine takes all its requests at once, then steps "
        "until they finish (continuous batching)",
        "validity": "the whole text parses as JSON and jsonschema's Draft202012Validator, "
        "formats checked, accepts it",
        "capped": cap is not None,
        "cap": cap,
        "schemas": sorted({key for keys in chosen.values() for key in keys}),
        "backends": results,
    }


def print_report(summary: dict) -> None:
    print(f"{summary['device']}, {summary['threads']} threads; {summary['batching']}")
    suite = summary["test_suite"]["backends"]
    bench = summary["jsonschemabench"]["backends"]
    answers = summary["jsonschemabench_model"]["backends"]
    print(
        f"{'backend':>10} {'invalid admitted':>16} {'valid accepted':>14} {'refused':>9}  "
        f"{'JSB compiled':>12} {'compile ms p50/p90':>18}  {'model valid+stop':>16}"
    )
    for name in BACKENDS:
        t, b, a = suite[name], bench[name], answers[name]
        print(
            f"{name:>10} {t['invalid_admitted']:>6} of {t['invalid_run']:<6} "
            f"{t['valid_accepted']:>5}/{t['valid_run']:<5} ({t['completeness']:.0%}) "
            f"{t['refused']:>3}/{t['cases']:<4}  {b['compiled']:>5}/{b['schemas']:<6} "
            f"{b['compile_ms']['median']:>8.1f}/{b['compile_ms']['p90']:<8.1f}  "
            f"{a['valid_and_stop']:>5}/{a['requests']:<3} {a['finish_reasons']}"
        )
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
    print("layout (max whitespace): stop rate, schema-valid rate, tokens per answer")
    for run in summary["layouts"]["runs"]:
        mark = " (engine)" if run["engine"] else ""
        if "refused" in run:
            print(f"{run['max_whitespace']:>6}{mark:<9} refused: {run['refused']}")
            continue
        print(
            f"{run['max_whitespace']:>6}{mark:<9} {run['stop_rate']:>5.0%} "
            f"{run['schema_valid_rate']:>5.0%} {run['completion_tokens_per_request']:>6.1f}"
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
    for found in summary["checks"]:
        print(f"  [{'met' if found['met'] else 'NOT MET'}] {found['check']}")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.smoke:
        args.max_tokens = min(args.max_tokens, 24)
    torch.set_num_threads(args.threads)
    bench_start = time.perf_counter()
    load_before = os.getloadavg()
    weights, tokenizer, model = load(False)
    vocab_size = weights.config.vocab_size
    phases = {}
    mark = time.perf_counter()

    def phase(name: str) -> None:
        nonlocal mark
        phases[name] = time.perf_counter() - mark
        mark = time.perf_counter()

    phase("load")
    test_suite, jsonschemabench = coverage(tokenizer, vocab_size, args.smoke)
    phase("test_suite_and_jsonschemabench_compile")
    jsonschemabench_model = model_answers(weights, tokenizer, jsonschemabench, args)
    phase("jsonschemabench_with_the_model")
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
    phase("fifty_prompts")
    layouts = layout_runs(weights, tokenizer, prompts, all_cases, args, modes["constrained"])
    phase("layouts")
    sequences: dict[str, list[list[int]]] = {}
    for output, case in zip(outputs_of["constrained"], all_cases, strict=True):
        sequences.setdefault(case.task.name, []).append(list(output.token_ids))
    print(
        "  replaying the constrained answers through xgrammar and llguidance ...", file=sys.stderr
    )
    matchers = compare_matchers(tokenizer, vocab_size, sequences, repeats=1 if args.smoke else 3)
    phase("replay")
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
        "backends": list(BACKENDS),
        "grammar_backend": args.grammar_backend,
        "max_json_whitespace": grammar_backends.MAX_JSON_WHITESPACE,
        "test_suite": test_suite,
        "jsonschemabench": jsonschemabench,
        "jsonschemabench_model": jsonschemabench_model,
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
        "layouts": layouts,
        "mask_overhead": cost,
        "matchers": matchers,
        "anchor": ANCHOR,
        "targets": targets(modes["constrained"], cost),
        "checks": checks(test_suite, jsonschemabench_model, layouts),
    }
    summary["bench_wall_s"] = time.perf_counter() - bench_start
    summary["phase_seconds"] = phases
    write_json(args.out, summary)
    print_report(summary)
    print_targets(summary["targets"])
    print(f"\nbench wall time: {summary['bench_wall_s']:.0f} s")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
