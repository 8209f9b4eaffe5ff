"""Speculative decoding in the engine: the same tokens, the same distribution, a clean cache.

Every drafter (prompt lookup, the target's first layers, a second random model)
is checked against plain decoding of the same engine:

- greedy speculation emits exactly plain greedy's tokens (random models of
  several shapes and block sizes, several requests at once, and the bundled
  model);
- sampled speculation emits its first tokens with the target's own
  distribution, computed exactly by enumeration (chi-square at a fixed seed);
- after rejected drafts the cache holds what a fresh run of the emitted
  sequence would, and no block leaks;
- a stop inside an accepted run cuts it.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch
from scipy import stats

from decodespec.reference.cache import PagedKVCache
from decodespec.reference.engine import Engine
from decodespec.reference.grammar import StructuredOutput
from decodespec.reference.request import MAX_DRAFT_PAUSE, Draft, Request
from decodespec.reference.request_options import RequestOptions
from decodespec.spec.forward import forward_naive
from decodespec.spec.params import SamplingParams, sampling_tensors
from decodespec.spec.sampling import process_logits
from decodespec.spec.softmax import softmax
from tests.engine.toy import ByteTokenizer, random_weights, small_config

# The whole suite's false-positive rate for the distribution tests, split
# evenly over its chi-square tests (Bonferroni).
FALSE_POSITIVE_RATE = 1e-3


def drain(engine: Engine) -> None:
    while engine.has_unfinished():
        engine.step()


def plain_run(weights, tokenizer, prompt: list[int], params: SamplingParams):
    """The request's output from an engine without speculation (what speculation must match)."""
    engine = Engine(weights, tokenizer)
    request_id = engine.add_request(prompt, params)
    drain(engine)
    return engine.output(request_id)


def check_blocks(engine: Engine) -> None:
    """Every block is free or owned by exactly one running request, and no more than
    its emitted sequence needs."""
    assert engine.cache is not None
    owned = [b for r in engine.scheduler.running for b in r.blocks]
    assert len(owned) == len(set(owned))
    allocator = engine.block_manager.allocator
    assert allocator.num_free + len(owned) == allocator.num_blocks
    for r in engine.scheduler.running:
        length = len(r.prompt_ids) + len(r.output_ids)
        assert len(r.blocks) <= engine.block_manager.blocks_for(length)


def draft_model(config, seed: int = 7):
    """A smaller random model with the target's vocabulary."""
    small = small_config(
        vocab_size=config.vocab_size,
        hidden_size=16,
        intermediate_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        max_context=config.max_context,
    )
    return random_weights(small, seed=seed)


def make_engine(weights, tokenizer, drafter: str | None, **kwargs) -> Engine:
    if drafter == "model":
        kwargs["draft_model"] = draft_model(weights.config)
    return Engine(weights, tokenizer, speculate=drafter, **kwargs)


DRAFTERS = ["ngram", "layers:1", "layers:all", "model"]


def drafter_name(drafter: str, weights) -> str:
    return f"layers:{weights.config.num_layers}" if drafter == "layers:all" else drafter


# ---------------------------------------------------------------- greedy


CONFIGS = {
    "gqa": dict(num_layers=3),
    "mha-tied": dict(num_heads=4, num_kv_heads=4, tie_word_embeddings=True),
    "bias": dict(attention_bias=True),
}
PROMPTS = [list(b"abcabcabcabc hello hello"), list(b"xyz"), list(b"the cat the cat the")]


@pytest.mark.clause("VERIFY-GREEDY-1")
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("config", CONFIGS, ids=list(CONFIGS))
@pytest.mark.parametrize("drafter", DRAFTERS)
def test_greedy_speculation_gives_plain_greedy_tokens(drafter, config, block_size):
    weights = random_weights(small_config(**CONFIGS[config]), seed=3)
    tokenizer = ByteTokenizer()

    def run(speculate: str | None, num_draft: int = 4) -> list[list[int]]:
        engine = make_engine(
            weights, tokenizer, speculate, num_draft=num_draft, block_size=block_size
        )
        ids = [
            engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
            for prompt, n in zip(PROMPTS, [30, 17, 24], strict=True)
        ]
        while engine.has_unfinished():
            engine.step()
            check_blocks(engine)
        assert engine.block_manager.allocator.num_free == engine.block_manager.allocator.num_blocks
        return [engine.output(i).token_ids for i in ids]

    plain = run(None)
    assert run(drafter_name(drafter, weights)) == plain
    assert run(drafter_name(drafter, weights), num_draft=1) == plain


def test_full_depth_self_speculation_accepts_every_draft():
    """layers:N with N = all layers is the target itself: every greedy draft passes."""
    weights = random_weights(small_config(num_layers=2), seed=4)
    engine = Engine(weights, ByteTokenizer(), speculate="layers:2", num_draft=3)
    request = engine.add_request(
        list(b"hello"), SamplingParams(temperature=0, max_tokens=17, ignore_eos=True)
    )
    drain(engine)
    out = engine.output(request)
    assert out.completion_tokens == 17
    assert out.acceptance_rate == 1.0
    # 17 tokens in passes of 4 (three drafts and the bonus), the last pass cut to fit.
    assert out.tokens_per_target_pass == 17 / 5
    assert out.draft_tokens == out.accepted_tokens == 12


@pytest.mark.parametrize(("num_draft", "passes"), [(0, 17), (1, 9), (2, 6), (3, 5)])
def test_a_request_caps_its_own_drafts(num_draft, passes):
    """`add_request(num_draft=k)`: at most k drafts a step for that request (0: none),
    below the engine's K; the tokens are the same (greedy)."""
    weights = random_weights(small_config(num_layers=2), seed=4)
    engine = Engine(weights, ByteTokenizer(), speculate="layers:2", num_draft=3)
    params = SamplingParams(temperature=0, max_tokens=17, ignore_eos=True)
    request = engine.add_request(list(b"hello"), params, RequestOptions(num_draft=num_draft))
    drain(engine)
    out = engine.output(request)
    assert out.token_ids == plain_run(weights, ByteTokenizer(), list(b"hello"), params).token_ids
    assert out.completion_tokens / out.tokens_per_target_pass == passes
    assert out.draft_tokens == 17 - passes
    with pytest.raises(ValueError, match=r"num_draft must be in \[0, 3\]"):
        engine.add_request([1], params, RequestOptions(num_draft=4))
    plain = Engine(weights, ByteTokenizer())
    with pytest.raises(ValueError, match="no drafter"):
        plain.add_request([1], params, RequestOptions(num_draft=1))


def test_drafts_wait_for_room_in_the_cache():
    """No free block for A's drafts while B holds its blocks: A decodes plainly that
    step, drafts once B is gone, and both finish with plain greedy's tokens."""
    weights = random_weights(small_config(num_layers=2), seed=5)
    tokenizer = ByteTokenizer()
    requests = [
        (list(b"abc"), SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)),  # 4 blocks
        (list(b"xyz"), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)),  # 2 blocks
    ]

    def run(speculate: str | None) -> tuple[list, list[int]]:
        engine = Engine(
            weights, tokenizer, speculate=speculate, num_draft=4, block_size=2, cache_tokens=10
        )
        ids = [engine.add_request(prompt, params) for prompt, params in requests]
        drafted = []
        while engine.has_unfinished():
            engine.step()
            check_blocks(engine)
            drafted.append(engine.requests[ids[0]].drafted)
        assert engine.block_manager.allocator.num_free == engine.block_manager.allocator.num_blocks
        return [(engine.output(i).token_ids, engine.output(i).finish_reason) for i in ids], drafted

    plain, _ = run(None)
    speculative, drafted = run("layers:2")
    assert speculative == plain
    assert drafted[0] == 0 < drafted[-1]  # no room at the first step, drafts after


def test_failing_drafts_pause_drafting_with_doubling_pauses():
    """A drafter that is always wrong: after each fruitless pass the request drafts
    again only after 1, 2, 4, ... (at most MAX_DRAFT_PAUSE) plain steps; the tokens
    stay plain greedy's. A drafter that is right again halves the pause."""
    weights = random_weights(small_config(), seed=13)
    tokenizer = ByteTokenizer()
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    expected = plain_run(weights, tokenizer, list(b"go"), params).token_ids

    class Scripted:
        """Drafts one token: the right one while `right`, else a wrong one."""

        right = False

        def propose(self, requests, counts):
            drafts = []
            for r, count in zip(requests, counts, strict=True):
                token = expected[len(r.output_ids)]
                drafts.append(Draft([token if self.right else (token + 1) % 256][:count]))
            return drafts

    engine = Engine(weights, tokenizer, speculate="ngram")
    engine.drafter = Scripted()
    request_id = engine.add_request(list(b"go"), params)
    request = engine.requests[request_id]
    drafted_at = []
    for step in range(40):
        before = request.drafted
        engine.step()
        if request.drafted > before:
            drafted_at.append(step)
    # Passes at steps 0, 2, 5, 10, 19, 36: pauses of 1, 2, 4, 8, 16 steps between them.
    assert drafted_at == [0, 2, 5, 10, 19, 36]
    assert request.draft_pause == MAX_DRAFT_PAUSE - 3
    engine.drafter.right = True
    request.draft_pause = 0
    drain(engine)
    assert request.draft_backoff < MAX_DRAFT_PAUSE  # accepted drafts shrink the pause
    assert engine.output(request_id).token_ids == expected


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 7])
def test_max_tokens_is_exact_with_drafts(max_tokens):
    weights = random_weights(small_config(), seed=6)
    engine = Engine(weights, ByteTokenizer(), speculate="layers:2", num_draft=4)
    request = engine.add_request(
        list(b"hi"), SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    )
    drain(engine)
    out = engine.output(request)
    assert (out.completion_tokens, out.finish_reason) == (max_tokens, "length")


@pytest.mark.clause("STOP-ID-1", "STOP-STR-1")
@pytest.mark.parametrize("kind", ["token", "string"])
def test_stop_inside_an_accepted_run_cuts_it(kind):
    weights = random_weights(small_config(), seed=8)
    tokenizer = ByteTokenizer()
    free = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = plain_run(weights, tokenizer, list(b"ok"), free)
    tokens, text = plain.token_ids, plain.text
    # Stop around the 6th token: inside the second run of a full-depth drafter (4 per pass).
    if kind == "token":
        params = SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[tokens[5]])
    else:
        assert len(text) >= 6, "precondition: the plain run's text is long enough"
        params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[text[4:6]])
    outputs = []
    for speculate in (None, "layers:2"):
        engine = Engine(weights, tokenizer, speculate=speculate, num_draft=3)
        request = engine.add_request(list(b"ok"), params)
        events = []
        while engine.has_unfinished():
            events += engine.step()
        out = engine.output(request)
        assert engine.block_manager.allocator.num_free == engine.block_manager.allocator.num_blocks
        assert events[-1].finish_reason == "stop"
        outputs.append(
            (out.token_ids, out.text, out.finish_reason, "".join(e.text for e in events))
        )
    assert outputs[0] == outputs[1]
    assert len(outputs[0][0]) < len(tokens)


# ---------------------------------------------------------------- rollback


def cached_kv(engine: Engine, request: Request, positions: int) -> list[torch.Tensor]:
    """K and V of the request's first `positions` positions, every layer."""
    size = engine.cache.block_size
    slots = engine.cache.slots(request.blocks, 0, positions)
    blocks, offsets = [s // size for s in slots], [s % size for s in slots]
    return [cache[blocks, offsets] for layer in engine.cache.layers for cache in layer]


@pytest.mark.parametrize("drafter", ["model", "layers:1", "ngram"])
def test_rollback_leaves_the_cache_of_a_fresh_run(drafter):
    """After rejected drafts, the cache equals a fresh prefill of the emitted sequence
    at every cached position, and the request holds only the blocks those need."""
    weights = random_weights(small_config(num_layers=2), seed=9)
    tokenizer = ByteTokenizer()
    engine = make_engine(weights, tokenizer, drafter, num_draft=5, block_size=3)
    request_id = engine.add_request(
        list(b"abcab abcab abc"), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    )
    request = engine.requests[request_id]
    rejected = 0
    for _ in range(6):
        drafted, accepted = request.drafted, request.accepted
        engine.step()
        rejected += (request.drafted - drafted) - (request.accepted - accepted)
    assert request.finish_reason is None
    assert rejected > 0, "precondition: some drafts were rejected"
    sequence = request.prompt_ids + request.output_ids
    assert request.num_cached == len(sequence) - 1
    assert len(request.blocks) == engine.block_manager.blocks_for(len(sequence))
    check_blocks(engine)

    fresh = Engine(weights, tokenizer, block_size=3)
    fresh_id = fresh.add_request(sequence[:-1], SamplingParams(temperature=0, max_tokens=2))
    fresh.step()  # the prefill of positions 0 .. len − 2 (the request runs on: blocks kept)
    reference = cached_kv(fresh, fresh.requests[fresh_id], request.num_cached)
    for ours, theirs in zip(cached_kv(engine, request, request.num_cached), reference, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)

    # Decoding on from here agrees with a fresh run of the emitted sequence.
    remaining = 40 - len(request.output_ids)
    drain(engine)
    params = SamplingParams(temperature=0, max_tokens=remaining, ignore_eos=True)
    emitted_after = engine.output(request_id).token_ids[len(sequence) - len(request.prompt_ids) :]
    assert plain_run(weights, tokenizer, sequence, params).token_ids == emitted_after


def test_second_model_drafter_rolls_its_own_cache_back():
    """The draft model's cache is cut with the target's: it never runs ahead of what
    the target kept, so its drafts equal those of a fresh drafter at every step."""
    weights = random_weights(small_config(), seed=10)
    engine = make_engine(weights, ByteTokenizer(), "model", num_draft=4)
    request_id = engine.add_request(
        list(b"draft"), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    )
    request = engine.requests[request_id]
    while engine.has_unfinished():
        engine.step()
        if request.finish_reason is None:
            assert request.draft_cached <= request.num_cached


# ---------------------------------------------------------------- distribution


class LetterTokenizer:
    """Token i is the letter chr(97 + i); no EOS the tests rely on."""

    eos_token_ids = (0,)
    chat_template = None
    vocab_size = 10
    special_token_ids = frozenset()

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([97 + token_id])


VOCAB = 10
GENERATED = 3
DRAWS = 2000
SETTINGS = {
    "sampled": SamplingParams(temperature=1.0, max_tokens=GENERATED, ignore_eos=True),
    "filtered": SamplingParams(
        temperature=1.3,
        top_k=7,
        top_p=0.95,
        min_p=0.02,
        presence_penalty=0.7,
        max_tokens=GENERATED,
        ignore_eos=True,
    ),
}
DISTRIBUTION_PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]  # prompt lookup drafts 3, 1, 2


def exact_distributions(
    weights, params: SamplingParams, token_bitmask: torch.Tensor | None = None
) -> dict[tuple[int, ...], torch.Tensor]:
    """p(next | prompt + prefix) for every prefix shorter than GENERATED, by enumeration
    over naive forwards and the spec's processors (the target's own distribution),
    under a grammar's mask that is the same at every step, if given."""
    result = {}
    for length in range(GENERATED):
        for prefix in itertools.product(range(VOCAB), repeat=length):
            logits = forward_naive(
                weights, torch.tensor(DISTRIBUTION_PROMPT + list(prefix)), last_only=True
            )
            tensors = sampling_tensors(
                [dataclasses.replace(params, seed=0)],
                vocab_size=VOCAB,
                prompt_token_ids=[DISTRIBUTION_PROMPT],
                output_token_ids=[list(prefix)],
                token_bitmask=token_bitmask,
            )
            processed = process_logits(logits.double(), **tensors.process_logits_args)
            result[prefix] = softmax(processed)[0]
    return result


def chi_square_p_value(observed: list[int], expected: list[float]) -> float:
    """Pearson's test over the cells the target can produce (the caller checks the
    others are empty), those with expected count < 5 pooled into one."""
    big = [i for i, e in enumerate(expected) if e >= 5]
    small = [i for i, e in enumerate(expected) if 0 < e < 5]
    obs = [observed[i] for i in big]
    exp = [expected[i] for i in big]
    if small:
        obs.append(sum(observed[i] for i in small))
        exp.append(sum(expected[i] for i in small))
    scale = sum(obs) / sum(exp)
    return float(stats.chisquare(obs, [e * scale for e in exp]).pvalue)


TESTS_PER_RUN = GENERATED + 1  # each position's marginal, and the first two jointly
GRAMMAR_DRAFTERS = ("ngram", "model")
NUM_RUNS = 3 * len(SETTINGS) + len(GRAMMAR_DRAFTERS)


@pytest.mark.clause("VERIFY-ACCEPT-1", "VERIFY-RESIDUAL-1", "VERIFY-BONUS-1")
@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("drafter", ["ngram", "layers:1", "model"])
def test_speculation_preserves_the_distribution_of_the_first_tokens(drafter, setting):
    """DRAWS requests with seeds 0 .. DRAWS − 1: each position's tokens, and the first
    two together, follow the target's exact distribution (chi-square; the suite's
    false-positive rate is FALSE_POSITIVE_RATE over all its tests)."""
    check_speculative_distribution(drafter, SETTINGS[setting], setting)


# Letters c to f (tokens 2 to 5), four of them: EOS is never allowed within the
# GENERATED tokens, and prompt lookup's drafts "d b c" (3, 1, 2) are cut after "d".
GRAMMAR = StructuredOutput("regex", source="[c-f]{4}", field="test")
GRAMMAR_BITMASK = torch.tensor([[0b111100]], dtype=torch.int32)


@pytest.mark.clause("MASK-ADVANCE-1", "VERIFY-ACCEPT-1", "VERIFY-RESIDUAL-1")
@pytest.mark.parametrize("drafter", GRAMMAR_DRAFTERS)
def test_speculation_under_a_grammar_preserves_the_masked_distribution(drafter):
    """Under a grammar the target is the masked distribution, top-k after the mask:
    drafts cut where they leave the grammar (prompt lookup) or drawn from masked
    distributions (a second model) keep the output distribution exact."""
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=GENERATED)
    check_speculative_distribution(drafter, params, "grammar", GRAMMAR, GRAMMAR_BITMASK)


def check_speculative_distribution(drafter, params, setting, grammar=None, bitmask=None):
    config = small_config(vocab_size=VOCAB, num_layers=2, max_context=32)
    weights = random_weights(config, seed=11)
    engine = make_engine(
        weights, LetterTokenizer(), drafter, num_draft=4, block_size=4, cache_tokens=DRAWS * 16
    )
    ids = [
        engine.add_request(
            DISTRIBUTION_PROMPT,
            SamplingParams(**{**vars(params), "seed": seed}),
            RequestOptions(structured_output=grammar),
        )
        for seed in range(DRAWS)
    ]
    drain(engine)
    outputs = [engine.output(i) for i in ids]
    samples = [tuple(out.token_ids) for out in outputs]
    assert all(len(s) == GENERATED for s in samples)
    drafted = sum(out.draft_tokens for out in outputs)
    accepted = sum(out.accepted_tokens for out in outputs)
    # Under the grammar, prompt lookup's drafts are often cut to nothing.
    assert drafted > (DRAWS if grammar is None else DRAWS // 4), "precondition: drafts"
    assert 0 < accepted < drafted, "precondition: drafts were both accepted and rejected"

    p = exact_distributions(weights, params, bitmask)
    joint = {
        seq: math.prod(float(p[seq[:i]][seq[i]]) for i in range(GENERATED))
        for seq in itertools.product(range(VOCAB), repeat=GENERATED)
    }
    support = {seq for seq, prob in joint.items() if prob > 0}
    outside = [s for s in samples if s not in support]
    assert not outside, f"sequences the target cannot produce: {outside[:5]}"

    alpha = FALSE_POSITIVE_RATE / (NUM_RUNS * TESTS_PER_RUN)
    cells = [[(i, t) for t in range(VOCAB)] for i in range(GENERATED)]
    cells.append([("pair", a, b) for a in range(VOCAB) for b in range(VOCAB)])

    def key(seq: tuple[int, ...], cell: tuple) -> bool:
        if cell[0] == "pair":
            return seq[:2] == cell[1:]
        return seq[cell[0]] == cell[1]

    for group in cells:
        expected = [DRAWS * sum(q for seq, q in joint.items() if key(seq, c)) for c in group]
        observed = [sum(key(s, c) for s in samples) for c in group]
        p_value = chi_square_p_value(observed, expected)
        assert p_value > alpha, (
            f"{drafter}, {setting}, cells {group[0]}..: p = {p_value:.2e} <= {alpha:.1e}\n"
            f"observed {observed}\nexpected {[round(e, 1) for e in expected]}"
        )


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(speculate="ngram", naive=True), "needs the KV cache"),
        (dict(speculate="medusa"), "unknown speculate 'medusa'"),
        (dict(speculate="layers:0"), "1 <= N <= 2"),
        (dict(speculate="layers:3"), "1 <= N <= 2"),
        (dict(speculate="layers:x"), "must be an integer"),
        (dict(speculate="model"), "needs draft_model"),
        (dict(speculate="ngram", num_draft=0), "num_draft must be >= 1"),
        (dict(draft_model="unused"), "only used with speculate='model'"),
    ],
)
def test_bad_speculation_settings_are_refused(kwargs, message):
    weights = random_weights(small_config(num_layers=2), seed=0)
    with pytest.raises(ValueError, match=message):
        Engine(weights, ByteTokenizer(), **kwargs)


def test_draft_model_must_share_the_vocabulary():
    weights = random_weights(small_config(), seed=0)
    other = random_weights(small_config(vocab_size=100), seed=1)
    with pytest.raises(ValueError, match="vocabulary has 100 tokens, the target's 260"):
        Engine(weights, ByteTokenizer(), speculate="model", draft_model=other)


def test_paged_batch_packs_drafts_after_the_new_tokens():
    cache = PagedKVCache(small_config(), num_blocks=8, block_size=2, dtype=torch.float32)
    token_ids, batch = cache.paged_batch([[5, 1], [2]], [3, 0], [[9], [7, 8]], [1, 2], "cpu")
    assert token_ids.tolist() == [9, 7, 8]
    assert batch.positions.tolist() == [3, 0, 1]
    assert batch.slot_mapping.tolist() == [3, 4, 5]
    assert batch.seq_lens.tolist() == [4, 2]
    assert batch.query_start.tolist() == [0, 1, 3]
    assert batch.block_table.tolist() == [[5, 1], [2, 0]]
    assert batch.logits_indices.tolist() == [0, 1, 2]


# ---------------------------------------------------------------- the Triton backend


@pytest.mark.parametrize("drafter", ["ngram", "layers:1"])
def test_triton_backend_speculates_with_the_spec_backends_tokens(drafter, monkeypatch):
    """Drafts verified by `decodespec.kernels.verify_drafts` (in the interpreter without a GPU):
    the spec backend's tokens, greedy and seeded."""
    from decodespec import kernels
    from decodespec.reference import engine as engine_module

    weights = random_weights(small_config(num_layers=2), seed=12)
    tokenizer = ByteTokenizer()
    requests = [
        (list(b"abab abab ab"), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)),
        (list(b"cdcd cd"), SamplingParams(temperature=0.9, seed=3, max_tokens=6, ignore_eos=True)),
    ]

    def run(backend: str) -> list[list[int]]:
        engine = Engine(weights, tokenizer, backend=backend, speculate=drafter, num_draft=3)
        ids = [engine.add_request(prompt, params) for prompt, params in requests]
        drain(engine)
        return [engine.output(i).token_ids for i in ids]

    spec_tokens = run("spec")
    assert "verify_drafts" in engine_module.get_backend("triton").kernel_ops
    calls = []
    real = kernels.verify_drafts

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(kernels, "verify_drafts", counted)
    assert run("triton") == spec_tokens
    assert calls, "the kernel verified the drafts"


def test_a_pass_processes_its_logits_once():
    """Verification of sampled drafts, processed logprobs and the candidates all read
    the processed logits (steps 1-8): one `process_logits` call per pass serves them."""
    weights = random_weights(small_config(), seed=4)
    engine = Engine(weights, ByteTokenizer(), speculate="ngram", num_draft=3, show_probs=3)
    backend = engine.backend
    calls: list[int] = []

    def counting(logits, **tensors):
        calls.append(len(logits))
        return backend.process_logits(logits, **tensors)

    engine.sampler.backend = dataclasses.replace(backend, process_logits=counting)
    params = SamplingParams(
        temperature=0.8, seed=3, max_tokens=12, top_logprobs=2, logprobs_mode="processed"
    )
    request_id = engine.add_request([1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2], params)
    per_pass = []
    while engine.has_unfinished():
        before = len(calls)
        engine.step()
        per_pass.append(len(calls) - before)
    assert engine.requests[request_id].drafted > 0, "precondition: the drafter proposed tokens"
    assert per_pass == [1] * len(per_pass)
