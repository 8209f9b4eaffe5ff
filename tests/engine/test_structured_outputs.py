"""Structured outputs in the engine: grammar matchers, one per request
(MASK-MATCHER-1, MASK-ADVANCE-1, LOOP-GRAMMAR-1).

Each constrained request's tokens, text, finish reason and logprobs must be
the spec loop's run on it alone with a fresh matcher of the same grammar —
batched with unconstrained requests, preempted and recomputed, aborted
beside, drafted by every drafter (greedy: token for token). The models are
small random ones over the byte tokenizer (token i < 256 is byte i), so the
grammars are over bytes.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from decodespec.reference.engine import Engine
from decodespec.reference.grammar import GrammarCompiler, GrammarError, StructuredOutput
from decodespec.reference.grammar_backends import BACKENDS
from decodespec.reference.request_options import RequestOptions
from decodespec.reference.sampler import GRAMMAR_INVALID
from decodespec.spec.generate import generate
from decodespec.spec.params import SamplingParams
from decodespec.spec.token_mask import allowed_token_mask
from tests.engine.test_engine_vs_spec import (
    ForcedChoice,
    RankSlack,
    assert_logprobs_match,
    draft_model_of,
    request_params,
    small_model,
)
from tests.engine.toy import ByteTokenizer, random_weights, small_config

TOKENIZER = ByteTokenizer()
EOS = TOKENIZER.eos_token_ids[0]
VOCAB = 260

# Grammars over bytes (`complete` says what a whole output of each is).
GRAMMARS = {
    "regex": StructuredOutput("regex", source="[ab]{1,3}(x|yz)", field="t"),
    "choice": StructuredOutput("choice", choices=("yes", "no", "nope"), field="t"),
    "json": StructuredOutput.json_schema(
        {"type": "object", "properties": {"k": {"enum": ["a", "bc"]}}, "required": ["k"]},
        field="t",
    ),
    "grammar": StructuredOutput("grammar", source='root ::= "(" [0-9]* ")"', field="t"),
}
NAMES = tuple(GRAMMARS)
SHARED_PROMPTS = (list(b"Answer in JSON, please: "), list(b"Answer in JSON, please: yes?"))


def complete(name: str, text: str) -> bool:
    """Whether `text` is a whole string of grammar `name`."""
    if name == "regex":
        return re.fullmatch(r"[ab]{1,3}(x|yz)", text) is not None
    if name == "choice":
        return text in ("yes", "no", "nope")
    if name == "grammar":
        return re.fullmatch(r"\([0-9]*\)", text) is not None
    try:
        return json.loads(text)["k"] in ("a", "bc")
    except (ValueError, KeyError, TypeError):
        return False


def allowed(matcher) -> list[int]:
    row = torch.zeros((VOCAB + 31) // 32, dtype=torch.int32)
    matcher.fill_bitmask(row)
    return allowed_token_mask(row[None], VOCAB)[0].nonzero().flatten().tolist()


@pytest.mark.clause("MASK-MATCHER-1")
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_matcher_allows_eos_exactly_when_the_text_is_complete(backend):
    grammars = GrammarCompiler(TOKENIZER, VOCAB, backend)
    matcher = grammars.matcher(StructuredOutput("regex", source="a(b|c)d?", field="t"))
    a, b, c, d = (ord(ch) for ch in "abcd")
    assert allowed(matcher) == [a]
    assert not matcher.accept_token(b) and allowed(matcher) == [a]  # refused: no change
    assert matcher.accept_token(a) and allowed(matcher) == [b, c]
    assert matcher.accept_token(c) and allowed(matcher) == [d, EOS]  # "ac" is complete
    assert matcher.accept_token(EOS) and matcher.is_terminated() and allowed(matcher) == []
    matcher.rollback(2)
    assert not matcher.is_terminated() and allowed(matcher) == [b, c]


@pytest.mark.clause("MASK-MATCHER-1")
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_matcher_with_nothing_left_to_match_takes_the_stop_token_and_rolls_it_back(backend):
    # llguidance stops by itself after "ab" (nothing can follow) and no longer takes
    # tokens; the matcher must still take the stop token once, and undo it.
    matcher = GrammarCompiler(TOKENIZER, VOCAB, backend).matcher(
        StructuredOutput("regex", source="ab", field="t")
    )
    a, b = ord("a"), ord("b")
    assert matcher.accept_token(a) and matcher.accept_token(b) and allowed(matcher) == [EOS]
    assert not matcher.accept_token(a) and allowed(matcher) == [EOS]
    assert matcher.accept_token(EOS) and matcher.is_terminated() and allowed(matcher) == []
    assert not matcher.accept_token(EOS)
    matcher.rollback(1)
    assert not matcher.is_terminated() and allowed(matcher) == [EOS]
    matcher.rollback(2)
    assert allowed(matcher) == [a]
    assert matcher.accept_token(a) and matcher.accept_token(b) and matcher.accept_token(EOS)


# ---------------------------------------------------------------- engine = spec loop


@st.composite
def constrained_workloads(draw: st.DrawFn, sampled: bool = True, max_requests: int = 4):
    """(prompt, params, arrival step, grammar name or None), at least one constrained."""
    requests = []
    for i in range(draw(st.integers(1, max_requests))):
        # Shared prompts, so that later requests map cached blocks (prefix caching).
        prompt = draw(
            st.sampled_from(SHARED_PROMPTS) | st.lists(st.integers(0, 255), min_size=1, max_size=10)
        )
        params = draw(request_params(sampled and draw(st.booleans()), VOCAB))
        name = draw(st.sampled_from((*NAMES, None))) if i else draw(st.sampled_from(NAMES))
        if name is not None:  # a grammar ends with EOS; min_tokens is another test's
            params = SamplingParams(**{**vars(params), "ignore_eos": False, "min_tokens": 0})
        requests.append((prompt, params, draw(st.integers(0, 4)), name))
    return requests


def run(engine: Engine, workload, abort: int | None = None):
    ids, events, step = {}, {}, 0
    while len(ids) < len(workload) or engine.has_unfinished():
        for index, (prompt, params, arrival, name) in enumerate(workload):
            if arrival <= step and index not in ids:
                grammar = GRAMMARS[name] if name else None
                ids[index] = engine.add_request(
                    prompt, params, RequestOptions(structured_output=grammar)
                )
                events[ids[index]] = []
        if abort is not None and step == 2 and abort in ids:
            engine.abort(ids[abort])
        for e in engine.step():
            events[e.request_id].append(e)
        step += 1
        assert step < 500, "the engine stopped making progress"
    return ids, events


def check(engine: Engine, weights, workload, ids, events, skip=()) -> None:
    grammars = GrammarCompiler(TOKENIZER, VOCAB)
    for index, request_id in ids.items():
        if index in skip:
            continue
        name = workload[index][3]
        request = engine.requests[request_id]
        tokens = [e.token_id for e in events[request_id]]
        matcher = grammars.matcher(GRAMMARS[name]) if name else None
        expected = list(
            generate(
                weights,
                request.prompt_ids,
                request.params,
                eos_token_ids=TOKENIZER.eos_token_ids,
                token_bytes=TOKENIZER.token_bytes,
                sample=ForcedChoice(tokens),
                compute_logprobs=(slack := RankSlack()),
                matcher=matcher,
            )
        )
        where = f"request {index} ({name}): {request.params}"
        assert tokens == [s.token_id for s in expected], where
        assert [e.finish_reason for e in events[request_id]] == [
            s.finish_reason for s in expected
        ], where
        slacks = iter(slack.slack)
        for e, s in zip(events[request_id], expected, strict=True):
            step_slack = 0 if s.logprobs is None else next(slacks)
            assert_logprobs_match(e.logprobs, s.logprobs, where, step_slack)
            ids = [[t for t, _ in lp.top] for lp in (e.logprobs, s.logprobs) if lp is not None]
            if len(ids) == 2 and ids[0] == ids[1]:
                # The alternatives the grammar removed (LOOP-GRAMMAR-1).
                assert e.logprobs.removed == s.logprobs.removed, where
                assert bool(e.logprobs.removed) <= (name is not None), where
        out = engine.output(request_id)
        if name and out.finish_reason == "stop" and tokens[-1] == EOS:
            assert complete(name, bytes(tokens[:-1]).decode(errors="replace")), (out.text, where)
    assert engine.cache is None or (
        engine.block_manager.allocator.num_free == engine.block_manager.allocator.num_blocks
    ), "blocks leaked"


@pytest.mark.clause("LOOP-GRAMMAR-1", "MASK-ADVANCE-1", "MASK-SAMPLE-1")
@settings(max_examples=15)
@given(
    workload=constrained_workloads(),
    seed=st.integers(0, 50),
    block_size=st.sampled_from((1, 2, 16)),
    naive=st.booleans(),
)
def test_constrained_requests_in_a_batch_are_each_the_spec_loop(workload, seed, block_size, naive):
    weights = small_model(seed)
    engine = Engine(weights, TOKENIZER, block_size=block_size, naive=naive)
    ids, events = run(engine, workload)
    check(engine, weights, workload, ids, events)
    if not naive:
        cached = sum(engine.output(i).cached_tokens or 0 for i in ids.values())
        event(f"prompt tokens served by the prefix cache > 0: {cached > 0}")


@pytest.mark.clause("LOOP-GRAMMAR-1", "MASK-ADVANCE-1")
@settings(max_examples=10)
@given(workload=constrained_workloads(), seed=st.integers(0, 50), data=st.data())
def test_preempted_constrained_requests_keep_their_grammar_state(workload, seed, data):
    """A cache barely larger than the largest request: preempted requests are
    recomputed and their matchers go on where they were."""
    weights = small_model(seed)
    largest = max(len(p) + (params.max_tokens or 0) - 1 for p, params, _, _ in workload)
    engine = Engine(weights, TOKENIZER, block_size=2, cache_tokens=2 * (-(-largest // 2)) + 2)
    abort = data.draw(st.none() | st.integers(0, len(workload) - 1))
    ids, events = run(engine, workload, abort)
    check(engine, weights, workload, ids, events, skip={abort})


@pytest.mark.clause("MASK-ADVANCE-1", "LOOP-GRAMMAR-1")
@settings(max_examples=10)
@given(
    workload=constrained_workloads(sampled=False),
    seed=st.integers(0, 50),
    speculate=st.sampled_from(("ngram", "layers:1", "model")),
    num_draft=st.integers(1, 4),
)
def test_speculative_constrained_requests_are_the_spec_loop(workload, seed, speculate, num_draft):
    """Greedy: token for token, whatever the drafts (cut where they leave the grammar)."""
    weights = small_model(seed)
    engine = Engine(
        weights,
        TOKENIZER,
        block_size=2,
        speculate=speculate,
        num_draft=num_draft,
        draft_model=draft_model_of(weights) if speculate == "model" else None,
    )
    check(engine, weights, workload, *run(engine, workload))


def grammar_allows(matcher, tokens: list[int]) -> bool:
    """Whether the matcher takes every one of `tokens`; it is left where it was."""
    accepted = 0
    for token in tokens:
        if not matcher.accept_token(token):
            break
        accepted += 1
    matcher.rollback(accepted)
    return accepted == len(tokens)


def mask_after(matcher, tokens: list[int]) -> torch.Tensor:
    """The matcher's mask after `tokens` (which it must take); it is left where it was."""
    for token in tokens:
        assert matcher.accept_token(token), tokens
    row = torch.zeros((VOCAB + 31) // 32, dtype=torch.int32)
    matcher.fill_bitmask(row)
    matcher.rollback(len(tokens))
    return row


@pytest.mark.clause("MASK-ADVANCE-1")
def test_drafts_that_leave_the_grammar_are_cut_before_verification():
    """The n-gram drafter proposes the prompt's continuation ("zzzz…"), which the
    grammar forbids: the runner never sees a draft token the grammar rejects, and the
    matcher ends where the emitted tokens put it."""
    weights = small_model(3)
    engine = Engine(weights, TOKENIZER, speculate="ngram", num_draft=4)
    seen = []
    run_pass = engine.runner.run

    def spy(batch, drafts, show_probs):
        for request, draft in zip(batch, drafts, strict=True):
            assert grammar_allows(request.logits_state.matcher, draft.tokens), draft.tokens
            seen.append(len(draft.tokens))
        return run_pass(batch, drafts, show_probs)

    engine.runner.run = spy
    prompt = list(b"abab zzzz abab zzzz ab")
    grammar = StructuredOutput("regex", source="(ab)+z?", field="t")
    params = SamplingParams(temperature=0, max_tokens=12)
    request_id = engine.add_request(prompt, params, RequestOptions(structured_output=grammar))
    while engine.has_unfinished():
        engine.step()
    text = engine.output(request_id).text
    assert re.fullmatch(r"(ab)*a?b?z?", text), text
    assert any(seen), "the drafter proposed nothing: the test shows nothing"


# ---------------------------------------------------------------- bad input, failures


@pytest.mark.parametrize(
    ("output", "message"),
    [
        (StructuredOutput("json_schema", source='{"type": "objec"}', field="f"), "objec"),
        (StructuredOutput("json_schema", source="{not json", field="f"), "JSON"),
        (
            StructuredOutput("json_schema", source='{"minLength": "x"}', field="f"),
            "not a valid JSON Schema at /minLength",
        ),
        (
            StructuredOutput.json_schema(
                {"properties": {"a": {"type": "array", "uniqueItems": True}}}, field="f"
            ),
            "'uniqueItems' at /properties/a: a grammar cannot enforce it",
        ),
        (
            StructuredOutput.json_schema({"anyOf": [{"not": {"type": "null"}}]}, field="f"),
            "'not' at /anyOf/0: a grammar cannot enforce it",
        ),
        (
            StructuredOutput.json_schema({"$ref": "https://example.com/s.json"}, field="f"),
            "only JSON pointers inside the schema",
        ),
        (StructuredOutput("regex", source="a(b", field="f"), "unclosed group"),
        (StructuredOutput("grammar", source='root ::= ("a"', field="f"), "EBNF"),
        (StructuredOutput("grammar", source='root ::= root "a"', field="f"), "admits no string"),
        (StructuredOutput("regex", source="[^\\x00-\\U0010FFFF]", field="f"), ""),
    ],
)
def test_a_grammar_that_cannot_be_used_is_refused_naming_its_field(output, message):
    engine = Engine(small_model(1), TOKENIZER)
    good = engine.add_request([1, 2], SamplingParams(temperature=0, max_tokens=3))
    with pytest.raises(GrammarError, match=rf"^f: .*{re.escape(message)}") as caught:
        engine.add_request([1, 2], SamplingParams(), RequestOptions(structured_output=output))
    assert caught.value.param == "f"
    while engine.has_unfinished():
        engine.step()
    assert engine.output(good).finish_reason == "length"
    assert list(engine.requests) == [good], "the refused request was queued"


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: StructuredOutput("choice", choices=(), field="f"), "non-empty strings"),
        (lambda: StructuredOutput("choice", choices=("a", ""), field="f"), "non-empty strings"),
        (lambda: StructuredOutput("regex", source=None, field="f"), "must be a string"),
        (lambda: StructuredOutput("regex", source="a" * 70_000, field="f"), "at most"),
        (lambda: StructuredOutput("lark", source="x", field="f"), "unknown kind"),
    ],
)
def test_a_malformed_structured_output_is_refused_naming_its_field(make, message):
    with pytest.raises(GrammarError, match=message) as caught:
        make()
    assert caught.value.param == "f"


def test_ignore_eos_with_a_grammar_is_refused():
    engine = Engine(small_model(1), TOKENIZER)
    with pytest.raises(GrammarError, match="ignore_eos") as caught:
        engine.add_request(
            [1],
            SamplingParams(ignore_eos=True),
            RequestOptions(structured_output=GRAMMARS["choice"]),
        )
    assert caught.value.param == "ignore_eos"


@pytest.mark.clause("MASK-MINTOK-1", "MASK-EMPTY-1")
def test_min_tokens_past_a_complete_grammar_fails_that_request_alone():
    weights = small_model(2)
    engine = Engine(weights, TOKENIZER)
    choice = StructuredOutput("choice", choices=("no",), field="t")
    doomed = engine.add_request(
        [5, 6],
        SamplingParams(temperature=0, min_tokens=4, max_tokens=8),
        RequestOptions(structured_output=choice),
    )
    other = engine.add_request([5, 6], SamplingParams(temperature=0, max_tokens=6))
    while engine.has_unfinished():
        engine.step()
    out = engine.output(doomed)
    assert out.finish_reason == "error" and GRAMMAR_INVALID in out.error, out
    assert out.token_ids == list(b"no")
    assert engine.output(other).finish_reason == "length"


@pytest.mark.clause("MASK-ADVANCE-1")
def test_a_grammar_cut_short_by_max_tokens_ends_with_length_and_the_partial_text():
    engine = Engine(small_model(4), TOKENIZER)
    grammar = StructuredOutput("regex", source="abcdefgh", field="t")
    request_id = engine.add_request(
        [1], SamplingParams(temperature=0, max_tokens=3), RequestOptions(structured_output=grammar)
    )
    while engine.has_unfinished():
        engine.step()
    out = engine.output(request_id)
    assert (out.finish_reason, out.text) == ("length", "abc")


@pytest.mark.clause("MASK-ADVANCE-1")
@pytest.mark.parametrize("drafter", ["model", "layers:1"])
def test_a_model_drafter_draws_its_drafts_from_masked_distributions(drafter):
    """Cutting is exact only for deterministic drafts; a model drafter's draft
    distributions must give the tokens the grammar forbids probability 0, so that its
    drafts never leave the grammar (sampled, so the drafts vary)."""
    weights = small_model(5)
    engine = Engine(
        weights,
        TOKENIZER,
        speculate=drafter,
        num_draft=3,
        draft_model=draft_model_of(weights) if drafter == "model" else None,
    )
    checked = []
    run_pass = engine.runner.run

    def spy(batch, drafts, show_probs):
        for request, draft in zip(batch, drafts, strict=True):
            for j in range(len(draft.tokens)):
                row = mask_after(request.logits_state.matcher, draft.tokens[:j])
                forbidden = ~allowed_token_mask(row[None], VOCAB)[0]
                assert float(draft.probs[j][forbidden].sum()) == 0.0, (j, draft.tokens)
                checked.append(j)
        return run_pass(batch, drafts, show_probs)

    engine.runner.run = spy
    for seed in range(4):
        engine.add_request(
            [1, 2, 3],
            SamplingParams(temperature=1.0, seed=seed, max_tokens=10),
            RequestOptions(structured_output=GRAMMARS["regex"]),
        )
    while engine.has_unfinished():
        engine.step()
    assert checked, "the drafter proposed nothing: the test shows nothing"


@pytest.mark.clause("LOOP-PREFIX-1", "LOOP-GRAMMAR-1")
def test_a_constrained_request_on_a_cached_prefix_is_the_spec_loop():
    """The second request maps the first one's prompt blocks and still writes what the
    spec loop writes under its grammar."""
    weights = small_model(6)
    engine = Engine(weights, TOKENIZER, block_size=4)
    prompt = list(b"Answer in JSON, please: ")
    params = SamplingParams(temperature=0.8, seed=11, max_tokens=20)
    workload = [(prompt, params, 0, "json"), (prompt, params, 30, "json")]
    ids, events = run(engine, workload)
    # All but the last prompt token, which always runs: whole blocks, and the positions
    # before it in the last one, copied from the first request's.
    assert engine.output(ids[1]).cached_tokens == len(prompt) - 1
    check(engine, weights, workload, ids, events)
    assert [e.token_id for e in events[ids[0]]] == [e.token_id for e in events[ids[1]]]


@pytest.mark.clause("LOOP-GRAMMAR-1", "MASK-SAMPLE-1")
@settings(max_examples=3)
@given(workload=constrained_workloads(max_requests=3), seed=st.integers(0, 50))
def test_the_triton_backend_under_grammars_is_the_spec_loop(workload, seed):
    """The kernels' fused mask (the Triton interpreter without a GPU)."""
    pytest.importorskip("triton")
    weights = random_weights(
        small_config(max_context=64, vocab_size=VOCAB, hidden_size=16, num_layers=1), seed=seed
    )
    engine = Engine(weights, TOKENIZER, backend="triton", block_size=4, cache_tokens=256)
    check(engine, weights, workload, *run(engine, workload))


@pytest.mark.clause("MASK-KEYS-1")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "output",
    [
        StructuredOutput("json_object", field="t"),
        StructuredOutput.json_schema({"type": "object", "additionalProperties": True}, field="t"),
    ],
)
def test_json_matchers_never_repeat_a_key(backend, output):
    matcher = GrammarCompiler(TOKENIZER, VOCAB, backend).matcher(output)
    for byte in b'{"a": 1, "a':
        assert matcher.accept_token(byte)
    assert ord('"') not in allowed(matcher)  # "a" again: refused
    assert not matcher.accept_token(ord('"'))
    assert matcher.accept_token(ord("b")) and ord('"') in allowed(matcher)  # "ab" is new
