"""The torch backend's native step (`reference/native_step.py`) is the spec's decoder:
`cached_hidden_states` on the same packed weights, with the same cache writes and
errors, and the engine runs it exactly where it applies. Its C attention and append
are the stage contract's operations (`reference/native_attention.py`), which the
conformance suite checks; where the library cannot be built or loaded the engine
says so once and runs the PyTorch path.

Agreement is within QUANT-TOL-1's bfloat16 scale: both compute in float32 and
call the same products, but a norm or attention sum that differs in its last bit
can move an activation's int8 code (QUANT-A8-1), and that difference carries
through the layers.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from decodespec.reference import cpu_linear, native_attention, native_library, native_step
from decodespec.reference.backend import prepare_for_torch
from decodespec.reference.engine import Engine
from decodespec.reference.native_step import NativeStep, unsupported
from decodespec.reference.weight_formats import convert_weights, map_quantized
from decodespec.spec.append import append_kv as spec_append_kv
from decodespec.spec.attention import paged_attention as spec_paged_attention
from decodespec.spec.forward import PagedBatch, cached_hidden_states, rms_norm
from decodespec.spec.params import SamplingParams
from decodespec.spec.registry import RELATIVE
from tests.engine import checkpoints
from tests.engine.toy import ByteTokenizer, random_weights, small_config
from tests.test_harness import run_suite

BF16_RTOL = RELATIVE.rtol[torch.bfloat16]


def quantized_model(fmt: str, seed: int = 0, **overrides) -> object:
    """A small model in `fmt` whose every in_features is a multiple of int4's group."""
    base = dict(hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16)
    config = small_config(**{**base, "max_context": 64, **overrides})
    return convert_weights(random_weights(config, seed=seed), fmt)


def packed_model(fmt: str, seed: int = 0, **overrides) -> object:
    return prepare_for_torch(quantized_model(fmt, seed, **overrides))


def empty_cache(weights, num_blocks: int, block_size: int, seed: int):
    """Per-layer (k, v) caches of random contents (what a slot never written holds)."""
    c, g = weights.config, torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, c.num_kv_heads, c.head_dim)
    return [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(2)]


@st.composite
def passes(draw):
    """A packed pass of a few sequences over a shuffled paged cache: each has some
    positions cached and 0..4 new tokens (one may have none cached: a prompt), and
    a new token may skip its write (slot -1, APPEND-SKIP-1)."""
    block_size = draw(st.sampled_from([1, 4, 16]))
    batch = draw(st.integers(1, 4))
    cached = [draw(st.integers(0, 20)) for _ in range(batch)]
    new = [draw(st.integers(0 if n else 1, 4)) for n in cached]
    blocks_of = [-(-(n + m) // block_size) for n, m in zip(cached, new, strict=True)]
    num_blocks = sum(blocks_of) + 2
    order = draw(st.permutations(range(num_blocks)))
    owned, at = [], 0
    for count in blocks_of:
        owned.append(list(order[at : at + count]))
        at += count
    width = max(max(blocks_of), 1)
    positions, slots, starts = [], [], [0]
    for blocks, n, m in zip(owned, cached, new, strict=True):
        for p in range(n, n + m):
            positions.append(p)
            skip = draw(st.booleans()) and draw(st.booleans()) and draw(st.booleans())
            slots.append(-1 if skip else blocks[p // block_size] * block_size + p % block_size)
        starts.append(starts[-1] + m)
    paged = PagedBatch(
        positions=torch.tensor(positions, dtype=torch.int64),
        query_start=torch.tensor(starts),
        seq_lens=torch.tensor([n + m for n, m in zip(cached, new, strict=True)]),
        block_table=torch.tensor([b + [0] * (width - len(b)) for b in owned]),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        logits_indices=torch.tensor([], dtype=torch.int64),
    )
    return paged, num_blocks, block_size


def assert_close(actual, expected, what):
    if expected.numel() == 0:
        return
    scale = expected.abs().max().clamp(min=1.0)
    err = (actual - expected).abs().max()
    assert err <= BF16_RTOL * scale, f"{what}: max |native − spec| {err:.3g}, scale {scale:.3g}"


def assert_step_is_the_spec(weights, case, seed: int, what: str) -> None:
    """`NativeStep(weights)` on the pass `case` (of `passes()`) against the spec's decoder
    on the same weights: hidden states, cache writes, and the slots not written."""
    paged, num_blocks, block_size = case
    g = torch.Generator().manual_seed(seed)
    token_ids = torch.randint(0, weights.config.vocab_size, paged.positions.shape, generator=g)
    spec_cache = empty_cache(weights, num_blocks, block_size, seed)
    native_cache = [(k.clone(), v.clone()) for k, v in spec_cache]
    expected = cached_hidden_states(weights, token_ids, paged, spec_cache)
    actual = NativeStep(weights)(token_ids, paged, native_cache)
    reproduce = f"{what} seed={seed} {paged}"
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, reproduce
    assert_close(actual, expected, f"hidden states ({reproduce})")
    for (k, v), (k_ref, v_ref) in zip(native_cache, spec_cache, strict=True):
        assert_close(k, k_ref, f"k cache ({reproduce})")
        assert_close(v, v_ref, f"v cache ({reproduce})")
        untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
        untouched[paged.slot_mapping[paged.slot_mapping >= 0]] = False
        flat = k.view(num_blocks * block_size, -1)
        assert torch.equal(flat[untouched], k_ref.view_as(flat)[untouched]), reproduce


@settings(max_examples=25, deadline=None)
@given(
    passes(),
    st.sampled_from(["int4", "int8", "float32"]),
    st.booleans(),
    st.integers(0, 2**16),
)
def test_native_step_is_cached_hidden_states(case, fmt, bias, seed):
    """Hidden states and cache writes of `NativeStep` equal the spec's decoder on the
    same packed weights (FWD-CACHE-1, APPEND-SLOT-1, APPEND-SKIP-1, ATTN-EMPTY-1).
    Random weights: their scales and offsets are float32 values (held in float32);
    `test_native_step_is_cached_hidden_states_on_gguf_shaped_weights` takes the
    float16 ones of a GGUF file."""
    weights = packed_model(fmt, seed=seed % 7, attention_bias=bias)
    assert_step_is_the_spec(weights, case, seed, f"fmt={fmt} bias={bias}")


def step_kernels(weights) -> list[object]:
    """The products `NativeStep` runs, layer by layer: Q/K/V, O, gate/up, down."""
    return [kernel for layer in weights.layers
            for kernel in (layer.q_proj.shared.kernel, layer.o_proj,
                           layer.gate_proj.shared.kernel, layer.down_proj)]  # fmt: skip


def with_float16_scales(weights):
    """int8 per channel whose scales are float16 values, as Q8_0's are (held in
    float16: the table's 8-bit path with its flag set)."""
    return map_quantized(weights, lambda w: dataclasses.replace(w, scales=w.scales.half().float()))


# How the default path holds a GGUF file's projections: 4-bit blocks kept as the file has
# them (Q4_1: the bundled file's, offsets its minimums; Q4_0: offsets -8d), the tied
# embedding's Q8_0 values; and 8-bit codes with float16 scales. Every product's scales and
# offsets are float16 values: the C product holds them in float16 (`half`).
GGUF_SHAPED = {
    "Q4_1": lambda model: checkpoints.gguf_shaped(model, "Q4_1"),
    "Q4_0": lambda model: checkpoints.gguf_shaped(model, "Q4_0"),
    "int8, float16 scales": lambda model: with_float16_scales(convert_weights(model, "int8")),
}
_GGUF_MODELS: dict[tuple[str, bool, int], object] = {}


def gguf_shaped_model(layout: str, bias: bool, seed: int) -> object:
    """`packed_model`'s toy (tied embedding) laid out as `GGUF_SHAPED[layout]`, packed for
    the torch backend; one per arguments (quantizing through gguf-py takes a while)."""
    key = (layout, bias, seed)
    if key not in _GGUF_MODELS:
        base = dict(hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2,
                    head_dim=16, max_context=64)  # fmt: skip
        config = small_config(**base, attention_bias=bias, tie_word_embeddings=True)
        _GGUF_MODELS[key] = prepare_for_torch(GGUF_SHAPED[layout](random_weights(config, seed)))
    return _GGUF_MODELS[key]


@pytest.mark.parametrize("layout", sorted(GGUF_SHAPED))
@settings(max_examples=10, deadline=None)
@given(case=passes(), bias=st.booleans(), seed=st.integers(0, 2**16))
def test_native_step_is_cached_hidden_states_on_gguf_shaped_weights(layout, case, bias, seed):
    """The same on the weights the default path runs (`make run`, `decodespec serve`):
    a GGUF file's float16 scales and offsets, which the C product holds in float16 and
    reads by the flag the step's table passes it (the random weights above never have
    it set). Every product here has it set, checked first: a layout that lost it would
    test nothing new."""
    weights = gguf_shaped_model(layout, bias, seed % 3)
    assert all(kernel.half for kernel in step_kernels(weights)), layout
    assert_step_is_the_spec(weights, case, seed, f"layout={layout} bias={bias}")


@settings(max_examples=20, deadline=None)
@given(
    st.integers(1, 5),
    st.sampled_from([8, 13, 64, 576]),
    st.sampled_from([1.0, 40.0]),
    st.integers(0, 2**16),
)
def test_norm_and_silu_loops_are_the_spec_steps(tokens, width, scale, seed):
    """`add_rms_norm` is FWD-LAYER-1's residual add and FWD-NORM-1's `rms_norm`;
    `silu_mul` is FWD-MLP-1's `silu(gate) · up`: each PyTorch's to float32's rounding
    (a float32 sum in another order; SiLU's exp a polynomial), gates far into both
    tails included; a row's SiLU has the same bits computed alone."""
    lib, ptr = native_library.library(), torch.Tensor.data_ptr
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, width, generator=g) * 3
    add = torch.randn(tokens, 2 * width, generator=g) * scale  # rows 2·width apart
    weight = 1 + 0.1 * torch.randn(width, generator=g)
    out = torch.empty(tokens, width)
    expected_x = x + add[:, :width]
    expected = rms_norm(expected_x, weight, 1e-5)
    lib.add_rms_norm(ptr(x), ptr(add), 2 * width, ptr(weight), 1e-5, ptr(out), tokens, width)
    where = f"tokens={tokens} width={width} seed={seed}"
    assert torch.equal(x, expected_x), where
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6, msg=where)
    mlp = torch.empty(tokens, width)
    lib.silu_mul(ptr(add), 2 * width, width, ptr(mlp), tokens)
    gate, up = add.split(width, dim=1)
    expected_mlp = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(mlp, expected_mlp, rtol=1e-5, atol=1e-6, msg=where)
    last_row, last = add[-1:].clone(), torch.empty(1, width)
    lib.silu_mul(ptr(last_row), 2 * width, width, ptr(last), 1)
    assert torch.equal(last, mlp[-1:]), where


def decode_pass(weights, block_size=4, cached=3):
    """One decode token after `cached` positions, in a cache of random contents."""
    slot = cached  # blocks 0, 1, ... in order
    paged = PagedBatch(
        positions=torch.tensor([cached]),
        query_start=torch.tensor([0, 1]),
        seq_lens=torch.tensor([cached + 1]),
        block_table=torch.tensor([[0, 1]]),
        slot_mapping=torch.tensor([slot]),
        logits_indices=torch.tensor([0]),
    )
    return torch.tensor([5]), paged, empty_cache(weights, 2, block_size, 0)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(slot_mapping=torch.tensor([8])), "slot_mapping[0] = 8"),
        (dict(block_table=torch.tensor([[7, 1]])), "block_table[0, 0] = 7"),
        (dict(seq_lens=torch.tensor([9])), "seq_lens[0] = 9"),
        (dict(query_start=torch.tensor([0, 2])), "query_start must start at 0 and end"),
        (dict(positions=torch.tensor([3, 4])), "same length"),
    ],
)
def test_bad_pass_is_refused_before_anything_is_written(change, message):
    """ATTN-VALID-1 and APPEND-VALID-1, with the spec's messages; no cache is touched."""
    weights = packed_model("int4")
    token_ids, paged, cache = decode_pass(weights)
    before = [(k.clone(), v.clone()) for k, v in cache]
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        NativeStep(weights)(token_ids, dataclasses.replace(paged, **change), cache)
    for (k, v), (k0, v0) in zip(cache, before, strict=True):
        assert torch.equal(k, k0) and torch.equal(v, v0)


def test_bad_tokens_and_caches_are_refused():
    weights = packed_model("int4")
    step = NativeStep(weights)
    token_ids, paged, cache = decode_pass(weights)
    step(token_ids, paged, cache)  # good caches first: their checks are remembered, not others'
    with pytest.raises(ValueError, match=r"token_ids must be in \[0, 260\)"):
        step(torch.tensor([260]), paged, cache)
    with pytest.raises(ValueError, match="kv_cache has 1 layers, the model 2"):
        step(token_ids, paged, cache[:1])
    with pytest.raises(ValueError, match="contiguous float32 KV caches"):
        step(token_ids, paged, [(k.double(), v.double()) for k, v in cache])
    with pytest.raises(ValueError, match="contiguous float32 KV caches"):
        step(token_ids, paged, [(k.transpose(0, 1), v) for k, v in cache])
    with pytest.raises(ValueError, match="every layer's KV cache must have one shape"):
        step(token_ids, paged, [cache[0], (cache[1][0], cache[1][1][:-1])])


def test_models_it_does_not_take_say_why():
    dense = random_weights(small_config())  # not packed: PyTorch's GEMM
    assert "not one CPU kernel" in unsupported(dense)
    bf16 = prepare_for_torch(convert_weights(random_weights(small_config()), "bfloat16"))
    assert "float32 activations" in unsupported(bf16)
    with pytest.raises(ValueError, match="not one CPU kernel"):
        NativeStep(dense)
    # Q, K and V of different layouts are three kernel calls, not one.
    weights = quantized_model("int4")
    layer = weights.layers[0]
    k = layer.k_proj
    regrouped = dataclasses.replace(
        k, scales=k.scales[:, ::2], offsets=k.offsets[:, ::2], group_size=64
    )
    weights.layers[0] = dataclasses.replace(layer, k_proj=regrouped)
    assert "layer 0's Q/K/V" in unsupported(cpu_linear.pack_for_cpu(weights))
    assert native_step.native_step(dense) is None
    assert isinstance(native_step.native_step(packed_model("int8")), NativeStep)
    assert isinstance(native_step.native_step(prepare_for_torch(dense)), NativeStep)  # float32


def test_the_engine_runs_it_for_short_passes_only(monkeypatch):
    """Passes of up to `max_tokens` tokens run the native step; longer ones (a long
    prompt) the spec's decoder with the batched stages. Either way the output is
    the spec loop's (tests/engine/test_weight_formats.py checks the tokens). The
    engine's token budget keeps every pass within `max_tokens` (a budget of None
    becomes it); a longer pass is the runner's fallback, tried here by lowering
    `max_tokens` after the engine is built."""
    engine = Engine(packed_model("int4"), ByteTokenizer(), backend="torch", cache_tokens=256,
                    token_budget=None)  # prompts in one pass  # fmt: skip
    runner = engine.runner
    assert isinstance(runner.native, NativeStep)
    monkeypatch.setattr(runner.native, "max_tokens", 16)  # MAX_TOKENS: the toy's context is 64
    sizes = []
    native_call = NativeStep.__call__

    def spy(self, token_ids, paged, kv_cache):
        sizes.append(token_ids.shape[0])
        return native_call(self, token_ids, paged, kv_cache)

    monkeypatch.setattr(NativeStep, "__call__", spy)
    long_prompt = list(range(runner.native.max_tokens + 8))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    tokens = [e.token_id for e in engine.generate(long_prompt, params) if e.token_id is not None]
    assert len(tokens) == 4
    assert sizes == [1, 1, 1], "the prompt's pass ran on the spec's decoder"
    sizes.clear()
    fresh = list(range(100, 100 + runner.native.max_tokens))  # no prefix in the cache
    list(engine.generate(fresh, params))
    assert sizes[0] == runner.native.max_tokens


# ---------------------------------------------------------------- the stage contract


def test_the_conformance_suite_passes_its_attention_and_append():
    """The attention, append and batch-invariance tests run against the C functions the
    decode step calls and pass; the only skips are the dtypes it declares unsupported."""
    run = run_suite(
        "tests/conformance/test_attention.py",
        "tests/conformance/test_append_kv.py",
        "tests/conformance/test_batch_invariance.py::test_a_sequence_has_the_same_bits_alone_and_in_any_batch",
        "--impl=decodespec.reference.native_attention",
    )
    assert run.returncode == 0, run.stdout[-3000:]
    skips = re.findall(r"SKIPPED \[\d+\] .*", run.stdout)
    assert all("computes float32 only" in line for line in skips), skips
    passed = int(re.search(r"(\d+) passed", run.stdout).group(1))
    assert passed >= 90, run.stdout[-2000:]


@pytest.mark.clause("ATTN-INVARIANT-1")
def test_attention_has_the_same_bits_on_one_thread_as_on_several():
    """The tiles of (token, head) pairs are split among the threads, each pair computed
    alone in one order: the bits do not depend on the number of threads (nor on the pool
    being busy)."""
    g = torch.Generator().manual_seed(5)
    k_cache, v_cache = torch.randn(2, 6, 4, 2, 16, generator=g)
    q = torch.randn(7, 6, 16, generator=g)
    index = dict(block_table=torch.tensor([[0, 3, 1], [2, 4, 5]]), seq_lens=torch.tensor([9, 11]),
                 query_start=torch.tensor([0, 3, 7]))  # fmt: skip
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3, 8):
            torch.set_num_threads(n)
            outs.append(native_attention.paged_attention(q, k_cache, v_cache, **index,
                                                         return_lse=True))  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    for out, lse in outs[1:]:
        assert torch.equal(out, outs[0][0]) and torch.equal(lse, outs[0][1])


@pytest.mark.clause("ATTN-INVARIANT-1")
@pytest.mark.parametrize("q_len", [1, 7, 8, 9, 20, 40])
@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_a_query_token_has_its_bits_alone_in_any_tile(q_len, head_dim):
    """Query tokens of a sequence are attended in tiles of eight, with the query heads
    of a KV head (`TILE_TOKENS`): each token of a prompt chunk has the bits it has as a
    one-token query over its own context (how a chunk cut elsewhere, a cached prefix or
    a decode step computes it), GQA groups of three; head_dim 64 and 128 take the AVX2
    loops (on a CPU that has them), others the plain C ones. A unit takes a KV head's three query
    heads when there are enough units for the threads (40 tokens), one head otherwise."""
    g = torch.Generator().manual_seed(q_len)
    k_cache, v_cache = torch.randn(2, 16, 4, 2, head_dim, generator=g)
    q = torch.randn(q_len, 6, head_dim, generator=g)
    seq_len = q_len + 5  # five positions cached before the chunk
    table = torch.randperm(16, generator=g)[None]
    out, lse = native_attention.paged_attention(
        q, k_cache, v_cache, block_table=table, seq_lens=torch.tensor([seq_len]),
        query_start=torch.tensor([0, q_len]), return_lse=True,
    )  # fmt: skip
    spec_out = spec_paged_attention(q, k_cache, v_cache, block_table=table,
                                    seq_lens=torch.tensor([seq_len]),
                                    query_start=torch.tensor([0, q_len]))  # fmt: skip
    torch.testing.assert_close(out, spec_out, rtol=1e-5, atol=1e-5)
    for t in range(q_len):
        alone, alone_lse = native_attention.paged_attention(
            q[t : t + 1], k_cache, v_cache, block_table=table,
            seq_lens=torch.tensor([seq_len - q_len + t + 1]), query_start=torch.tensor([0, 1]),
            return_lse=True,
        )  # fmt: skip
        assert torch.equal(alone[0], out[t]) and torch.equal(alone_lse[0], lse[t]), t


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_append_takes_every_cache_dtype_bit_for_bit(dtype):
    """The C append copies rows already rounded to the cache's dtype: the spec's bits
    for each dtype the suite skips (the module declares them for its attention)."""
    g = torch.Generator().manual_seed(3)
    key, value = torch.randn(2, 5, 3, 8, generator=g)
    cache = torch.randn(2, 4, 4, 3, 8, generator=g).to(dtype)
    slots = torch.tensor([9, -1, 0, 15, 4], dtype=torch.int32)
    ours, spec = [c.clone() for c in cache], [c.clone() for c in cache]
    native_attention.append_kv(key, value, *ours, slots)
    spec_append_kv(key, value, *spec, slots)
    for a, b in zip(ours, spec, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_attention_refuses_what_the_c_code_does_not_compute():
    q = torch.randn(1, 2, 8, dtype=torch.float16)
    cache = torch.randn(1, 4, 1, 8, dtype=torch.float16)
    index = dict(block_table=torch.tensor([[0]]), seq_lens=torch.tensor([1]),
                 query_start=torch.tensor([0, 1]))  # fmt: skip
    with pytest.raises(NotImplementedError, match=r"float32 only, got q of torch\.float16"):
        native_attention.paged_attention(q, cache, cache.clone(), **index)
    with pytest.raises(ValueError, match="k_cache is on meta: the native step's C code"):
        native_attention.append_kv(
            q[0].float(), q[0].float(), cache.float().to("meta"), cache.float().to("meta"),
            torch.tensor([0, 1]).to("meta"), validate=False,
        )  # fmt: skip


# ---------------------------------------------------------------- where C cannot run


@pytest.fixture
def fresh_library(monkeypatch, tmp_path):
    """This process's library state forgotten, and a cache directory of our own: the
    next `native_step` builds (or fails to) as a new process would."""
    monkeypatch.setattr(native_library, "_LIBRARY", None)
    monkeypatch.setattr(native_library, "_FAILURE", None)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("DECODESPEC_NATIVE", raising=False)
    return tmp_path


def no_compiler(monkeypatch, folder) -> None:
    monkeypatch.setenv("CC", str(folder / "no-such-cc"))


def broken_compiler(monkeypatch, folder) -> None:
    """A compiler that fails as cc does on a broken toolchain."""
    script = folder / "broken-cc"
    script.write_text(
        "#!/bin/sh\necho 'In file included from native_step.c:1:' >&2\n"
        "echo 'fatal error: math.h: No such file or directory' >&2\nexit 1\n"
    )
    script.chmod(0o755)
    monkeypatch.setenv("CC", str(script))


def unwritable_cache(monkeypatch, folder) -> None:
    """A cache path through a regular file: unwritable even for root, as a read-only home."""
    (folder / "file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(folder / "file"))


def unloadable_library(monkeypatch, folder) -> None:
    """A library file in place that does not load (what a noexec cache directory, or a
    damaged file, makes of a good one)."""
    path = native_library.library_path()
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not an ELF file")


FAILURES = {
    "no compiler": (no_compiler, "no C compiler ('"),
    "compile error": (
        broken_compiler,
        "failed on native_step.c + native_attention.c + native_quantized.c + native_dense.c: "
        "fatal error: math.h: No such file",
    ),
    "unwritable cache": (unwritable_cache, "cannot build in"),
    "library does not load": (unloadable_library, "cannot load"),
}


@pytest.mark.parametrize("failure", sorted(FAILURES))
def test_a_library_that_cannot_be_had_turns_the_step_off_in_one_line(
    failure, fresh_library, monkeypatch, capsys
):
    """Any failure to build or load the library, OSError included: one line on stderr
    (once a process), `status` says why, and the engine runs the PyTorch path."""
    arrange, reason = FAILURES[failure]
    arrange(monkeypatch, fresh_library)
    weights = packed_model("int4")
    assert native_step.native_step(weights) is None
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("decodespec: C library off ("), err
    assert reason in err and err.rstrip().endswith("running PyTorch's kernels"), err
    assert native_step.status(weights).startswith("off: ") and reason in native_step.status()
    engine = Engine(weights, ByteTokenizer(), backend="torch", cache_tokens=256)
    assert engine.runner.native is None
    assert capsys.readouterr().err == "", "the failure is reported once a process"
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    tokens = [e.token_id for e in engine.generate([1, 2, 3], params) if e.token_id is not None]
    assert len(tokens) == 3


def test_status_names_the_path(fresh_library, monkeypatch):
    weights = packed_model("int4")
    step = native_step.native_step(weights)
    assert isinstance(step, NativeStep)
    assert re.fullmatch(r"native step \(C, cc [\w .()+-]+\)", step.description), step.description
    assert native_step.status(weights) == native_step.status() == step.description
    dense = random_weights(small_config())  # not packed: PyTorch's GEMM
    assert native_step.status(dense) == f"off: {unsupported(dense)}"
    monkeypatch.setenv("DECODESPEC_NATIVE", "0")
    assert native_step.status(weights) == "off: DECODESPEC_NATIVE=0"


def test_no_compiler_says_so_and_runs_pytorch(tmp_path):
    """Without a C compiler the backend runs PyTorch's path and says so on stderr (a
    process of its own: nothing here has loaded the library before)."""
    script = (
        "from decodespec.reference import native_step\n"
        "from tests.engine.test_native_step import packed_model\n"
        "assert native_step.native_step(packed_model('int4')) is None\n"
    )
    env = {"CC": str(tmp_path / "no-such-cc"), "XDG_CACHE_HOME": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-c", script], env={**os.environ, **env}, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert "C library off (no C compiler" in result.stderr
    off = subprocess.run(
        [sys.executable, "-c", script.replace("is None", "is None, 'DECODESPEC_NATIVE'")],
        env={**os.environ, "DECODESPEC_NATIVE": "0"},
        capture_output=True,
        text=True,
    )
    assert off.returncode == 0 and "native" not in off.stderr, off.stderr
