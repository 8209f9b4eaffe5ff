"""Batch-invariant mode (`Engine(batch_invariant=True)`, `reference/batch_invariance.py`):
a seeded request's tokens and every logprob are bitwise the same alone, in a batch of
any composition, after a cached prefix, and with speculative decoding (issue 40)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from decodespec.reference import cpu_linear, native_attention
from decodespec.reference.batch_invariance import (
    ROW_BLOCK,
    ROW_STEP,
    RowBlockLinear,
    one_thread,
    row_blocked,
    rows_alone,
)
from decodespec.reference.engine import Engine
from decodespec.reference.weight_formats import convert_weights, describe
from decodespec.spec import sampling
from decodespec.spec.generate import generate
from decodespec.spec.params import SamplingParams
from decodespec.spec.quant import quantize_weight
from tests.engine.toy import ByteTokenizer, random_weights, small_config

# Wide enough that the CPU GEMM takes different kernels for different row counts
# (at hidden 32 every row count gives the same bits, and the tests would prove nothing).
CONFIG = small_config(
    hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, head_dim=64,
    max_context=256,
)  # fmt: skip
PARAMS = SamplingParams(temperature=0.8, seed=11, max_tokens=6, top_logprobs=3, ignore_eos=True)
REQUEST = list(b"The quick brown fox jumps over the lazy dog. The quick brown fox")
SYSTEM = list(b"System: you are a helpful assistant who answers briefly. ")


@pytest.fixture(scope="module")
def models():
    weights = random_weights(CONFIG, seed=3)
    return {"float32": weights, "int4": convert_weights(weights, "int4")}


def run(
    engine: Engine,
    prompts: list[list[int]],
    joins: list[int] | None = None,
    params: SamplingParams = PARAMS,
) -> list:
    """Each prompt's output; prompt i joins at step `joins[i]` (default: all at once)."""
    joins = joins or [0] * len(prompts)
    ids: dict[int, int] = {}
    step = 0
    while len(ids) < len(prompts) or engine.has_unfinished():
        for i, prompt in enumerate(prompts):
            if i not in ids and joins[i] <= step:
                ids[i] = engine.add_request(prompt, params)
        engine.step()
        step += 1
    return [engine.output(ids[i]) for i in range(len(prompts))]


def bits(output) -> list:
    """Every token, logprob and alternative of an output, as exact floats."""
    return [(lp.token_id, lp.logprob, lp.rank, tuple(lp.top)) for lp in output.logprobs]


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 9, 10, 12, 15, 16, 17, 33, 100, 600])
@pytest.mark.parametrize("shape", [(512, 256), (256, 512), (4096, 256)])
def test_a_row_blocked_projection_gives_each_row_the_same_bits(rows, shape):
    """The premise of the mode, checked on the machine that runs it: a row's product
    through `RowBlockLinear` does not depend on how many rows share the call, nor on
    what the others hold, nor on where the row sits."""
    g = torch.Generator().manual_seed(rows)
    weight = RowBlockLinear(torch.randn(shape, generator=g))
    row = torch.randn(1, shape[1], generator=g)
    alone = weight.linear(row)
    batch = torch.randn(rows, shape[1], generator=g)
    position = rows // 2
    batch[position] = row[0]
    assert torch.equal(weight.linear(batch)[position], alone[0])
    assert torch.allclose(alone, row @ weight.unwrapped.T, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 31, 32, 33, 100])
@pytest.mark.parametrize("bits", [4, 8])
def test_a_row_blocked_quantized_projection_gives_each_row_the_same_bits(rows, bits):
    """The same for the quantized projections (the C product where it can be had)."""
    g = torch.Generator().manual_seed(rows)
    group = 32 if bits == 4 else 256
    quantized = quantize_weight(torch.randn(512, 256, generator=g), bits=bits, group_size=group)
    weight = RowBlockLinear(cpu_linear.pack(quantized))
    row = torch.randn(1, 256, generator=g)
    alone = weight.linear(row)
    batch = torch.randn(rows, 256, generator=g)
    batch[rows // 2] = row[0]
    assert torch.equal(weight.linear(batch)[rows // 2], alone[0])


def test_row_blocked_weights_keep_their_formats(models):
    """Every projection and the output are wrapped; what the weights are is unchanged."""
    for weights in models.values():
        blocked = row_blocked(weights)
        assert all(isinstance(layer.q_proj, RowBlockLinear) for layer in blocked.layers)
        assert isinstance(blocked.output, RowBlockLinear)
        assert blocked.embedding is weights.embedding
        assert describe(blocked) == describe(weights)
    assert ROW_BLOCK % ROW_STEP == 0


@settings(deadline=None, max_examples=4)
@given(
    lengths=st.lists(st.integers(1, 60), min_size=1, max_size=3),
    position=st.integers(0, 4),
    joins=st.lists(st.integers(0, 6), min_size=5, max_size=5),
)
@pytest.mark.parametrize("backend", ["spec", "torch"])
@pytest.mark.parametrize("fmt", ["float32", "int4"])
def test_a_request_has_the_same_bits_alone_and_in_any_batch(
    models, fmt, backend, lengths, position, joins
):
    weights = models[fmt]
    alone = bits(run(Engine(weights, ByteTokenizer(), backend=backend, batch_invariant=True),
                     [REQUEST])[0])  # fmt: skip
    others = [list(bytes(range(97, 97 + 26)) * 4)[:n] for n in lengths]
    position = min(position, len(others))
    prompts = [*others[:position], REQUEST, *others[position:]]
    engine = Engine(weights, ByteTokenizer(), backend=backend, batch_invariant=True)
    together = run(engine, prompts, joins[: len(prompts)])
    assert bits(together[position]) == alone


@pytest.mark.clause("LOOP-INVARIANT-1", "LOOP-PREFIX-1")
@pytest.mark.parametrize("backend", ["spec", "torch"])
@pytest.mark.parametrize("fmt", ["float32", "int4"])
def test_a_cached_prefix_a_token_budget_and_speculation_change_no_bit(models, fmt, backend):
    """LOOP-PREFIX-1 made bitwise: the prompt's rows after a prefix another request
    cached, and a verify pass's rows, come out as computed alone, token by token; a
    token budget does not cut the prompt."""
    weights = models[fmt]
    prompt = SYSTEM + REQUEST

    def engine(**options):
        return Engine(weights, ByteTokenizer(), backend=backend, batch_invariant=True, **options)

    alone = bits(run(engine(), [prompt])[0])
    cached = engine()
    run(cached, [SYSTEM + list(b"Hi")])
    after_prefix = run(cached, [prompt])[0]
    assert after_prefix.cached_tokens > 0
    assert bits(after_prefix) == alone
    # The mode runs prompts whole: a row's attention bits depend on its pass's query
    # count (ATTN-INVARIANT-1), so chunks cut by what else runs would change them.
    unchunked = engine(token_budget=7)
    assert unchunked.token_budget is None and "prompts whole" in unchunked.path
    assert bits(run(unchunked, [prompt])[0]) == alone
    # Speculation samples by rejection (its draws are not plain sampling's), so the
    # verify pass is compared greedy: each position's logprobs as computed alone.
    greedy = SamplingParams(temperature=0, max_tokens=8, top_logprobs=3, ignore_eos=True)
    plain = run(engine(), [prompt], params=greedy)[0]
    speculating = run(engine(speculate="ngram", num_draft=3), [prompt], params=greedy)[0]
    assert speculating.draft_tokens > 0
    assert bits(speculating) == bits(plain)


@pytest.mark.clause("LOOP-INVARIANT-1")
@pytest.mark.parametrize("backend", ["spec", "torch"])
@pytest.mark.parametrize("fmt", ["float32", "int4"])
def test_a_request_in_a_batch_is_the_spec_loop_bit_for_bit(models, fmt, backend):
    """LOOP-INVARIANT-1: the engine in this mode, running the request beside others
    that join at other steps, gives every token and logprob the bits of the spec's loop
    on the request alone with the mode's projections (the engine's own weights: the
    backend's formats, row-blocked), its attention (each query row alone) and
    one-thread sampling stages: no near-tie ambiguity."""
    weights = models[fmt]
    others = [list(b"abcdefghijklmnopqrstuvwxyz" * 2)[:n] for n in (5, 40)]
    engine = Engine(weights, ByteTokenizer(), backend=backend, batch_invariant=True)
    together = run(engine, [others[0], REQUEST, others[1]], joins=[0, 1, 3])[1]
    tokenizer = ByteTokenizer()
    assert all(isinstance(w, RowBlockLinear) for w in (engine.weights.output,
               *(layer.q_proj for layer in engine.weights.layers)))  # fmt: skip
    loop = list(
        generate(
            engine.weights,  # the backend's weight formats, row-blocked
            REQUEST,
            PARAMS,
            eos_token_ids=tokenizer.eos_token_ids,
            token_bytes=tokenizer.token_bytes,
            attention=rows_alone,
            sample=one_thread(sampling.sample),
            process_logits=one_thread(sampling.process_logits),
            compute_logprobs=one_thread(sampling.compute_logprobs),
        )
    )
    expected = [(s.logprobs.token_id, s.logprobs.logprob, s.logprobs.rank, tuple(s.logprobs.top))
                for s in loop]  # fmt: skip
    assert bits(together) == expected


def test_the_triton_backend_keeps_quantized_rows_off_the_row_count_dependent_kernel(models):
    """The Triton `quantized_linear` computes fewer than 8 rows with a GEMV and 8 or more
    with a GEMM, in other bits: in the mode the triton backend's quantized projections
    are the spec's definition, and a request's bits are its own (Triton interpreter)."""
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=3, top_logprobs=2, ignore_eos=True)
    engine = Engine(models["int4"], ByteTokenizer(), backend="triton", batch_invariant=True)
    assert "quantized_linear" not in engine.backend.kernel_ops
    alone = bits(run(engine, [REQUEST], params=params)[0])
    engine = Engine(models["int4"], ByteTokenizer(), backend="triton", batch_invariant=True)
    together = run(engine, [list(b"abcdefghijklmnopqrstuvwxyz"), REQUEST], [0, 1], params)[1]
    assert bits(together) == alone


def test_the_sampling_stages_give_a_lone_row_the_bits_it_has_in_a_batch():
    """PyTorch splits the sums of a lone `[1, vocab]` row between its threads: the
    mode's backend runs the sampling stages on one thread, so a request's logprobs
    alone equal its logprobs beside another request (a vocabulary as wide as the
    bundled model's: narrow rows are never split)."""
    from decodespec.reference.backend import get_backend
    from decodespec.reference.batch_invariance import batch_invariant_backend

    backend = batch_invariant_backend(get_backend("torch"))
    logits = torch.randn(2, 49152, generator=torch.Generator().manual_seed(0)) * 4
    tokens = torch.tensor([7, 9])
    alone = backend.compute_logprobs(logits[1:], tokens[1:], 5)
    batch = backend.compute_logprobs(logits, tokens, 5)
    assert torch.equal(alone.top_logprobs[0], batch.top_logprobs[1])
    assert torch.equal(alone.token_logprobs[0], batch.token_logprobs[1])


@pytest.mark.clause("LOOP-PREFIX-1", "LOOP-INVARIANT-1")
@pytest.mark.parametrize("fmt", ["float32", "int4"])
def test_a_prompt_after_its_cached_prefix_has_the_bits_of_the_cache_off(models, fmt):
    """A prompt after one that began like it: the cache serves all but its last token
    (whole blocks of 16, or part of one, or both), which then runs as the pass's only
    query row, where the spec's attention computes a lone row in other bits than one
    among many. The mode computes every query row alone: the bits of the cache off."""
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=3, top_logprobs=2, ignore_eos=True)
    cached = Engine(models[fmt], ByteTokenizer(), batch_invariant=True)
    plain = Engine(models[fmt], ByteTokenizer(), batch_invariant=True, prefix_caching=False)
    run(cached, [list(REQUEST[:40])], params=params)  # registers its first two blocks
    for length in (2, 5, 16, 17, 18, 30, 33):
        prompt = list(REQUEST[:length])
        again = run(cached, [prompt], params=params)[0]
        assert again.cached_tokens == length - 1
        assert bits(again) == bits(run(plain, [prompt], params=params)[0]), length


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_rows_alone_is_the_specs_attention_and_a_rows_bits_are_its_own(dtype):
    """`rows_alone` against `spec.attention.paged_attention`: the same values (float64
    tolerance) and log-sum-exp; and each row, computed in a pass of 1, 3 or 7 rows of its
    sequence, has the same bits. float32 on the CPU takes the native C attention,
    float64 the spec's a row at a time."""
    from decodespec.spec.attention import paged_attention

    g = torch.Generator().manual_seed(0)
    k_cache, v_cache = (torch.randn(6, 4, 2, 8, generator=g, dtype=dtype) for _ in range(2))
    table = torch.tensor([[5, 2, 0, 3], [1, 4, 0, 0]])
    q = torch.randn(10, 6, 8, generator=g, dtype=dtype)
    lens, starts = torch.tensor([15, 3]), torch.tensor([0, 7, 10])
    out, lse = rows_alone(q, k_cache, v_cache, table, lens, starts, return_lse=True)
    want, want_lse = paged_attention(q.double(), k_cache.double(), v_cache.double(), table, lens,
                                     starts, return_lse=True)  # fmt: skip
    assert torch.allclose(out.double(), want, atol=1e-5)
    assert torch.allclose(lse.double(), want_lse, rtol=1e-5, atol=1e-6)
    if dtype == torch.float32:  # the C attention's own bits
        native = native_attention.paged_attention(q, k_cache, v_cache, table, lens, starts)
        assert torch.equal(out, native)
    for rows in (1, 3, 7):  # the last `rows` query rows of sequence 0 alone
        part = rows_alone(q[7 - rows : 7], k_cache, v_cache, table[:1], lens[:1],
                          torch.tensor([0, rows]))  # fmt: skip
        assert torch.equal(part, out[7 - rows : 7]), rows
    with pytest.raises(ValueError, match="query_start"):
        rows_alone(q, k_cache, v_cache, table, lens, torch.tensor([0, 7, 9]))
