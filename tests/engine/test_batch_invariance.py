"""Batch invariance (LOOP-INVARIANT-1): a seeded request's tokens and every logprob are
bitwise the same alone, in a batch of any composition, after a cached prefix, in the
token budget's chunks and with speculative decoding (issues 40, 60).

The default engine (the torch backend) has it by construction, with no option: its
native step computes each row alone in C, its sampling stages run on one thread; every
test here asserts its bits on any machine. The spec backend has it in batch-invariant
mode (`Engine(batch_invariant=True)`, `reference/batch_invariance.py`), which rests on
a premise about the machine's GEMM (a row's bits do not depend on
how many rows share the call, once padded to a multiple of `ROW_STEP`), which holds on
some CPUs and not on others (issue 58). No test here asserts it: the premise check is
tested against stand-in GEMMs that keep and break it, and each engine test asserts the
bits where the check passes on this machine and a clear refusal where it fails."""

from __future__ import annotations

import contextlib
import io
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from decodespec.reference import (
    batch_invariance,
    cli,
    cli_generate,
    cli_serve,
    cpu_linear,
    native_attention,
)
from decodespec.reference.backend import get_backend
from decodespec.reference.batch_invariance import (
    CHECKED_ROWS,
    ROW_BLOCK,
    ROW_STEP,
    BatchInvarianceUnavailable,
    RowBlockLinear,
    batch_invariant_backend,
    checked_rows,
    lone_row_on_one_thread,
    measure_rows,
    premise_failures,
    row_blocked,
    row_invariance,
    rows_alone,
)
from decodespec.reference.engine import Engine
from decodespec.reference.weight_formats import convert_weights, describe
from decodespec.spec import sampling
from decodespec.spec.generate import generate
from decodespec.spec.params import SamplingParams, sampling_tensors
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


def mode_engine(weights, backend: str = "spec", **options) -> Engine | None:
    """`Engine(weights, backend=backend, batch_invariant=True, **options)` where the mode's
    premise check passes on this machine for these weights and backend. Where it fails,
    asserts that the engine refuses, naming the weights, the backend, every failing
    product with its row counts and what works instead, and returns None."""
    prepared = batch_invariant_backend(get_backend(backend)).prepare_weights(weights)
    failures = premise_failures(prepared)

    def engine() -> Engine:
        return Engine(weights, ByteTokenizer(), backend=backend, batch_invariant=True, **options)

    if not failures:
        return engine()
    with pytest.raises(BatchInvarianceUnavailable) as refusal:
        engine()
    assert_clear_refusal(str(refusal.value), weights, backend, failures)
    return None


def invariant_engine(weights, backend: str, **options) -> Engine | None:
    """The batch-invariant engine of `backend`: the torch backend's default, by
    construction (no option; its native step runs every pass), or the spec backend's in
    the mode (`mode_engine`: None where this machine refuses it)."""
    if backend != "torch":
        return mode_engine(weights, backend, **options)
    engine = Engine(weights, ByteTokenizer(), backend="torch", **options)
    assert engine.batch_invariant and engine.runner.native is not None, engine.path
    return engine


def assert_clear_refusal(message: str, weights, backend: str, failures) -> None:
    assert message.startswith(f"batch-invariant mode refused for {describe(weights)}")
    assert f", backend {backend}: " in message and "Measured on PyTorch " in message
    for names, verdict in failures:
        rows, disagreeing = (", ".join(map(str, r)) for r in (verdict.rows, verdict.disagreeing))
        assert f"a row alone and among {rows} rows gave other bits among {disagreeing}" in message
        assert f"{', '.join(names)} ({verdict.product})" in message
    assert "What works: float32, int8 or int4 weights on the torch backend" in message


def row_by_row(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A GEMM that keeps the premise by construction: every row its own call."""
    return torch.cat([row[None] @ weight.T for row in x])


def split_sums(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Each row's products summed in another order: its two halves of `K` apart, then
    added (as a split-K kernel sums them)."""
    half = x.shape[1] // 2
    return row_by_row(x[:, :half], weight[:, :half]) + row_by_row(x[:, half:], weight[:, half:])


def split_from_16_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A GEMM like the failing machine's (issue 58): from 16 rows up it sums each row's
    products in another order than below."""
    return row_by_row(x, weight) if x.shape[0] < ROW_BLOCK else split_sums(x, weight)


def odd_rows_differ(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A GEMM that sums in another order below `ROW_BLOCK` rows off the multiples of
    `ROW_STEP` (the development machine's: 1, 2, 3, 5, ... rows in other bits than 4, 8,
    12 and 16 or more)."""
    if x.shape[0] < ROW_BLOCK and x.shape[0] % ROW_STEP:
        return split_sums(x, weight)
    return row_by_row(x, weight)


class Quantized:
    """A stand-in quantized projection (not a tensor: `RowBlockLinear` gives it at most
    `ROW_BLOCK` rows a call) whose product is `gemm`'s."""

    def __init__(self, weight: torch.Tensor, gemm) -> None:
        self.weight, self.gemm, self.shape = weight, gemm, tuple(weight.shape)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemm(x, self.weight)


@pytest.mark.parametrize("shape", [(512, 256), (256, 512), (4096, 256)])
def test_the_premise_check_finds_a_row_invariant_gemm_invariant(shape, monkeypatch):
    """Against a GEMM that computes every row alone, the check reports agreement at every
    row count it tries, below `ROW_BLOCK` and beyond (a dense weight's up to 257 rows,
    a quantized one's those that are other calls: 16 rows a call)."""
    monkeypatch.setattr(batch_invariance, "dense_product", row_by_row)
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    dense = measure_rows(weight, product="dense")
    assert dense.holds and dense.disagreeing == () and dense.rows == CHECKED_ROWS
    assert max(CHECKED_ROWS) > 2 * ROW_BLOCK and min(CHECKED_ROWS) < ROW_STEP
    quantized = measure_rows(Quantized(weight, row_by_row))
    assert quantized.holds and quantized.rows == checked_rows(shape, dense=False)
    assert quantized.rows == (2, 5, 10, 15, 16, 17, 33)
    # A GEMM whose bits change at row counts off the multiples of ROW_STEP keeps the
    # premise too: the padding is what the mode does about it.
    monkeypatch.setattr(batch_invariance, "dense_product", odd_rows_differ)
    assert measure_rows(weight).holds
    assert not torch.equal(odd_rows_differ(weight[:3], weight), row_by_row(weight[:3], weight))


@pytest.mark.parametrize("shape", [(512, 256), (256, 512), (4096, 256)])
def test_the_premise_check_catches_a_gemm_whose_sums_depend_on_the_row_count(shape, monkeypatch):
    """Against a GEMM that sums in another order from 16 rows up, the check reports
    exactly the row counts that reach it: 15 (padded to 16) and more."""
    monkeypatch.setattr(batch_invariance, "dense_product", split_from_16_rows)
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    verdict = measure_rows(weight, product="the stand-in")
    assert not verdict.holds
    assert verdict.disagreeing == tuple(r for r in CHECKED_ROWS if r > ROW_BLOCK - ROW_STEP)
    assert verdict.product == "the stand-in"
    quantized = measure_rows(Quantized(weight, split_from_16_rows))
    assert quantized.disagreeing == (15, 16, 17, 33)


def test_the_premise_check_measures_the_modes_products_once(models, monkeypatch):
    """`row_invariance` measures each of a model's products the way the mode runs it, once
    per process and product: the dense GEMMs in float32, the spec's int4 definition by
    its dequantized weights' GEMM (the same bits as the definition), and never the C
    library's product, which computes each row alone by construction. Its verdicts are
    those of measuring again (whatever this machine's GEMM does)."""
    monkeypatch.setattr(batch_invariance, "_VERDICTS", {})
    for fmt, backend in (("float32", "spec"), ("int4", "spec"), ("int4", "torch")):
        prepared = batch_invariant_backend(get_backend(backend)).prepare_weights(models[fmt])
        blocked = row_blocked(prepared)
        verdicts = {row_invariance(layer.q_proj, torch.float32) for layer in blocked.layers}
        if backend == "torch":  # the C product (QUANT-A8-1): nothing to measure
            assert "QUANT-A8-1" in cpu_linear.products(prepared)
            assert verdicts == {None} and row_invariance(blocked.output, torch.float32) is None
            assert premise_failures(blocked) == []
            continue
        (verdict,) = verdicts  # one measurement for the layers' equal shapes
        assert verdict is row_invariance(blocked.layers[0].q_proj, torch.float32)  # cached
        definition = "int4 by the spec's definition, a " if fmt == "int4" else ""
        assert verdict.product == f"{definition}float32 GEMM [256, 256]"
        assert verdict.rows == checked_rows((256, 256), dense=fmt == "float32")
        q_proj = prepared.layers[0].q_proj
        if fmt == "int4":
            standin = batch_invariance._Definition(q_proj, torch.float32)
            x = torch.randn(5, 256)
            assert torch.equal(standin.linear(x), q_proj.linear(x))
        assert measure_rows(q_proj, rows=verdict.rows).disagreeing == verdict.disagreeing
        failing = {v.product for _, v in premise_failures(blocked)}
        assert (verdict.product in failing) == (not verdict.holds)
    assert len(batch_invariance._VERDICTS) == 10  # 5 shapes: float32 and int4's


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 15, 16, 17, 33, 100])
def test_a_row_blocked_projection_computes_the_product(rows):
    """Padding and blocks change no value: `RowBlockLinear` gives every row the product
    (dense, and quantized in blocks of `ROW_BLOCK` rows), in the input's rows."""
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(512, 256, generator=g)
    x = torch.randn(rows, 256, generator=g)
    assert torch.allclose(RowBlockLinear(weight).linear(x), x @ weight.T, rtol=1e-4, atol=1e-3)
    quantized = quantize_weight(weight, bits=4, group_size=32)
    assert torch.allclose(RowBlockLinear(quantized).linear(x), quantized.linear(x),
                          rtol=1e-4, atol=1e-3)  # fmt: skip


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 31, 32, 33, 100])
@pytest.mark.parametrize("bits", [4, 8])
def test_a_row_blocked_quantized_projection_gives_each_row_the_same_bits(rows, bits):
    """The torch backend's quantized projections: the C product computes each row alone
    (by construction, on any machine), so a row has the same bits among any rows; where
    the C library cannot be had, PyTorch's kernels do as the premise check says."""
    g = torch.Generator().manual_seed(rows)
    group = 32 if bits == 4 else 256
    quantized = quantize_weight(torch.randn(512, 256, generator=g), bits=bits, group_size=group)
    kernel = cpu_linear.pack(quantized)
    weight = RowBlockLinear(kernel)
    row = torch.randn(1, 256, generator=g)
    alone = weight.linear(row)
    batch = torch.randn(rows, 256, generator=g)
    batch[rows // 2] = row[0]
    same = torch.equal(weight.linear(batch)[rows // 2], alone[0])
    if isinstance(kernel, cpu_linear.ActivationQuantizedLinear):
        assert same and row_invariance(weight, torch.float32) is None
    else:
        verdict = row_invariance(weight, torch.float32)
        assert same or not verdict.holds


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
    """Bitwise equal: always on the torch backend; in the spec's mode where the premise
    holds on this machine, else refused clearly."""
    weights = models[fmt]
    engine = invariant_engine(weights, backend)
    if engine is None:
        return  # refused, and clearly (mode_engine asserts it)
    alone = bits(run(engine, [REQUEST])[0])
    others = [list(bytes(range(97, 97 + 26)) * 4)[:n] for n in lengths]
    position = min(position, len(others))
    prompts = [*others[:position], REQUEST, *others[position:]]
    engine = invariant_engine(weights, backend)
    together = run(engine, prompts, joins[: len(prompts)])
    assert bits(together[position]) == alone


@pytest.mark.clause("LOOP-INVARIANT-1", "LOOP-PREFIX-1")
@pytest.mark.parametrize("backend", ["spec", "torch"])
@pytest.mark.parametrize("fmt", ["float32", "int4"])
def test_a_cached_prefix_a_token_budget_and_speculation_change_no_bit(models, fmt, backend):
    """LOOP-PREFIX-1 made bitwise: the prompt's rows after a prefix another request
    cached, and a verify pass's rows, come out as computed alone, token by token, and a
    prompt in the token budget's chunks as whole. (The spec's mode: refused clearly where
    the premise fails.)"""
    weights = models[fmt]
    prompt = SYSTEM + REQUEST
    if invariant_engine(weights, backend) is None:
        return  # refused, and clearly (mode_engine asserts it)

    def engine(**options):
        return invariant_engine(weights, backend, **options)

    alone = bits(run(engine(), [prompt])[0])
    cached = engine()
    run(cached, [SYSTEM + list(b"Hi")])
    after_prefix = run(cached, [prompt])[0]
    assert after_prefix.cached_tokens > 0
    assert bits(after_prefix) == alone
    chunked = engine(token_budget=7)
    if backend == "torch":  # each row alone in the native step: chunks change no bit
        assert chunked.token_budget == 7
    else:  # the mode runs prompts whole (the spec's attention: ATTN-INVARIANT-1)
        assert chunked.token_budget is None and "prompts whole" in chunked.path
    assert bits(run(chunked, [prompt])[0]) == alone
    # Speculation samples by rejection (its draws are not plain sampling's), so the
    # verify pass is compared greedy: each position's logprobs as computed alone.
    greedy = SamplingParams(temperature=0, max_tokens=8, top_logprobs=3, ignore_eos=True)
    plain = run(engine(), [prompt], params=greedy)[0]
    speculating = run(engine(speculate="ngram", num_draft=3), [prompt], params=greedy)[0]
    assert speculating.draft_tokens > 0
    assert bits(speculating) == bits(plain)


@pytest.mark.clause("LOOP-INVARIANT-1")
@pytest.mark.parametrize("speculate", ["layers:1", "model"])
@pytest.mark.parametrize("fmt", ["float32", "int4"])
def test_a_model_drafters_drafts_and_a_sampled_requests_bits_are_its_own(models, fmt, speculate):
    """A model drafter runs on the default engine's native step (as the target does)
    and compares softmaxes of a lone row on one thread: every draft of a sampled request
    (its tokens and the bits of its distributions) and every output bit are the same
    alone as beside requests that join at other steps."""
    draft = convert_weights(
        random_weights(
            replace(CONFIG, num_layers=1, hidden_size=128, intermediate_size=256), seed=9
        ),
        fmt,
    )

    def engine() -> tuple[Engine, list]:
        e = invariant_engine(
            weights=models[fmt],
            backend="torch",
            speculate=speculate,
            num_draft=3,
            draft_model=draft if speculate == "model" else None,
        )
        assert e.drafter.native is not None
        drafts, propose = [], e.drafter.propose

        def recording(requests, counts):
            proposed = propose(requests, counts)
            drafts.extend(
                (d.tokens, d.probs)
                for r, d in zip(requests, proposed, strict=True)
                if r.prompt_ids == REQUEST
            )
            return proposed

        e.drafter.propose = recording
        return e, drafts

    e, drafts_alone = engine()
    alone = run(e, [REQUEST])[0]
    assert alone.draft_tokens > 0
    e, drafts_together = engine()
    others = [list(b"abcdefghijklmnopqrstuvwxyz" * 8)[:n] for n in (9, 180)]
    together = run(e, [others[0], REQUEST, others[1]], joins=[0, 1, 2])[1]
    assert [t for t, _ in drafts_together] == [t for t, _ in drafts_alone]
    for (_, p_alone), (_, p_together) in zip(drafts_alone, drafts_together, strict=True):
        assert (p_alone is None) == (p_together is None)
        assert p_alone is None or torch.equal(p_alone, p_together)
    assert bits(together) == bits(alone)


@pytest.mark.clause("LOOP-INVARIANT-1")
@pytest.mark.parametrize("backend", ["spec", "torch"])
@pytest.mark.parametrize("fmt", ["float32", "int4"])
def test_a_request_in_a_batch_is_the_spec_loop_bit_for_bit(models, fmt, backend):
    """LOOP-INVARIANT-1: the engine, running the request beside others that join at
    other steps, gives every token and logprob the bits of the spec's loop on the
    request alone with the engine's forward pass and one-thread sampling stages: no
    near-tie ambiguity. The torch backend's forward pass is its native step (the loop's
    `hidden_states`); the spec's mode's is the spec's decoder with its projections (the
    engine's own weights: the backend's formats, row-blocked) and its attention (each
    query row alone). (The mode: refused clearly where the premise fails.)"""
    weights = models[fmt]
    others = [list(b"abcdefghijklmnopqrstuvwxyz" * 2)[:n] for n in (5, 40)]
    engine = invariant_engine(weights, backend)
    if engine is None:
        return  # refused, and clearly (mode_engine asserts it)
    together = run(engine, [others[0], REQUEST, others[1]], joins=[0, 1, 3])[1]
    tokenizer = ByteTokenizer()
    if backend == "torch":
        forward = {"hidden_states": engine.runner.native}
    else:
        assert all(isinstance(w, RowBlockLinear) for w in (engine.weights.output,
                   *(layer.q_proj for layer in engine.weights.layers)))  # fmt: skip
        forward = {"attention": rows_alone}
    loop = list(
        generate(
            engine.weights,  # the backend's weight formats (row-blocked in the mode)
            REQUEST,
            PARAMS,
            eos_token_ids=tokenizer.eos_token_ids,
            token_bytes=tokenizer.token_bytes,
            sample=lone_row_on_one_thread(sampling.sample),
            process_logits=lone_row_on_one_thread(sampling.process_logits),
            compute_logprobs=lone_row_on_one_thread(sampling.compute_logprobs),
            **forward,
        )
    )
    expected = [(s.logprobs.token_id, s.logprobs.logprob, s.logprobs.rank, tuple(s.logprobs.top))
                for s in loop]  # fmt: skip
    assert bits(together) == expected


def test_the_triton_backend_keeps_quantized_rows_off_the_row_count_dependent_kernel(models):
    """The Triton `quantized_linear` computes fewer than 8 rows with a GEMV and 8 or more
    with a GEMM, in other bits: in the mode the triton backend's quantized projections
    are the spec's definition, and a request's bits are its own (Triton interpreter) —
    where the premise holds for that definition's GEMM; else refused clearly."""
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=3, top_logprobs=2, ignore_eos=True)
    backend = batch_invariant_backend(get_backend("triton"))
    assert "quantized_linear" not in backend.kernel_ops
    prepared = backend.prepare_weights(models["int4"])
    assert all(type(layer.q_proj).__name__ == "QuantizedWeight" for layer in prepared.layers)
    engine = mode_engine(models["int4"], "triton")
    if engine is None:
        return  # refused, and clearly (mode_engine asserts it)
    assert "quantized_linear" not in engine.backend.kernel_ops
    alone = bits(run(engine, [REQUEST], params=params)[0])
    engine = mode_engine(models["int4"], "triton")
    together = run(engine, [list(b"abcdefghijklmnopqrstuvwxyz"), REQUEST], [0, 1], params)[1]
    assert bits(together) == alone


@pytest.mark.parametrize("threads", [2, 3])
def test_the_sampling_stages_give_a_lone_row_the_bits_it_has_in_a_batch(threads):
    """PyTorch splits the sums of a lone `[1, vocab]` row between its threads, and reduces
    each row of a batch on one thread: the torch backend runs a lone row's stages on one
    thread (`lone_row_on_one_thread`), so each row's processed logits, draw and logprobs
    alone equal its own among 2, 3 or 16 rows of other parameters (every processor and
    filter, greedy and sampled), on 2 and 3 threads (a vocabulary as wide as the
    bundled model's: narrow rows are never split)."""
    backend, vocab = get_backend("torch"), 49152
    kinds = [
        SamplingParams(temperature=0.8, seed=1),
        SamplingParams(temperature=0.7, top_k=50, top_p=0.9, seed=2),
        SamplingParams(
            temperature=1.2,
            min_p=0.05,
            repetition_penalty=1.3,
            frequency_penalty=0.5,
            presence_penalty=-0.5,
            seed=3,
        ),
        SamplingParams(temperature=0.0, logit_bias={5: 3.0}),
    ]
    params = [kinds[i % len(kinds)] for i in range(16)]
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, vocab, generator=g) * 4
    tokens = torch.randint(0, vocab, (16,), generator=g)

    def stages(rows: list[int]) -> tuple:
        tensors = sampling_tensors(
            [params[r] for r in rows], vocab_size=vocab,
            prompt_token_ids=[[r, 7, 11] for r in rows], output_token_ids=[[3] * r for r in rows],
        )  # fmt: skip
        processors = {k: v for k, v in tensors.items() if k != "seed"}
        lp = backend.compute_logprobs(logits[rows], tokens[rows], 5)
        return (backend.process_logits(logits[rows], **processors),
                backend.sample(logits[rows], **tensors),
                lp.token_logprobs, lp.ranks, lp.top_token_ids, lp.top_logprobs)  # fmt: skip

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for batch in (2, 3, 16):
            together = stages(list(range(batch)))
            for r in range(batch):
                alone = stages([r])
                for a, b in zip(alone, together, strict=True):
                    assert torch.equal(a[0], b[r]), (threads, batch, r)
    finally:
        torch.set_num_threads(before)


@pytest.mark.clause("LOOP-PREFIX-1", "LOOP-INVARIANT-1")
@pytest.mark.parametrize("backend", ["spec", "torch"])
@pytest.mark.parametrize("fmt", ["float32", "int4"])
def test_a_prompt_after_its_cached_prefix_has_the_bits_of_the_cache_off(models, fmt, backend):
    """A prompt after one that began like it: the cache serves all but its last token
    (whole blocks of 16, or part of one, or both), which then runs as the pass's only
    query row, where the spec's attention computes a lone row in other bits than one
    among many. The native step and the mode compute every query row alone: the bits
    of the cache off. (The mode: refused clearly where the premise fails.)"""
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=3, top_logprobs=2, ignore_eos=True)
    cached = invariant_engine(models[fmt], backend)
    if cached is None:
        return  # refused, and clearly (mode_engine asserts it)
    plain = invariant_engine(models[fmt], backend, prefix_caching=False)
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


@pytest.fixture
def failing_gemm(monkeypatch):
    """This machine's GEMM replaced by one that breaks the premise (as the Intel Xeon's
    did, issue 58), for the mode's products and for the check, with no verdicts kept."""
    monkeypatch.setattr(batch_invariance, "_VERDICTS", {})
    monkeypatch.setattr(batch_invariance, "dense_product", split_from_16_rows)


@pytest.mark.parametrize(
    ("fmt", "backend"),
    [("float32", "spec"), ("bfloat16", "torch"), ("int4", "spec"), ("int4", "triton")],
)  # fmt: skip
def test_where_the_premise_fails_the_mode_is_refused_clearly(models, fmt, backend, failing_gemm):
    """Every configuration whose projections go through PyTorch's GEMM is refused at
    construction, with the weights, the backend, the evidence and what works instead."""
    weights = models[fmt] if fmt != "bfloat16" else convert_weights(models["float32"], fmt)
    with pytest.raises(BatchInvarianceUnavailable) as refusal:
        Engine(weights, ByteTokenizer(), backend=backend, batch_invariant=True)
    assert isinstance(refusal.value, ValueError)  # what the commands report, exit 2
    message = str(refusal.value)
    quantized = fmt == "int4"
    rows = "15, 16, 17, 33" if quantized else "15, 16, 17, 33, 100, 257"
    every = "2, 5, 10, 15, 16, 17, 33" + ("" if quantized else ", 100, 257")
    dtype = "bfloat16" if fmt == "bfloat16" else "float32"
    what = "int4 by the spec's definition, a float32" if quantized else dtype
    assert f"a row alone and among {every} rows gave other bits among {rows} through " in message
    assert f"through q_proj, o_proj ({what} GEMM [256, 256]), k_proj, v_proj (" in message
    assert ", output (" in message
    prepared = batch_invariant_backend(get_backend(backend)).prepare_weights(weights)
    assert_clear_refusal(message, weights, backend, premise_failures(prepared))
    assert Engine(weights, ByteTokenizer(), backend=backend).path  # refused only in the mode


@pytest.mark.parametrize("flag", [False, True])
@pytest.mark.parametrize("fmt", ["float32", "int4"])
def test_where_the_premise_fails_the_default_engine_is_still_batch_invariant(
    models, failing_gemm, fmt, flag
):
    """The torch backend multiplies float32 and int4 weights by the C library's products,
    which do not go through the GEMM: nothing is measured, `batch_invariant` changes
    nothing, and a request's bits are its own."""
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=3, top_logprobs=2, ignore_eos=True)

    def engine() -> Engine:
        return Engine(models[fmt], ByteTokenizer(), backend="torch", batch_invariant=flag)

    first = engine()
    kernel = cpu_linear.DenseLinear if fmt == "float32" else cpu_linear.ActivationQuantizedLinear
    projections = [layer.q_proj.shared.kernel for layer in first.weights.layers]
    assert all(isinstance(p, kernel) for p in (*projections, first.weights.output))
    assert first.runner.native is not None and first.batch_invariant
    assert not batch_invariance._VERDICTS  # nothing measured
    alone = bits(run(first, [REQUEST], params=params)[0])
    together = run(engine(), [list(b"abcdefghijklmnopqrstuvwxyz"), REQUEST], [0, 1], params)[1]
    assert bits(together) == alone


def test_a_refusal_says_when_the_c_product_cannot_be_had(models, failing_gemm, monkeypatch):
    """Without the C library (`DECODESPEC_NATIVE=0`, as where there is no compiler) the
    configuration that works elsewhere is named, and why it cannot be had here."""
    monkeypatch.setenv("DECODESPEC_NATIVE", "0")
    with pytest.raises(BatchInvarianceUnavailable, match=r"the C library cannot be had here "
                       r"\(DECODESPEC_NATIVE=0\)\.$"):  # fmt: skip
        Engine(models["float32"], ByteTokenizer(), backend="torch", batch_invariant=True)


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_the_commands_report_a_refusal_in_one_line_with_exit_status_2(models, failing_gemm,
                                                                      command):  # fmt: skip
    """`--batch-invariant` where the premise fails: the refusal on stderr, no traceback."""
    out, err = io.StringIO(), io.StringIO()
    model = (models["float32"], ByteTokenizer())
    argv = {"generate": ["generate", "hi", "--raw", "--backend", "spec"],
            "serve": ["serve", "--port", "0", "--backend", "spec"]}[command]  # fmt: skip
    with (
        pytest.MonkeyPatch.context() as patch,
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
    ):
        for module in (cli_generate, cli_serve):
            patch.setattr(module, "load_model_with_progress", lambda *_: model)
        code = cli.main([*argv, "--weights", "float32", "--batch-invariant"])
    assert code == 2
    assert "Traceback" not in err.getvalue()
    assert err.getvalue().startswith("decodespec: error: batch-invariant mode refused for ")
    assert "What works: float32, int8 or int4 weights on the torch backend" in err.getvalue()
