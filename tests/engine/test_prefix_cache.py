"""Prefix caching (LOOP-PREFIX-1): requests that share a prefix reuse its KV blocks,
and each still emits the spec loop's output on it alone.

The property tests draw workloads of a few system prompts followed by
different questions, arriving together and one after another, some aborted,
in caches small enough to evict cached blocks and preempt running requests,
with SHA-256 or a hash that always collides. After every step the block
accounting is checked (`check_blocks`); at the end every request is compared
with the spec loop (`check_all`: tokens, text, finish reason, logprobs).

A preempted and readmitted request reports the prompt tokens the prefix cache
served at its *first* admission, never the blocks it cached for itself before it
was preempted (`cached_tokens`).
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from decodespec.reference.block_allocator import (
    ROOT_KEY,
    BlockAllocator,
    CacheFullError,
    PrefixKey,
    block_hash,
)
from decodespec.reference.completions_format import usage
from decodespec.reference.engine import Engine
from decodespec.spec.params import SamplingParams
from tests.engine.test_engine_vs_spec import (
    check_all,
    draft_model_of,
    request_params,
    run_workload,
    small_model,
)
from tests.engine.toy import (
    ByteTokenizer,
    greedy,
    random_weights,
    record_admissions,
    run_to_end,
    small_config,
)


def always_collides(parent_key: bytes, tokens) -> bytes:
    """A block hash under which every block of every sequence shares one key."""
    return b"collision"


HASHES = {"sha256": block_hash, "always-collides": always_collides}


def check_blocks(engine: Engine) -> None:
    """The allocator's books after a step: every reference is a running request's
    table entry, no mapped block is free or cached (eviction never takes a block in
    use), and no request will write to a block another request maps."""
    allocator, size = engine.block_manager.allocator, engine.block_manager.block_size
    running = engine.scheduler.running
    mapped = Counter(block for r in running for block in r.blocks)
    assert all(not r.blocks for r in engine.scheduler.waiting), "a waiting request owns blocks"
    for block in range(allocator.num_blocks):
        assert allocator.ref_counts[block] == mapped[block], f"block {block}'s reference count"
    free, cached = allocator.free_blocks, allocator.cached_blocks
    assert not free & cached and not (free | cached) & set(mapped), "a mapped block is unowned"
    assert len(free | cached | set(mapped)) == allocator.num_blocks, "a block was lost"
    for r in running:
        assert len(set(r.blocks)) == len(r.blocks), f"request {r.id} maps a block twice"
        # Registered blocks hold the request's own tokens, every position written.
        assert len(r.prefix_keys) * size <= min(r.num_cached, r.length), f"request {r.id}"
        written = r.num_cached // size  # blocks every position of which is written
        for i, block in enumerate(r.blocks):
            if mapped[block] > 1:
                assert i < written, f"request {r.id} writes to shared block {block}"


def check_released(engine: Engine) -> None:
    allocator = engine.block_manager.allocator
    assert not any(allocator.ref_counts), "a reference outlived its request"
    assert allocator.num_free == allocator.num_blocks, "blocks leaked"


@st.composite
def shared_prefix_workloads(draw: st.DrawFn, sampled: bool = True, max_requests: int = 6):
    """Requests (prompt, params, arrival step): a system prompt from a few, then a
    question of its own; arrivals at the same step and at later ones."""
    systems = draw(
        st.lists(st.lists(st.integers(0, 255), min_size=1, max_size=20), min_size=1, max_size=2)
    )
    requests = []
    for _ in range(draw(st.integers(2, max_requests))):
        system = draw(st.sampled_from(systems))
        question = draw(st.lists(st.integers(0, 255), min_size=0, max_size=6))
        prompt = system + question
        params = draw(request_params(sampled and draw(st.booleans()), 260))
        requests.append((prompt, params, draw(st.integers(0, 8))))
    return requests


def cached_tokens(engine: Engine, ids: dict[int, int]) -> int:
    return sum(engine.output(i).cached_tokens for i in ids.values())


# ---------------------------------------------------------------- the property tests


@pytest.mark.clause("LOOP-PREFIX-1")
@given(
    workload=shared_prefix_workloads(),
    seed=st.integers(0, 50),
    block_size=st.sampled_from((1, 2, 4)),
    spare_blocks=st.integers(0, 12),
    hash_name=st.sampled_from(tuple(HASHES)),
    backend=st.sampled_from(("spec", "torch")),
    data=st.data(),
)
def test_shared_prefixes_give_each_request_its_spec_output(
    workload, seed, block_size, spare_blocks, hash_name, backend, data
):
    """Under cache pressure (eviction, preemption), with aborts and either hash."""
    weights = small_model(seed)
    largest = max(len(p) + (params.max_tokens or 0) - 1 for p, params, _ in workload)
    blocks = -(-largest // block_size) + spare_blocks
    engine = Engine(
        weights,
        ByteTokenizer(),
        backend=backend,
        block_size=block_size,
        cache_tokens=blocks * block_size,
        token_budget=data.draw(st.sampled_from((2, 5, None))),  # prompts in chunks, or whole
    )
    engine.block_manager.allocator.hash_fn = HASHES[hash_name]
    aborted = data.draw(st.sets(st.integers(0, len(workload) - 1), max_size=1))
    abort_at = {index: data.draw(st.integers(0, 10)) for index in aborted}
    ids, events = run_workload(engine, workload, abort_at, after_step=check_blocks)
    reused = cached_tokens(engine, ids)
    event(f"prompt tokens reused > 0: {reused > 0}")
    event(f"preemptions > 0: {sum(engine.requests[i].preemptions for i in ids.values()) > 0}")
    event(f"cached blocks evicted > 0: {engine.block_manager.allocator.evictions > 0}")
    check_all(engine, weights, ids, events, skip=aborted)
    check_released(engine)


@pytest.mark.clause("LOOP-PREFIX-1")
@given(
    workload=shared_prefix_workloads(sampled=False, max_requests=4),
    seed=st.integers(0, 50),
    speculate=st.sampled_from(("ngram", "layers:1", "model")),
)
def test_shared_prefixes_with_speculative_decoding_are_the_spec_loop(workload, seed, speculate):
    """Drafts are written past the shared blocks and rejected ones roll back: only
    positions the target computed from the request's own tokens are registered."""
    weights = small_model(seed)
    engine = Engine(
        weights,
        ByteTokenizer(),
        block_size=2,
        cache_tokens=96,
        speculate=speculate,
        num_draft=3,
        draft_model=draft_model_of(weights) if speculate == "model" else None,
    )
    ids, events = run_workload(engine, workload, after_step=check_blocks)
    check_all(engine, weights, ids, events)
    check_released(engine)


# ---------------------------------------------------------------- reuse happens


def one_after_another(engine: Engine, prompts: list[list[int]], params: SamplingParams):
    """Run each prompt to its end before the next arrives; their outputs."""
    outputs = []
    for prompt in prompts:
        request_id = engine.add_request(prompt, params)
        while engine.has_unfinished():
            engine.step()
        outputs.append(engine.output(request_id))
    return outputs


SYSTEM = list(range(40, 80))  # 40 tokens: two full blocks of 16 and 8 more
QUESTIONS = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]


@pytest.mark.clause("LOOP-PREFIX-1")
@pytest.mark.parametrize("hash_name", tuple(HASHES))
def test_a_repeated_system_prompt_is_prefilled_once(hash_name):
    """The second and later requests map the system prompt's two full blocks, copy its
    last 8 positions from the first request's third block (registered once its
    answer filled it), and run only their questions; their tokens are those of an
    engine without the cache."""
    weights = small_model(3)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [SYSTEM + q for q in QUESTIONS]
    engine = Engine(weights, ByteTokenizer())
    engine.block_manager.allocator.hash_fn = HASHES[hash_name]
    cached = one_after_another(engine, prompts, params)
    plain = one_after_another(
        Engine(weights, ByteTokenizer(), prefix_caching=False), prompts, params
    )
    assert [o.cached_tokens for o in cached] == [0, 40, 40]
    assert [o.cached_tokens for o in plain] == [0, 0, 0]
    assert [o.token_ids for o in cached] == [o.token_ids for o in plain]


@pytest.mark.clause("LOOP-PREFIX-1")
def test_the_triton_backend_prefills_after_a_cached_prefix():
    """The kernels' attention over cached blocks plus a chunk of new rows (Triton
    interpreter without a GPU, small shapes): the tokens of the cache off."""
    pytest.importorskip("triton")
    weights = random_weights(
        small_config(max_context=32, vocab_size=260, hidden_size=16, num_layers=1), seed=2
    )
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    prompts = [[*SYSTEM[:9], 1, 2, 3], [*SYSTEM[:9], 4, 5]]
    outputs = {
        caching: one_after_another(
            Engine(
                weights, ByteTokenizer(), backend="triton", block_size=4, prefix_caching=caching
            ),
            prompts,
            params,
        )
        for caching in (True, False)
    }
    # Two whole blocks, and the third's first position copied from the first prompt's.
    assert [o.cached_tokens for o in outputs[True]] == [0, 9]
    assert [o.token_ids for o in outputs[True]] == [o.token_ids for o in outputs[False]]


@pytest.mark.clause("LOOP-PREFIX-1")
def test_generated_tokens_are_reused_too():
    """A request's output blocks are registered as well: a follow-up whose prompt is
    the first conversation so far reuses them (a chat's next turn)."""
    weights = small_model(4)
    engine = Engine(weights, ByteTokenizer(), block_size=4)
    first = one_after_another(
        engine, [SYSTEM[:10]], SamplingParams(temperature=0.0, max_tokens=12)
    )[0]
    follow_up = SYSTEM[:10] + first.token_ids + [7, 7]
    second = one_after_another(engine, [follow_up], SamplingParams(temperature=0.0, max_tokens=2))[
        0
    ]
    # 10 + 12 tokens were run (the last output token never is): 21 positions, 5 blocks.
    assert second.cached_tokens == 20


@pytest.mark.clause("LOOP-PREFIX-1")
def test_the_last_prompt_token_always_runs():
    """A prompt the cache holds whole still runs its last token (its logits choose the
    first token): one whole block is mapped, and of the second, which the request
    then writes, the 3 positions before it are copied."""
    weights = small_model(5)
    engine = Engine(weights, ByteTokenizer(), block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    outputs = one_after_another(engine, [SYSTEM[:8], SYSTEM[:8]], params)
    assert [o.cached_tokens for o in outputs] == [0, 7]
    assert outputs[0].token_ids == outputs[1].token_ids
    check_released(engine)


@pytest.mark.clause("LOOP-PREFIX-1")
def test_a_prompt_within_one_block_is_served_from_part_of_a_cached_block():
    """A registered block serves every sequence that begins like it: the same short
    prompt again (all but its last token), and one sharing only its first tokens,
    each copy those positions into a block of its own; their tokens are those of
    the cache off."""
    weights = small_model(9)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    # 10 + 8 tokens: the first block of 16 fills with the answer and is registered.
    prompts = [SYSTEM[:10], SYSTEM[:10], [*SYSTEM[:6], 1, 2, 3], [2, *SYSTEM[:9]]]
    engine = Engine(weights, ByteTokenizer())
    admissions = record_admissions(engine)
    cached = one_after_another(engine, prompts, params)
    plain = one_after_another(
        Engine(weights, ByteTokenizer(), prefix_caching=False), prompts, params
    )
    assert [o.cached_tokens for o in cached] == [0, 9, 6, 0]
    assert [n for _, n in admissions] == [0, 9, 6, 0]
    assert [o.token_ids for o in cached] == [o.token_ids for o in plain]
    check_released(engine)


@pytest.mark.clause("LOOP-PREFIX-1")
def test_a_partial_block_after_whole_ones_is_served_and_its_source_never_evicted():
    """Two whole blocks of 4 and two positions of a third are reused. The block the
    two positions come from is the least recently used in a full pool, yet the
    request's own blocks evict another: the source is held until the pass copied
    it. The tokens are those of the cache off."""
    weights = small_model(10)
    engine = Engine(weights, ByteTokenizer(), block_size=4, cache_tokens=28)  # 7 blocks
    prefix, greedy = SYSTEM[:12], SamplingParams(temperature=0.0, max_tokens=1)
    one_after_another(engine, [prefix], greedy)  # 3 blocks registered; the last goes first
    one_after_another(engine, [[7, 7, 7, 7, 9]], greedy)  # one more, most recently used
    engine.add_request([1, 2, 3, 4, 5], SamplingParams(temperature=0.0, max_tokens=4))
    engine.step()  # it holds two blocks: one is free, four cached
    prompt = [*prefix[:10], 100, 101, 102]  # 2 whole blocks + 2 positions, 4 blocks
    request_id = engine.add_request(prompt, greedy)
    while engine.has_unfinished():
        engine.step()
        check_blocks(engine)
    assert engine.output(request_id).cached_tokens == 10
    pool = engine.block_manager.allocator
    assert len(pool.match_prefix(prefix, 4, 3)[0]) == 3, "the source was evicted"
    assert pool.match_prefix([7, 7, 7, 7], 4, 1)[0] == [], "the other block was not"
    plain = Engine(weights, ByteTokenizer(), prefix_caching=False)
    assert engine.output(request_id).token_ids == (
        one_after_another(plain, [prompt], greedy)[0].token_ids
    )
    check_released(engine)


def test_a_copy_that_would_leave_too_few_blocks_is_skipped_not_waited_for():
    """Holding the source would leave the request one block short of a pool it fits
    alone: it is admitted without the copy (and computes those positions) instead
    of waiting for room that never comes."""
    weights = small_model(11)
    engine = Engine(weights, ByteTokenizer(), block_size=4, cache_tokens=12)  # 3 blocks
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    one_after_another(engine, [SYSTEM[:8]], greedy)  # two blocks registered
    prompt = [*SYSTEM[:2], *range(100, 107)]  # 9 tokens: all 3 blocks
    (output,) = one_after_another(engine, [prompt], greedy)
    assert output.finish_reason == "length" and output.cached_tokens == 0
    plain = Engine(weights, ByteTokenizer(), prefix_caching=False)
    assert output.token_ids == one_after_another(plain, [prompt], greedy)[0].token_ids
    check_released(engine)


@pytest.mark.clause("LOOP-PREFIX-1")
def test_requests_arriving_together_wait_a_pass_for_the_prefix_one_of_them_computes():
    """Blocks are registered after the pass that writes them. A waiting request whose
    prompt begins like one this pass prefills (a block or more of it) waits for the
    next pass and maps those blocks; one that shares nothing is admitted at once.
    Without prefix caching the second is admitted at once (a token budget of 64 then
    has no room left for the third). The tokens are those of the cache off."""
    weights = small_model(6)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompts = [SYSTEM + QUESTIONS[0], SYSTEM + QUESTIONS[1], [7] * 20]
    outputs = {}
    for caching in (True, False):
        engine = Engine(weights, ByteTokenizer(), prefix_caching=caching, token_budget=64)
        admissions = record_admissions(engine)
        ids = [engine.add_request(p, params) for p in prompts]
        engine.step()
        admitted_first = [i for i, _ in admissions]
        ids.append(engine.add_request(SYSTEM + QUESTIONS[2], params))
        while engine.has_unfinished():
            engine.step()
            check_blocks(engine)
        outputs[caching] = [engine.output(i) for i in ids]
        if caching:
            assert admitted_first == [ids[0], ids[2]]
            assert [o.cached_tokens for o in outputs[caching]] == [0, 32, 0, 32]
            check_released(engine)
        else:
            assert admitted_first == ids[:2]
    assert [o.token_ids for o in outputs[True]] == [o.token_ids for o in outputs[False]]


@pytest.mark.clause("LOOP-PREFIX-1")
def test_a_hit_is_never_evicted_to_make_room_for_the_rest_of_its_request():
    """A full cache: the request that would reuse a cached block waits rather than
    evict that block for its own other blocks, and reuses it once there is room."""
    weights = small_model(8)
    engine = Engine(weights, ByteTokenizer(), block_size=4, cache_tokens=12)
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    one_after_another(engine, [SYSTEM[:8]], greedy)  # two blocks, now cached
    engine.add_request([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    engine.step()  # it holds the one free block
    prompt = SYSTEM[:4] + list(range(100, 107))  # one cached block, two more to find
    request_id = engine.add_request(prompt, greedy)
    while engine.has_unfinished():
        engine.step()
        check_blocks(engine)
    assert engine.output(request_id).cached_tokens == 4
    plain = Engine(weights, ByteTokenizer(), prefix_caching=False)
    assert (
        engine.output(request_id).token_ids
        == one_after_another(plain, [prompt], greedy)[0].token_ids
    )
    check_released(engine)


def test_prefix_caching_off_registers_nothing():
    engine = Engine(small_model(7), ByteTokenizer(), prefix_caching=False)
    one_after_another(engine, [SYSTEM, SYSTEM], SamplingParams(temperature=0.0, max_tokens=2))
    assert engine.block_manager.allocator.cached_blocks == frozenset()
    with pytest.raises(TypeError, match="prefix_caching must be True or False"):
        Engine(small_model(7), ByteTokenizer(), prefix_caching="yes")


# ---------------------------------------------------------------- cached_tokens


@pytest.fixture(scope="module")
def model():
    return random_weights(small_config(), seed=5)


PREFIX = list(range(40, 48))  # two full blocks of 4
OWN = [1, 2, 3, 4, 5, 6]  # A's prompt: PREFIX + OWN, 14 tokens


@pytest.mark.clause("LOOP-PREFIX-1")
@pytest.mark.parametrize("first_hit", [8, 0], ids=["prefix-hit", "no-hit"])
def test_cached_tokens_of_a_readmitted_request_are_its_first_admissions(model, first_hit):
    """A maps PREFIX's two blocks from the cache (or nothing, when no earlier request
    left them), generates until its own blocks are full and registered, is preempted
    by the older B, and is readmitted after B ends, mapping 16 positions of its own
    blocks. Its cached_tokens (output, Request, OpenAI usage) stay the first figure."""
    # 8 blocks of 4: B (6 + up to 8 tokens) and A (14 + up to 10) need 10 blocks at 7
    # tokens each, so B's growth preempts A (the later admitted), then B ends.
    engine = Engine(model, ByteTokenizer(), block_size=4, cache_tokens=32)
    if first_hit:  # leave PREFIX's two blocks in the prefix cache
        engine.add_request([*PREFIX, 9], greedy(1))
        run_to_end(engine)
    admissions = record_admissions(engine)
    b = engine.add_request([7, 7, 7, 8, 8, 8], greedy(8))
    a = engine.add_request(PREFIX + OWN, greedy(10))
    run_to_end(engine)

    # Preconditions: A was preempted once, and its recompute reused its own blocks
    # (more positions than its first admission mapped, and the whole prompt).
    assert engine.output(a).preemptions == 1 and engine.output(b).preemptions == 0
    assert [n for i, n in admissions if i == a] == [first_hit, 16]
    assert engine.output(a).finish_reason == "length" and engine.output(a).completion_tokens == 10

    assert engine.requests[a].cached_prompt_tokens == first_hit
    assert engine.output(a).cached_tokens == first_hit
    assert usage(engine.output(a))["prompt_tokens_details"]["cached_tokens"] == first_hit
    assert engine.output(b).cached_tokens == 0


# ---------------------------------------------------------------- the allocator


def test_unowned_registered_blocks_are_cached_and_evicted_least_recently_used_first():
    pool = BlockAllocator(4, prefix_caching=True)
    first, second = pool.allocate(2), pool.allocate(2)
    key = None
    for block, tokens in zip(first, ([1, 2], [3, 4]), strict=True):
        key = pool.register(block, key, tokens)
    pool.register(second[0], None, [9, 9])
    pool.free(first)
    pool.free(second)
    assert pool.cached_blocks == {*first, second[0]} and pool.free_blocks == {second[1]}
    assert pool.num_free == 4
    # A sequence's later blocks go first: first[1] before first[0]; second[0] was
    # freed last, so it is the most recently used.
    assert pool.allocate(2) == [second[1], first[1]]
    assert pool.match_prefix([1, 2, 3, 4], 2, 2)[0] == [first[0]]


def test_a_shared_block_is_never_evicted_and_comes_back_with_its_last_reference():
    pool = BlockAllocator(2, prefix_caching=True)
    (block,) = pool.allocate(1)
    pool.register(block, None, [5, 6])
    pool.free([block])
    hits, _ = pool.match_prefix([5, 6, 7], 2, 1)
    assert hits == [block]
    pool.share(hits)
    pool.share(hits)  # two requests map it
    assert pool.ref_counts[block] == 2 and pool.num_free == 1
    pool.allocate(1)
    with pytest.raises(CacheFullError, match="needs 1 more blocks but only 0"):
        pool.allocate(1)
    pool.free(hits)
    pool.free(hits)
    assert pool.cached_blocks == {block}
    with pytest.raises(ValueError, match="already free"):
        pool.free(hits)


def test_a_collision_is_a_miss_never_a_wrong_block():
    """Under a hash that always collides, lookups still tell blocks apart by their
    tokens and their parent: same tokens after a different prefix is not a hit."""
    pool = BlockAllocator(8, prefix_caching=True, hash_fn=always_collides)
    a = pool.allocate(2)
    parent = pool.register(a[0], None, [1, 1])
    pool.register(a[1], parent, [2, 2])
    b = pool.allocate(1)
    pool.register(b[0], None, [3, 3])
    assert pool.match_prefix([1, 1, 2, 2], 2, 2)[0] == a
    assert pool.match_prefix([3, 3, 2, 2], 2, 2)[0] == b  # [2, 2] after [3, 3]: no such block
    assert pool.match_prefix([2, 2], 2, 1)[0] == []


def test_a_reused_parent_block_never_vouches_for_its_old_children():
    """A parent evicted and rewritten with other tokens gets a new serial: the old
    child, still cached, no longer matches after it (even if every key collides)."""
    pool = BlockAllocator(3, prefix_caching=True, hash_fn=always_collides)
    parent_block, child_block = pool.allocate(2)
    parent = pool.register(parent_block, None, [1, 1])
    pool.register(child_block, parent, [2, 2])
    pool.free([child_block, parent_block])  # the parent is now the least recently used
    pool.allocate(1)  # the free block
    (reused,) = pool.allocate(1)  # evicts the parent
    assert reused == parent_block and pool.evictions == 1
    pool.register(reused, None, [1, 1])  # the same tokens, rewritten
    assert pool.match_prefix([1, 1, 2, 2], 2, 2)[0] == [reused]


def test_match_partial_finds_the_longest_begun_block_after_the_same_parent():
    pool = BlockAllocator(4, prefix_caching=True)
    first, short, long_, other = pool.allocate(4)
    parent = pool.register(first, None, [1, 1, 1])
    pool.register(short, parent, [2, 3, 9])
    pool.register(long_, parent, [2, 3, 4])
    pool.register(other, None, [2, 3, 4])  # the same tokens as a sequence's first block
    assert pool.match_partial(parent, [2, 3, 4]) == (long_, 3)
    assert pool.match_partial(parent, [2, 3]) == (short, 2)  # of equals, the first registered
    assert pool.match_partial(parent, [2, 5, 4]) == (short, 1)
    assert pool.match_partial(None, [2, 3, 7]) == (other, 2)
    assert pool.match_partial(parent, [5, 3, 4]) == (-1, 0)
    assert pool.match_partial(parent, []) == (-1, 0)
    pool.free([first, short, long_, other])  # cached: other, long_, short, first (LRU first)
    pool.allocate(2)  # evicts other and long_: they leave the index
    assert pool.match_partial(None, [2, 3, 7]) == (-1, 0)
    assert pool.match_partial(parent, [2, 3, 4]) == (short, 2)
    assert BlockAllocator(1).match_partial(None, [1]) == (-1, 0)  # prefix caching off


def test_registering_a_block_twice_or_an_unowned_one_is_refused():
    pool = BlockAllocator(2, prefix_caching=True)
    a, b = pool.allocate(2)
    key = pool.register(a, None, [1])
    assert pool.register(b, None, [1]) == key  # an equal block: the first one's key
    assert pool.match_prefix([1, 0], 1, 1)[0] == [a]
    with pytest.raises(ValueError, match="registered already"):
        pool.register(a, None, [2])
    pool.free([a, b])
    with pytest.raises(ValueError, match="not owned"):
        pool.register(b, None, [3])
    with pytest.raises(ValueError, match="prefix caching off"):
        BlockAllocator(1).register(0, None, [1])


def test_block_hash_is_sha256_of_the_parent_key_and_the_token_ids():
    import hashlib

    tokens = [0, 1, 2**40]
    expected = hashlib.sha256(b"".join(t.to_bytes(8, "little", signed=True) for t in tokens))
    assert block_hash(ROOT_KEY, tokens) == expected.digest()
    assert block_hash(b"x", tokens) != block_hash(ROOT_KEY, tokens)
    assert isinstance(PrefixKey(ROOT_KEY, 0).serial, int)


# ---------------------------------------------------------------- the bundled model


@pytest.mark.clause("LOOP-PREFIX-1")
def test_bundled_model_questions_after_one_system_prompt_are_the_spec_loop():
    """SmolLM2: a chat system prompt, then three questions one after another; the
    later ones reuse the system prompt's blocks and answer as the spec loop does."""
    from decodespec.reference.loader import load_model
    from decodespec.reference.model_files import bundled_model_path

    weights, tokenizer = load_model(bundled_model_path())
    system = tokenizer.encode(
        "You are a terse assistant. Answer in one short sentence, without preamble. " * 3
    )
    questions = ["The capital of France is", "Water boils at", "2 + 2 ="]
    workload = [
        (
            system + tokenizer.encode(q),
            SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
            8 * i,
        )
        for i, q in enumerate(questions)
    ]
    engine = Engine(weights, tokenizer, block_size=16)
    ids, events = run_workload(engine, workload, after_step=check_blocks)
    full_blocks = (len(system) // 16) * 16
    assert [engine.output(i).cached_tokens for i in ids.values()][1:] == [full_blocks] * 2
    check_all(engine, weights, ids, events)
