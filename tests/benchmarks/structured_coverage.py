"""What each grammar backend enforces, with no model, for `make bench-structured`.

- The JSON Schema Test Suite (draft 2020-12, vendored under tests/grammar/data):
  every case through `tests/grammar/schema_suite.run_suite` per backend. Soundness:
  invalid instances a compiled schema's matcher takes whole (MASK-SOUND-1: must be 0);
  completeness: valid instances taken over those run; schemas refused, per keyword.
  Per group (the suite's file: a keyword such as `maxLength`, or `format/date`), one
  row of the keyword × backend table.
- The JSONSchemaBench subset (tests/grammar/data/jsonschemabench: 14 real-world
  schemas from each of 9 sets): schemas each backend compiles (`GrammarCompiler.compile`,
  meta-schema check and schema policy included), per set, refusals per keyword, and
  the compile time per schema (xgrammar's compiler cache cleared before each;
  llguidance keeps none).
"""

from __future__ import annotations

import json
import statistics
import time
from collections import Counter
from pathlib import Path

from decodespec.reference.grammar import GrammarCompiler, GrammarError, StructuredOutput
from tests.grammar.schema_suite import SUITE, refused_keyword, run_suite

ROOT = Path(__file__).resolve().parents[2]
JSONSCHEMABENCH = ROOT / "tests" / "grammar" / "data" / "jsonschemabench"
# --smoke: a few of the suite's groups, and the first schema of each JSONSchemaBench set.
SMOKE_GROUPS = {"type", "maxLength", "enum", "optional/format/date"}
LISTED = 20  # at most this many refusals or misses listed per backend


def group_name(group: str) -> str:
    """A suite file as a row: `optional/format/date` is `format/date`."""
    return group.removeprefix("optional/")


def suite_source() -> str:
    source = SUITE / "SOURCE"
    return source.read_text().strip() if source.exists() else "JSON Schema Test Suite"


def suite_coverage(grammars: GrammarCompiler, smoke: bool) -> dict:
    """The whole suite (smoke: SMOKE_GROUPS) through one backend: totals, per group."""
    start = time.perf_counter()
    result = run_suite(grammars, SMOKE_GROUPS if smoke else None)
    seconds = time.perf_counter() - start
    groups = {}
    unsound = Counter(case.split(": ", 1)[0] for case, *_ in result.unsound)
    for group in sorted(result.cases):
        groups[group_name(group)] = {
            "cases": result.cases[group],
            "refused": result.refused[group],
            "invalid_run": result.invalid[group],
            "invalid_admitted": unsound[group],
            "valid_run": result.valid[group],
            "valid_accepted": result.accepted[group],
        }
    valid, accepted = sum(result.valid.values()), sum(result.accepted.values())
    return {
        "seconds": seconds,
        "cases": sum(result.cases.values()),
        "refused": sum(result.refused.values()),
        "compiled": sum(result.cases.values()) - sum(result.refused.values()),
        "invalid_run": sum(result.invalid.values()),
        "invalid_admitted": len(result.unsound),
        "valid_run": valid,
        "valid_accepted": accepted,
        "completeness": accepted / valid if valid else None,
        "refused_by_keyword": dict(result.refused_by_keyword.most_common()),
        "unsound": [
            {"case": case, "instance": description, "text": text}
            for case, description, text in result.unsound
        ],
        "misses": [
            {"case": case, "instance": description, "text": text[:200]}
            for case, description, text in result.misses[:LISTED]
        ],
        "groups": groups,
    }


def bench_schemas(smoke: bool) -> dict[str, object]:
    """The JSONSchemaBench subset, keyed "Set/id" (smoke: the first of each set)."""
    schemas = json.loads((JSONSCHEMABENCH / "schemas.json").read_text())
    if smoke:
        firsts: dict[str, str] = {}
        for key in schemas:
            firsts.setdefault(key.split("/")[0], key)
        schemas = {key: schemas[key] for key in firsts.values()}
    return schemas


def bench_source() -> str:
    return (JSONSCHEMABENCH / "SOURCE").read_text().strip()


def _percentile(ordered: list[float], q: float) -> float:
    return ordered[round(q * (len(ordered) - 1))]


def compile_coverage(grammars: GrammarCompiler, schemas: dict[str, object]) -> dict:
    """Which of `schemas` one backend compiles, per set, refusals per keyword, and the
    compile time of each (refused ones included: the refusal is the compile's answer)."""
    backend = grammars.backend
    grammars.compile(StructuredOutput("json_object"))  # the vocabulary tables, built first
    compiled, times = [], {}
    refused: dict[str, str] = {}
    by_keyword: Counter = Counter()
    per_set: dict[str, dict[str, int]] = {}
    for key, schema in schemas.items():
        counts = per_set.setdefault(key.split("/")[0], {"schemas": 0, "compiled": 0})
        counts["schemas"] += 1
        if backend.name == "xgrammar":
            backend._xgrammar_compiler().clear_cache()
        start = time.perf_counter()
        try:
            grammars.compile(StructuredOutput.json_schema(schema, field="schema"))
        except GrammarError as error:
            refused[key] = str(error)[:300]
            by_keyword[refused_keyword(str(error))] += 1
        else:
            compiled.append(key)
            counts["compiled"] += 1
        times[key] = (time.perf_counter() - start) * 1000
    ordered = sorted(times.values())
    slowest = max(times, key=times.get)
    return {
        "schemas": len(schemas),
        "compiled": len(compiled),
        "coverage": len(compiled) / len(schemas),
        "by_set": per_set,
        "refused_by_keyword": dict(by_keyword.most_common()),
        "refused": refused,
        "compiled_schemas": compiled,
        "compile_ms": {
            "median": statistics.median(ordered),
            "p90": _percentile(ordered, 0.9),
            "max": ordered[-1],
            "slowest": slowest,
            "compiled_median": statistics.median(times[k] for k in compiled) if compiled else None,
        },
    }
