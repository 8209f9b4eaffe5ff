"""xgrammar and llguidance side by side, for `make bench-structured`: the constrained
answers' tokens replayed through both backends of `reference/grammar_backends.py` on
one thread, exactly as the engine runs them (`GrammarCompiler(tokenizer, vocab, name)`,
`grammars.compile(output)`, `grammars.backend.matcher(compiled)`), timing the
vocabulary tables, each schema's compile and every mask fill
(tests/benchmarks/structured.py says why)."""

from __future__ import annotations

import statistics
import time
from importlib.metadata import version

import torch

from decodespec.reference import grammar_backends
from decodespec.reference.grammar import GrammarCompiler, GrammarError, StructuredOutput
from decodespec.spec.token_mask import bitmask_words
from tests.benchmarks.structured_tasks import TASKS

LIBRARIES = ("xgrammar", "llguidance")


def _median_ms(build, repeats: int) -> tuple[float, object]:
    """The median wall time of `build()` in ms over `repeats` calls, and its last result."""
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = build()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times), result


def _fill_figures(us: list[float]) -> dict:
    ordered = sorted(us)
    return {
        "masks": len(us),
        "mean_us": statistics.fmean(us),
        "median_us": statistics.median(us),
        "p90_us": ordered[int(0.9 * (len(ordered) - 1))],
        "p99_us": ordered[int(0.99 * (len(ordered) - 1))],
        "max_us": ordered[-1],
    }


def without_max_length(schema: object) -> object:
    """`schema` with every "maxLength" removed (xgrammar compiles a bounded string
    slowly: the length is unrolled into the grammar)."""
    if isinstance(schema, dict):
        return {k: without_max_length(v) for k, v in schema.items() if k != "maxLength"}
    if isinstance(schema, list):
        return [without_max_length(v) for v in schema]
    return schema


def _allowed(bitmask: torch.Tensor) -> int:
    """How many tokens a `[words]` mask allows."""
    return sum(bin(word & 0xFFFFFFFF).count("1") for word in bitmask.tolist())


def build_tables(grammars: GrammarCompiler) -> object:
    """The backend's vocabulary tables, built as on an engine's first grammar."""
    backend = grammars.backend
    if backend.name == "xgrammar":
        backend._compiler = None
        return backend._xgrammar_compiler()
    backend._tokenizer = None
    return backend._ll_tokenizer()


def compile_schema(grammars: GrammarCompiler, schema: object) -> object:
    """`schema` compiled as the engine compiles a request's (`GrammarCompiler.compile`: the
    meta-schema check, `schema_policy`, then the library), xgrammar's cache cleared."""
    if grammars.backend.name == "xgrammar":
        grammars.backend._xgrammar_compiler().clear_cache()
    return grammars.compile(StructuredOutput.json_schema(schema, field="bench"))


def compare_matchers(
    tokenizer: object, vocab_size: int, sequences: dict[str, list[list[int]]], repeats: int
) -> dict:
    """xgrammar and llguidance on one thread: tables, compile per schema, and each mask
    fill while replaying the constrained answers' tokens through both in lockstep."""
    grammars = {name: GrammarCompiler(tokenizer, vocab_size, name) for name in LIBRARIES}
    tables_ms = {}
    for name in LIBRARIES:
        tables_ms[name], _ = _median_ms(lambda name=name: build_tables(grammars[name]), repeats)
    words = bitmask_words(vocab_size)
    masks = {name: torch.zeros(words, dtype=torch.int32) for name in LIBRARIES}
    fills: dict[str, dict[str, list[float]]] = {
        variant: {name: [] for name in LIBRARIES} for variant in ("bounded", "unbounded")
    }
    rows, total, differ, differing_tokens = {}, 0, 0, 0
    allowed = dict.fromkeys(LIBRARIES, 0)
    rejected = dict.fromkeys(LIBRARIES, 0)

    for task in TASKS:
        if task.name not in sequences:
            continue
        rows[task.name] = {}
        # The schema as the engine ran it, then without its maxLength bounds (which only
        # loosens it: the same tokens are accepted). Masks are compared on the first of the
        # two that both libraries compile (xgrammar refuses string length bounds).
        compared = False
        for variant, schema in (
            ("bounded", task.schema),
            ("unbounded", without_max_length(task.schema)),
        ):
            compiled = {}
            suffix = "" if variant == "bounded" else "_without_maxLength"
            try:
                for name in LIBRARIES:
                    ms, compiled[name] = _median_ms(
                        lambda name=name, schema=schema: compile_schema(grammars[name], schema),
                        repeats,
                    )
                    rows[task.name][f"{name}_compile_ms{suffix}"] = ms
            except GrammarError as error:
                rows[task.name][f"refused{suffix}"] = str(error)
                continue
            compare, compared = not compared, True
            # "fill": the pass whose masks are compared; the other, if any, apart.
            us = fills["bounded" if compare else "unbounded"]
            for tokens in sequences[task.name]:
                matchers = {
                    name: grammars[name].backend.matcher(compiled[name]) for name in LIBRARIES
                }
                for token in tokens:
                    ok = {}
                    for name in LIBRARIES:
                        start = time.perf_counter_ns()
                        matchers[name].fill_bitmask(masks[name])
                        us[name].append((time.perf_counter_ns() - start) / 1000)
                    for name in LIBRARIES:
                        ok[name] = matchers[name].accept_token(token)
                    if compare:
                        total += 1
                        xor = masks["xgrammar"] ^ masks["llguidance"]
                        differ += bool(xor.any())
                        differing_tokens += _allowed(xor)
                        for name in LIBRARIES:
                            allowed[name] += _allowed(masks[name])
                            rejected[name] += not ok[name]
                    if not all(ok.values()):
                        break

    def library(name: str) -> dict:
        bounded, unbounded = fills["bounded"][name], fills["unbounded"][name]
        return {
            "version": version(name),
            "tables_ms": tables_ms[name],
            "fill": _fill_figures(bounded) if bounded else None,
            "fill_without_maxLength": _fill_figures(unbounded) if unbounded else None,
            "mean_allowed_tokens": allowed[name] / total if total else None,
            "rejected_tokens": rejected[name],
        }

    return {
        "threads": 1,
        "vocab_size": vocab_size,
        "json_options": "each backend's own compile and matcher (reference/grammar_backends.py), "
        f"as the engine runs them: the JSON layout of at most "
        f"{grammar_backends.MAX_JSON_WHITESPACE} whitespace characters wherever JSON allows it",
        "statistic": f"tables and compile: median of {repeats} builds (compile: "
        "`GrammarCompiler.compile`, meta-schema check and schema policy included; xgrammar's cache "
        "cleared before each); fills: every mask of the replay, with the schemas "
        "as run and again without their maxLength bounds",
        "xgrammar": library("xgrammar"),
        "llguidance": library("llguidance"),
        "compile_ms": rows,
        "masks_compared": total,
        "masks_differing": differ,
        "mean_tokens_differing": differing_tokens / total if total else None,
    }
