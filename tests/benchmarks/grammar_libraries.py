"""xgrammar and llguidance side by side, for `make bench-structured`: the constrained
answers' tokens replayed through both on one thread, timing the vocabulary tables,
each schema's compile and every mask fill (tests/benchmarks/structured.py says why)."""

from __future__ import annotations

import json
import statistics
import time
from importlib.metadata import version

import torch

from decodespec.reference.grammar import JSON_FORMAT
from decodespec.spec.token_mask import bitmask_words
from tests.benchmarks.structured_tasks import TASKS


class _LLGuidanceVocabulary:
    """What `llguidance.TokenizerWrapper` reads: the token bytes, EOS, BOS, specials,
    and encoding (used by llguidance only for grammar literals it tokenizes)."""

    def __init__(self, tokenizer: object, tokens: list[bytes]) -> None:
        self._tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_ids[0]
        self.bos_token_id = tokenizer.bos_token_id
        self.tokens = tokens
        self.special_token_ids = sorted(tokenizer.special_token_ids)

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text, add_special_tokens=False)


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
    """How many tokens a `[1, words]` mask allows."""
    return sum(bin(word & 0xFFFFFFFF).count("1") for word in bitmask[0].tolist())


def compare_matchers(
    tokenizer: object, vocab_size: int, sequences: dict[str, list[list[int]]], repeats: int
) -> dict:
    """xgrammar and llguidance on one thread: tables, compile per schema, and each mask
    fill while replaying the constrained answers' tokens through both in lockstep."""
    import llguidance
    import llguidance.torch
    import xgrammar

    special = tokenizer.special_token_ids
    raw = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
    xg_vocab = [b"" if i in special else raw[i] for i in range(len(raw))]
    stops = list(tokenizer.eos_token_ids)

    def xg_tables():
        info = xgrammar.TokenizerInfo(
            xg_vocab, xgrammar.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stops
        )
        return xgrammar.GrammarCompiler(info, max_threads=1)

    def ll_tables():
        wrapper = llguidance.TokenizerWrapper(_LLGuidanceVocabulary(tokenizer, raw))
        return llguidance.LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=stops)

    xg_tables_ms, compiler = _median_ms(xg_tables, repeats)
    ll_tables_ms, ll_tokenizer = _median_ms(ll_tables, repeats)
    words = bitmask_words(vocab_size)
    xg_mask = torch.zeros(1, words, dtype=torch.int32)
    ll_mask = torch.zeros(1, words, dtype=torch.int32)
    fills: dict[str, dict[str, list[float]]] = {
        variant: {"xgrammar": [], "llguidance": []} for variant in ("bounded", "unbounded")
    }
    rows, total, differ, differing_tokens = {}, 0, 0, 0
    allowed = {"xgrammar": 0, "llguidance": 0}
    rejected = {"xgrammar": 0, "llguidance": 0}

    def xg_compile(source: str):
        compiler.clear_cache()
        return compiler.compile_json_schema(source, **JSON_FORMAT)  # as the engine compiles

    def ll_compile(source: str):
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            # Any whitespace between tokens, as the engine's xgrammar grammars allow.
            source,
            overrides={"whitespace_flexible": True},
        )
        matcher = llguidance.LLMatcher(ll_tokenizer, grammar)
        if matcher.is_error():
            raise RuntimeError(f"llguidance: {matcher.get_error()}")
        return grammar

    for task in TASKS:
        if task.name not in sequences:
            continue
        rows[task.name] = {}
        # The schema as the engine ran it, then without its maxLength bounds (which only
        # loosens it: the same tokens are accepted).
        for variant, schema in (
            ("bounded", task.schema),
            ("unbounded", without_max_length(task.schema)),
        ):
            source = json.dumps(schema)
            xg_ms, compiled = _median_ms(lambda source=source: xg_compile(source), repeats)
            ll_ms, grammar = _median_ms(lambda source=source: ll_compile(source), repeats)
            suffix = "" if variant == "bounded" else "_without_maxLength"
            rows[task.name][f"xgrammar_compile_ms{suffix}"] = xg_ms
            rows[task.name][f"llguidance_compile_ms{suffix}"] = ll_ms
            us = fills[variant]
            compare = variant == "bounded"
            for tokens in sequences[task.name]:
                xg = xgrammar.GrammarMatcher(compiled)
                ll = llguidance.LLMatcher(ll_tokenizer, grammar)
                for token in tokens:
                    start = time.perf_counter_ns()
                    xg.fill_next_token_bitmask(xg_mask, 0)
                    middle = time.perf_counter_ns()
                    llguidance.torch.fill_next_token_bitmask(ll, ll_mask, 0)
                    end = time.perf_counter_ns()
                    us["xgrammar"].append((middle - start) / 1000)
                    us["llguidance"].append((end - middle) / 1000)
                    ok_xg, ok_ll = xg.accept_token(token), ll.consume_token(token)
                    if compare:
                        total += 1
                        differ += not torch.equal(xg_mask, ll_mask)
                        differing_tokens += _allowed(xg_mask ^ ll_mask)
                        allowed["xgrammar"] += _allowed(xg_mask)
                        allowed["llguidance"] += _allowed(ll_mask)
                        rejected["xgrammar"] += not ok_xg
                        rejected["llguidance"] += not ok_ll
                    if not (ok_xg and ok_ll):
                        break

    def library(name: str, tables_ms: float) -> dict:
        bounded, unbounded = fills["bounded"][name], fills["unbounded"][name]
        return {
            "version": version(name),
            "tables_ms": tables_ms,
            "fill": _fill_figures(bounded) if bounded else None,
            "fill_without_maxLength": _fill_figures(unbounded) if unbounded else None,
            "mean_allowed_tokens": allowed[name] / total if total else None,
            "rejected_tokens": rejected[name],
        }

    return {
        "threads": 1,
        "vocab_size": vocab_size,
        "json_options": f"xgrammar {JSON_FORMAT} (the engine's); llguidance "
        "whitespace_flexible=True",
        "statistic": f"tables and compile: median of {repeats} builds (xgrammar's cache "
        "cleared before each compile); fills: every mask of the replay, with the schemas "
        "as run and again without their maxLength bounds",
        "xgrammar": library("xgrammar", xg_tables_ms),
        "llguidance": library("llguidance", ll_tables_ms),
        "compile_ms": rows,
        "masks_compared": total,
        "masks_differing": differ,
        "mean_tokens_differing": differing_tokens / total if total else None,
    }
