"""Weight formats (`--weights`): the CPU kernels compute the spec's quantized linear,
and every engine configuration runs every format as the spec loop does.

The spec loop runs on the engine's own weights (`engine.weights`, after the
backend prepared them): what batching, caching, preemption and speculation
may not change is the same for every format (SEMANTICS.md). Whether a format's
kernel computes QUANT-LINEAR-1 is checked on its own, against the definition
in float64; how far each format's outputs move from float32 is a measurement
(`decodespec perplexity`, `make bench-quant`), not a test.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
from pathlib import Path
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from decodespec.reference import cpu_linear, native_library
from decodespec.reference.engine import Engine
from decodespec.reference.weight_formats import (
    PROJECTIONS,
    WEIGHT_FORMATS,
    LoadSummary,
    convert_weights,
    describe,
    weight_bytes,
)
from decodespec.spec.forward import forward_naive
from decodespec.spec.params import SamplingParams
from decodespec.spec.quant import (
    QuantizedWeight,
    activation_quantized_linear,
    pack_codes,
    quantize_activations,
    quantize_weight,
    quantized_linear,
)
from decodespec.spec.registry import RELATIVE
from tests.engine import test_engine_vs_spec
from tests.engine import test_structured_outputs as structured
from tests.engine.test_engine_vs_spec import run_workload, workloads
from tests.engine.toy import ByteTokenizer, random_weights, small_config

BF16_RTOL = RELATIVE.rtol[torch.bfloat16]  # QUANT-TOL-1
# The CPU kernels take bfloat16 inputs (and bfloat16 models compute in it), whose batch
# variance (a row computed in a batch of 1 or of 4 takes another kernel path) is of
# order 2^-8 of a logit:
# near ties are decided as in test_engine_vs_spec, at this scale.
BF16_NEAR_TIE = 0.1


def check_all(engine, ids, events, skip=()):
    """test_engine_vs_spec.check_all on the engine's own weights, at bfloat16's scale."""
    with mock.patch.object(test_engine_vs_spec, "NEAR_TIE", BF16_NEAR_TIE):
        test_engine_vs_spec.check_all(engine, engine.weights, ids, events, skip)


def formats_config(**overrides):
    """A small model whose every in_features is a multiple of 32 (int4's group)."""
    base = dict(hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16)
    return small_config(**{**base, "max_context": 64, **overrides})


def model(seed: int, fmt: str, **overrides):
    return convert_weights(random_weights(formats_config(**overrides), seed=seed), fmt)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


def kernel_error(out: torch.Tensor, x: torch.Tensor, weight: QuantizedWeight) -> float:
    """QUANT-TOL-1's error: against the definition in float64, relative to the larger
    of its norm and the size of the terms summed (`‖|x| · |W|ᵀ‖ / √K`)."""
    want = definition(x, weight)
    terms = x.double().abs() @ weight.dequantize().double().abs().T
    scale = max(float(want.norm()), float(terms.norm()) / x.shape[1] ** 0.5)
    return float((out.double() - want).norm()) / scale


def definition(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    return quantized_linear(
        x.double(),
        weight.qweight,
        weight.scales.double(),
        weight.offsets.double(),
        group_size=weight.group_size,
        bits=weight.bits,
    )


# ---------------------------------------------------------------- the CPU kernels


@pytest.mark.clause("QUANT-LINEAR-1", "QUANT-TOL-1")
@settings(max_examples=25)
@given(
    rows=st.integers(1, 70),
    groups=st.integers(1, 4),
    group_size=st.sampled_from((32, 64, 128)),
    batch=st.integers(1, 9),
    seed=st.integers(0, 2**32 - 1),
)
def test_the_cpu_int4_kernel_computes_the_quantized_linear(rows, groups, group_size, batch, seed):
    """Any row count (the kernel packs 16 rows: padding must not leak), any group
    size it takes; bfloat16 activations, the formats' (float32 ones are rounded to
    bfloat16 inside, which only the bfloat16 tolerance admits)."""
    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(seed)
    columns = groups * group_size
    weight = quantize_weight(torch.randn(rows, columns, generator=g), bits=4, group_size=group_size)
    x = torch.randn(batch, columns, generator=g).to(dtype)
    out = cpu_linear.CpuInt4Linear(weight).linear(x)
    assert out.shape == (batch, rows) and out.dtype == dtype
    assert kernel_error(out, x, weight) < BF16_RTOL


@pytest.mark.clause("QUANT-LINEAR-1", "QUANT-TOL-1")
@settings(max_examples=25)
@given(
    rows=st.integers(1, 70),
    columns=st.sampled_from((16, 32, 48, 96, 160)),
    batch=st.integers(1, 9),
    seed=st.integers(0, 2**32 - 1),
)
def test_the_cpu_int8_kernel_computes_the_quantized_linear(rows, columns, batch, seed):
    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(seed)
    weight = quantize_weight(torch.randn(rows, columns, generator=g), bits=8, group_size=columns)
    x = torch.randn(batch, columns, generator=g).to(dtype)
    out = cpu_linear.CpuInt8Linear(weight).linear(x)
    assert out.shape == (batch, rows) and out.dtype == dtype
    assert kernel_error(out, x, weight) < BF16_RTOL


def test_the_cpu_kernels_restore_the_weights_they_multiply():
    g = torch.Generator().manual_seed(0)
    dense = torch.randn(24, 64, generator=g)
    for weight in (
        quantize_weight(dense, bits=4, group_size=32),
        quantize_weight(dense, bits=8, group_size=64),
    ):
        packed = cpu_linear.pack(weight)
        assert packed.shape == weight.shape == (24, 64)
        assert relative_error(packed.dequantize(), weight.dequantize().double()) < BF16_RTOL


@pytest.mark.parametrize(
    "weight, message",
    [
        (quantize_weight(torch.randn(16, 32), bits=4, group_size=16), "groups of"),
        (quantize_weight(torch.randn(16, 40), bits=8, group_size=40), "multiple of 16"),
        (quantize_weight(torch.randn(16, 64), bits=8, group_size=32), "one scale per row"),
    ],
)
def test_a_layout_no_cpu_kernel_takes_is_refused_naming_the_projection(weight, message):
    """Never a crash or garbage inside the kernel (PyTorch's int8 kernel returns
    garbage for in_features 8 and crashes for 33): refused before it runs."""
    weights = random_weights(small_config(hidden_size=32, intermediate_size=64), seed=0)
    layers = [dataclasses.replace(weights.layers[0], up_proj=weight), *weights.layers[1:]]
    broken = dataclasses.replace(weights, layers=layers)
    with pytest.raises(ValueError, match=message) as error:
        cpu_linear.pack_for_cpu(broken)
    assert "layer 0 up_proj" in str(error.value)


@pytest.mark.parametrize("bits", [4, 8])
def test_siblings_of_one_input_share_a_kernel_call_and_equal_their_own(bits):
    """Q, K and V packed as one matrix (SharedInput): each member's product is its own
    kernel's, bit for bit, whatever the order of the calls and whatever the input."""
    g = torch.Generator().manual_seed(bits)
    weights = [
        quantize_weight(
            torch.randn(rows, 64, generator=g), bits=bits, group_size=32 if bits == 4 else 64
        )
        for rows in (48, 16, 16)
    ]
    members = cpu_linear.SharedInput(weights).members
    alone = [cpu_linear.pack(w) for w in weights]
    calls = 0
    kernel = members[0].shared.kernel
    original = kernel.linear

    def counted(x):
        nonlocal calls
        calls += 1
        return original(x)

    kernel.linear = counted
    x, y = (torch.randn(3, 64, generator=g) for _ in range(2))
    for order in ([0, 1, 2], [2, 0, 1]):
        for inputs in (x, y):
            for i in order:
                assert torch.equal(members[i].linear(inputs), alone[i].linear(inputs)), (order, i)
    assert calls == 4, "one kernel call per input (y, x, y after x)"
    assert members[1].shape == (16, 64)
    assert torch.equal(members[2].dequantize(), alone[2].dequantize())


F32_RTOL = RELATIVE.rtol[torch.float32]  # QUANT-TOL-1
# How a weight's scales and offsets are drawn: float32 values (held in float32),
# float16 values (held in float16, as GGUF's), and float16 values with the 8-bit
# weight's offsets nonzero (which it then holds).
FIELDS = ("float32", "float16", "float16, offsets")


def with_fields(weight: QuantizedWeight, fields: str, seed: int = 0) -> QuantizedWeight:
    """`weight` with scales and offsets as `fields` says (see FIELDS)."""
    if fields == "float32":
        return weight
    offsets = weight.offsets
    if fields == "float16, offsets":
        g = torch.Generator().manual_seed(seed)
        offsets = offsets + torch.randn(offsets.shape, generator=g) * weight.scales.abs()
    halves = dataclasses.replace(weight, scales=weight.scales.half().float(),
                                 offsets=offsets.half().float())  # fmt: skip
    return halves


def a8_error(out: torch.Tensor, x: torch.Tensor, weight: QuantizedWeight) -> float:
    """QUANT-TOL-1's error against QUANT-A8-1's definition (in float64)."""
    want = activation_quantized_linear(x.double(), weight.qweight, weight.scales.double(),
                                       weight.offsets.double(), group_size=weight.group_size,
                                       bits=weight.bits)  # fmt: skip
    terms = x.double().abs() @ weight.dequantize().double().abs().T
    scale = max(float(want.norm()), float(terms.norm()) / x.shape[1] ** 0.5)
    return float((out.double() - want).norm()) / scale


@pytest.mark.clause("QUANT-A8-1", "QUANT-TOL-1")
@settings(max_examples=30)
@given(
    bits=st.sampled_from((4, 8)),
    rows=st.integers(1, 70),
    groups=st.integers(1, 4),
    group_size=st.sampled_from((32, 64, 96)),
    tokens=st.integers(1, 150),
    dtype=st.sampled_from((torch.float32, torch.bfloat16, torch.float16)),
    fields=st.sampled_from(FIELDS),
    seed=st.integers(0, 2**32 - 1),
)
def test_the_c_product_computes_the_activation_quantized_linear(
    bits, rows, groups, group_size, tokens, dtype, fields, seed
):
    """`ActivationQuantizedLinear` (`native_quantized.c`'s integer product) against the
    definition at float32's tolerance, whatever the activations' dtype, the number of
    tokens and the scales' and offsets' values (held in float16 where they all are
    float16 values); and each row's product is the row's alone (computed by itself: the
    same bits)."""
    g = torch.Generator().manual_seed(seed)
    columns = groups * group_size
    group = group_size if bits == 4 else columns
    weight = quantize_weight(torch.randn(rows, columns, generator=g), bits=bits, group_size=group)
    weight = with_fields(weight, fields, seed)
    kernel = cpu_linear.pack(weight)
    assert isinstance(kernel, cpu_linear.ActivationQuantizedLinear)
    assert kernel.half == (fields != "float32")
    x = (torch.randn(tokens, columns, generator=g) * 3).to(dtype)
    out = kernel.linear(x)
    assert out.shape == (tokens, rows) and out.dtype == dtype
    tolerance = F32_RTOL if dtype == torch.float32 else RELATIVE.rtol[dtype]  # output rounding
    assert a8_error(out, x, weight) < tolerance
    assert torch.equal(kernel.linear(x[-1:]), out[-1:])


CHUNK_CASES = [
    (bits, per_group, blocks, fields)
    for bits, per_group in ((4, 1), (4, 2), (8, 1), (8, None))
    for blocks in (1, 6, 7, 8, 9, 16, 18, 20, 23)
    for fields in (FIELDS[:2] if bits == 4 else FIELDS)
    if per_group is None or blocks % per_group == 0
]


@pytest.mark.clause("QUANT-A8-1", "QUANT-TOL-1")
@pytest.mark.parametrize(("bits", "blocks_per_group", "blocks", "fields"), CHUNK_CASES)
def test_the_c_product_at_each_chunk_boundary(bits, blocks_per_group, blocks, fields):
    """The 8-bit AVX2 loops sum eight blocks to a vector and take the blocks past the
    last whole chunk one at a time; the 4-bit tiles go block by block, their scales laid
    out per block: K of 1 to 23 blocks, groups of one block (GGUF's), two, and whole
    rows (per-channel int8), 37 weight rows (a last tile of five), scales and offsets
    held in float32 and in float16 (8-bit: with and without offsets), against the
    definition at float32's tolerance; a row of the five (four of them computed
    together) has the bits it has alone."""
    g = torch.Generator().manual_seed(blocks * 10 + bits)
    columns = blocks * 32
    group = columns if blocks_per_group is None else blocks_per_group * 32
    weight = quantize_weight(torch.randn(37, columns, generator=g), bits=bits, group_size=group)
    weight = with_fields(weight, fields, blocks)
    kernel = cpu_linear.pack(weight)
    assert kernel.half == (fields != "float32")
    x = torch.randn(5, columns, generator=g) * 3
    out = kernel.linear(x)
    assert a8_error(out, x, weight) < F32_RTOL
    assert torch.equal(kernel.linear(x[2:3]), out[2:3])


@pytest.mark.clause("QUANT-A8-1")
@pytest.mark.parametrize(("bits", "group"), [(4, 32), (8, 32), (8, 64)])
@pytest.mark.parametrize("fields", FIELDS[1:])
def test_float16_fields_give_the_bits_of_float32_ones(bits, group, fields, monkeypatch):
    """A weight whose scales and offsets are float16 values (GGUF's) is held with them
    in float16, a sixth fewer bytes (4-bit tiles; 8-bit weights without offsets hold
    none), and its products have the bits of the same weight held in float32, at 1 to
    9 tokens (every row count of the tiles' loops) and 40 (threaded); 8-bit groups of
    one block (widened eight at a time, then the rest) and of two."""
    g = torch.Generator().manual_seed(bits)
    columns = 320  # 10 blocks
    weight = quantize_weight(torch.randn(45, columns, generator=g), bits=bits, group_size=group)
    weight = with_fields(weight, fields)
    half = cpu_linear.pack(weight)
    with monkeypatch.context() as patch:
        patch.setattr(cpu_linear, "_as_float16", lambda _array: None)
        full = cpu_linear.pack(weight)
    assert half.half and not full.half
    if bits == 4:  # a tile's block: 128 bytes of codes, 8 scales and 8 offsets
        assert half.nbytes * 192 == full.nbytes * 160
    else:  # codes, then a row's scales and its offsets where they are not all zero
        groups, fields_held = columns // group, 2 if fields == "float16, offsets" else 1
        assert full.nbytes == 45 * (columns + groups * 4 * fields_held)
        assert half.nbytes == 45 * (columns + groups * 2 * fields_held)
    x = torch.randn(40, columns, generator=g) * 3
    for tokens in (*range(1, 10), 40):
        assert torch.equal(half.linear(x[:tokens]), full.linear(x[:tokens])), tokens
    assert torch.equal(half.dequantize(), weight.dequantize())


@pytest.mark.clause("QUANT-A8-1")
@settings(max_examples=30)
@given(
    tokens=st.integers(1, 9),
    blocks=st.integers(1, 20),
    scale=st.sampled_from((1e-30, 1e-3, 1.0, 3.0, 1e30)),
    ties=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_the_c_activation_codes_are_the_specs_bit_for_bit(tokens, blocks, scale, ties, seed):
    """`native_quantized.c`'s activation quantization (its AVX2 form, or its scalar one
    under `DECODESPEC_NATIVE_ISA=scalar`) against `spec.quant.quantize_activations`: the
    same codes and scales, bit for bit, with zero blocks and values that round half way."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, blocks * 32, generator=g) * scale
    if ties:  # absmax 127 makes the scale 1: every x.5 is a tie, broken to even
        x = torch.randint(-254, 255, x.shape, generator=g).float() / 2
        x[:, ::32] = 127.0
    x[:, 32:64] = 0.0  # a zero block: scale 0, codes 0
    codes = torch.empty(x.shape, dtype=torch.int8)
    scales = torch.empty(tokens, blocks)
    native_library.library().quantize_activations(
        x.data_ptr(), tokens, x.shape[1], codes.data_ptr(), scales.data_ptr()
    )
    want_codes, want_scales = quantize_activations(x)
    assert torch.equal(codes, want_codes)
    assert torch.equal(scales, want_scales)


def test_the_c_products_threads_serve_two_callers_and_a_forked_child():
    """The product's row threads (`native_quantized.c`'s pool) with two Python threads
    calling at once (ctypes releases the GIL), and in a child forked after the pool
    started: every result is the one-thread result, bit for bit, and nothing hangs."""
    g = torch.Generator().manual_seed(7)
    kernels = [cpu_linear.pack(quantize_weight(torch.randn(300, 96, generator=g), bits=4,
                                               group_size=32)) for _ in range(2)]  # fmt: skip
    inputs = [torch.randn(3, 96, generator=g) for _ in range(2)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        alone = [k.linear(x) for k, x in zip(kernels, inputs, strict=True)]
        torch.set_num_threads(2)
        results: list[list[bool]] = [[], []]

        def call(i: int) -> None:
            for _ in range(200):
                results[i].append(torch.equal(kernels[i].linear(inputs[i]), alone[i]))

        workers = [threading.Thread(target=call, args=(i,)) for i in range(2)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(timeout=60)
        assert not any(w.is_alive() for w in workers), "a caller hangs"
        assert all(results[0]) and all(results[1]) and len(results[0]) == 200
        pid = os.fork()
        if pid == 0:  # the child: its parent's pool threads do not exist here
            same = torch.equal(kernels[0].linear(inputs[0]), alone[0])
            os._exit(0 if same else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        torch.set_num_threads(threads)


@pytest.mark.clause("QUANT-A8-1")
def test_the_scalar_loops_of_cpus_without_avx2_compute_it_too():
    """`DECODESPEC_NATIVE_ISA=scalar` runs the product's and the attention's plain C loops
    (what a CPU without AVX2 runs); the product's tests above, the row-blocked bits and
    the attention's bits in any tile pass on them."""
    env = {**os.environ, "DECODESPEC_NATIVE_ISA": "scalar", "HYPOTHESIS_PROFILE": "ci"}
    code = (
        "from decodespec.reference import native_library as n; print(n.library().quantized_isa())"
    )
    isa = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True, timeout=600).stdout  # fmt: skip
    assert isa.strip() == "b'scalar'"
    here = "tests/engine/test_weight_formats.py"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         f"{here}::test_the_c_product_computes_the_activation_quantized_linear",
         f"{here}::test_the_c_products_threads_serve_two_callers_and_a_forked_child",
         f"{here}::test_the_c_product_at_each_chunk_boundary",
         f"{here}::test_float16_fields_give_the_bits_of_float32_ones",
         f"{here}::test_the_c_activation_codes_are_the_specs_bit_for_bit",
         "tests/engine/test_batch_invariance.py::"
         "test_a_row_blocked_quantized_projection_gives_each_row_the_same_bits",
         "tests/engine/test_native_step.py::test_a_query_token_has_its_bits_alone_in_any_tile"],
        cwd=Path(__file__).resolve().parents[2], env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:]
    # 3 property tests, the chunk cases, 6 float16 cases, 16 row-blocked cases and 18
    # tile cases: none skipped
    assert f"{3 + len(CHUNK_CASES) + 6 + 16 + 18} passed" in run.stdout, run.stdout[-1000:]


@pytest.mark.clause("QUANT-GROUP-1", "QUANT-CODES-1")
@pytest.mark.parametrize("rows", [1, 8, 13])
@pytest.mark.parametrize("group_size", [32, 64, 96])
@pytest.mark.parametrize("float16", [False, True])
def test_the_int4_tiles_hold_the_weight_bit_for_bit(rows, group_size, float16):
    """`native_quantized.c`'s 4-bit tiles (`pack_int4_tiles`: eight rows interleaved,
    the last tile padded) dequantized by `dequantize_int4_tiles` against
    `spec.quant.dequantize_weight`: every code, scale and offset where it belongs, with
    scales and offsets of both signs and zero; held in float32, or in float16 when
    float16 values (normal, subnormal and the largest)."""
    g = torch.Generator().manual_seed(rows * group_size)
    columns = group_size * 3
    codes = torch.randint(0, 16, (rows, columns), generator=g)
    scales = torch.randn(rows, 3, generator=g)
    offsets = torch.randn(rows, 3, generator=g)
    scales[0, 0], offsets[-1, 1] = 0.0, -0.0
    if float16:
        scales, offsets = scales.half().float(), offsets.half().float()
        scales[-1, 2], offsets[0, 1] = 2.0**-24 * 5, -65504.0  # subnormal, the largest
    weight = QuantizedWeight(pack_codes(codes, bits=4), scales, offsets, group_size, 4)
    kernel = cpu_linear.pack(weight)
    assert isinstance(kernel, cpu_linear.ActivationQuantizedLinear)
    assert kernel.half == float16
    assert torch.equal(kernel.dequantize(), weight.dequantize())


@pytest.mark.parametrize("bits", [4, 8])
def test_without_the_c_library_the_projections_take_pytorchs_kernels(bits, monkeypatch):
    """`DECODESPEC_NATIVE=0` (as no compiler): PyTorch's CPU kernels, bfloat16
    activations, within QUANT-LINEAR-1's bfloat16 tolerance."""
    g = torch.Generator().manual_seed(bits)
    group = 32 if bits == 4 else 64
    weight = quantize_weight(torch.randn(40, 64, generator=g), bits=bits, group_size=group)
    monkeypatch.setenv("DECODESPEC_NATIVE", "0")
    kernel = cpu_linear.pack(weight)
    assert isinstance(kernel, cpu_linear.CpuInt4Linear if bits == 4 else cpu_linear.CpuInt8Linear)
    x = torch.randn(131, 64, generator=g)
    assert kernel_error(kernel.linear(x), x, weight) < BF16_RTOL


@pytest.mark.clause("LOOP-PREFILL-1", "FWD-QUANT-1")
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_long_prompt_in_one_pass_is_the_spec_loop(fmt, monkeypatch):
    """A prompt longer than the native step takes (`max_tokens`, lowered here) prefilled
    in one pass by the batched path's C products, then decoded by the native step,
    against the spec loop."""
    engine = Engine(
        model(3, fmt, max_context=192), ByteTokenizer(), backend="torch", token_budget=None
    )
    monkeypatch.setattr(engine.runner.native, "max_tokens", 100)
    prompt = list(range(7, 7 + 140))
    workload = [(prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), 0)]
    check_all(engine, *run_workload(engine, workload))


# ---------------------------------------------------------------- converting at load


def test_each_format_holds_what_it_says():
    weights = random_weights(formats_config(tie_word_embeddings=True), seed=1)
    sizes = {}
    for fmt in WEIGHT_FORMATS:
        converted = convert_weights(weights, fmt)
        sizes[fmt] = weight_bytes(converted)
        projections = [converted.layers[0].q_proj, converted.output]
        if fmt in ("float32", "bfloat16"):
            assert all(p.dtype == getattr(torch, fmt) for p in projections)
            assert converted.output is converted.embedding  # still tied, one tensor
        else:
            layer, output = projections
            assert isinstance(layer, QuantizedWeight) and layer.bits == int(fmt[3:])
            assert isinstance(output, QuantizedWeight) and output.bits == 8  # per channel
            assert output.group_size == output.shape[1]
            assert converted.dtype == torch.float32  # activations (weight_formats)
        # 2 layers of 7 projections, and the output projection
        kinds = {"int8": "int8 ×15", "int4": "int4 g32 ×14, int8 ×1"}
        layout = describe(converted)
        assert f"projections {kinds.get(fmt, f'{fmt} ×15')};" in layout, layout
    assert sizes["float32"] > sizes["bfloat16"] > sizes["int8"] > sizes["int4"]


@pytest.mark.clause("FWD-QUANT-1")
def test_a_quantized_model_computes_the_decoder_with_dequantized_projections():
    """FWD-QUANT-1: the quantized model's logits (the definition, spec backend) are the
    dense decoder's on the dequantized projections, to float32 rounding."""
    quantized = model(2, "int4")
    names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    dense_layers = [
        dataclasses.replace(layer, **{name: getattr(layer, name).dequantize() for name in names})
        for layer in quantized.layers
    ]
    dense = dataclasses.replace(
        quantized, layers=dense_layers, output=quantized.output.dequantize()
    )
    ids = torch.tensor([3, 100, 7, 42, 255, 9])
    assert relative_error(forward_naive(quantized, ids), forward_naive(dense, ids).double()) < 1e-5


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_a_projection_the_format_cannot_hold_is_refused_naming_the_tensor(fmt):
    weights = random_weights(small_config(hidden_size=40, intermediate_size=64), seed=0)
    with pytest.raises(
        ValueError,
        match=rf"tensor model\.layers\.0\..* cannot be {fmt}: in_features 40 is not a multiple",
    ):
        convert_weights(weights, fmt)


def test_an_unknown_format_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="float32, bfloat16, int8, int4"):
        convert_weights(random_weights(formats_config(), seed=0), "int3")


# ---------------------------------------------------------------- every configuration


FORMATS = ("bfloat16", "int8", "int4")


@pytest.mark.clause("LOOP-SAMPLE-1", "FWD-QUANT-1")
@settings(max_examples=12)
@given(
    workload=workloads(),
    fmt=st.sampled_from(FORMATS),
    backend=st.sampled_from(("spec", "torch")),
    seed=st.integers(0, 50),
    block_size=st.sampled_from((1, 4, 16)),
    naive=st.booleans(),
)
def test_batched_requests_in_each_format_are_each_the_spec_loop(
    workload, fmt, backend, seed, block_size, naive
):
    engine = Engine(
        model(seed, fmt), ByteTokenizer(), backend=backend, block_size=block_size, naive=naive
    )
    check_all(engine, *run_workload(engine, workload))


@pytest.mark.clause("LOOP-PREFILL-1")
@settings(max_examples=8)
@given(workload=workloads(), fmt=st.sampled_from(FORMATS), seed=st.integers(0, 50), data=st.data())
def test_preempted_requests_in_each_format_are_each_the_spec_loop(workload, fmt, seed, data):
    block_size = data.draw(st.sampled_from((1, 2, 4)))
    largest = max(len(p) + (params.max_tokens or 0) - 1 for p, params, _ in workload)
    blocks = -(-largest // block_size) + data.draw(st.integers(0, 2))
    engine = Engine(
        model(seed, fmt), ByteTokenizer(), block_size=block_size, cache_tokens=blocks * block_size
    )
    check_all(engine, *run_workload(engine, workload))


@pytest.mark.clause("LOOP-SAMPLE-1")
@settings(max_examples=8)
@given(
    workload=workloads(sampled=False),
    fmt=st.sampled_from(FORMATS),
    seed=st.integers(0, 50),
    speculate=st.sampled_from(("ngram", "layers:1", "model")),
)
def test_speculation_in_each_format_is_the_spec_loop(workload, fmt, seed, speculate):
    weights = model(seed, fmt)
    draft = model(seed + 1, fmt, num_layers=1) if speculate == "model" else None
    engine = Engine(
        weights, ByteTokenizer(), block_size=2, speculate=speculate, num_draft=3, draft_model=draft
    )
    check_all(engine, *run_workload(engine, workload))


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_shared_prefix_is_served_from_the_cache_in_each_format(fmt):
    """The second request reuses the first one's blocks, and is its spec loop."""
    from decodespec.spec.params import SamplingParams

    engine = Engine(model(5, fmt), ByteTokenizer(), block_size=4)
    prefix = list(b"the same long prefix, ")
    workload = [
        ([*prefix, 97], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), 0),
        ([*prefix, 98], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), 8),
    ]
    ids, events = run_workload(engine, workload)
    assert engine.requests[ids[1]].cached_prompt_tokens >= 20
    check_all(engine, ids, events)


# ---------------------------------------------------------------- GGUF files in 4-bit blocks


@pytest.fixture(scope="module")
def q4_1_gguf(tmp_path_factory):
    """A small random Llama GGUF laid out as the bundled file is: every projection in
    Q4_1 blocks (Q and K rows permuted, as llama.cpp writes them), the tied embedding
    Q8_0, the norms F32."""
    from tests.engine import checkpoints

    hf = checkpoints.hf_model("llama", tie_word_embeddings=True)
    tensors = checkpoints.gguf_tensors(hf, "llama")
    quantize = {name: "Q4_1" for name in tensors if name.startswith("blk.") and "norm" not in name}
    quantize["token_embd.weight"] = "Q8_0"
    path = tmp_path_factory.mktemp("q4_1") / "model.gguf"
    return checkpoints.write_gguf(path, "llama", hf.config, tensors, quantize=quantize)


def load_with_summary(path, fmt):
    from decodespec.reference.loader import load_weights

    messages = []
    weights = load_weights(path, weights=fmt, progress=messages.append)
    return weights, [m for m in messages if isinstance(m, LoadSummary)]


@pytest.mark.clause("QUANT-ROUND-1", "FWD-QUANT-1", "LOOP-SAMPLE-1")
def test_int8_requantizes_a_gguf_files_4_bit_blocks_per_channel(q4_1_gguf):
    """`--weights int8` on a file of Q4_1 projections gives int8 layers: each projection
    QUANT-ROUND-1's int8 per channel of the weights its blocks hold (dequantized, as the
    float32 loader reads them; 4-bit groups of 32 do not fit one scale a row), within
    int8's rounding of them, and the summary says they were quantized from Q4_1. A greedy
    generation on the torch backend's int8 kernels is the spec loop on those weights."""
    from decodespec.reference.loader import load_weights
    from decodespec.spec.params import SamplingParams

    float32 = load_weights(q4_1_gguf)
    int8, summary = load_with_summary(q4_1_gguf, "int8")
    for index, (ours, dense) in enumerate(zip(int8.layers, float32.layers, strict=True)):
        for name in PROJECTIONS:
            weight, want = getattr(ours, name), getattr(dense, name)
            where = f"layer {index} {name}"
            assert isinstance(weight, QuantizedWeight), where
            assert weight.bits == 8 and weight.qweight.dtype == torch.int8, where
            assert weight.group_size == want.shape[1], where  # one scale a row
            # s = max |w| / 127 a row; each weight rounded to the nearest multiple of s
            scale = want.abs().amax(dim=1, keepdim=True) / 127
            error = (weight.dequantize() - want).abs()
            assert bool((error <= scale * (0.5 + 1e-4)).all()), where
            rounded = quantize_weight(want, bits=8, group_size=want.shape[1])
            assert torch.equal(weight.qweight, rounded.qweight), where
            assert torch.equal(weight.scales, rounded.scales), where
    assert int8.output.bits == 8 and int8.output.group_size == int8.config.hidden_size
    assert summary[-1] == (
        "int8: 14 quantized at load from Q4_1 to int8 per channel, "
        "1 quantized at load from Q8_0 to int8 per channel "
        "(the output projection tied to the embedding)"
    )
    assert "projections int8 ×15;" in describe(int8)
    engine = Engine(int8, ByteTokenizer(), backend="torch", block_size=4)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    ids, events = run_workload(engine, [(list(b"int8 from Q4_1"), greedy, 0)])
    assert len(engine.output(ids[0]).token_ids) == 6
    check_all(engine, ids, events)


@pytest.mark.clause("GGUF-GROUPS-1")
def test_int4_keeps_the_blocks_of_a_small_gguf_file(q4_1_gguf):
    """The same file in int4: every Q4_1 projection kept as it is (its weights are the
    float32 loader's exactly), and the summary says so."""
    from decodespec.reference.loader import load_weights

    float32 = load_weights(q4_1_gguf)
    int4, summary = load_with_summary(q4_1_gguf, "int4")
    for ours, dense in zip(int4.layers, float32.layers, strict=True):
        for name in PROJECTIONS:
            weight = getattr(ours, name)
            assert isinstance(weight, QuantizedWeight) and weight.bits == 4, name
            assert weight.group_size == 32, name
            assert torch.equal(weight.dequantize(), getattr(dense, name)), name
    assert summary[-1].startswith("int4: 14 kept from Q4_1 blocks, 1 quantized at load from Q8_0")


# ---------------------------------------------------------------- the bundled GGUF


@pytest.fixture(scope="module")
def bundled_int4_and_float32():
    from decodespec.reference.loader import load_formats
    from decodespec.reference.model_files import bundled_model_path

    messages = []
    models, _ = load_formats(bundled_model_path(), ["int4", "float32"], progress=messages.append)
    summary = [m for m in messages if isinstance(m, LoadSummary)]
    return models["int4"], models["float32"], summary


@pytest.mark.clause("GGUF-GROUPS-1", "FWD-QUANT-1")
def test_int4_keeps_the_gguf_files_own_4_bit_blocks(bundled_int4_and_float32):
    """Every Q4_1 projection of the bundled file is kept: its int4 weights are the
    float32 loader's (dequantized by gguf-py, Q and K rows un-permuted) exactly;
    the Q8_0 output projection is quantized at load, and the summary says so."""
    int4, float32, messages = bundled_int4_and_float32
    for ours, theirs in zip(int4.layers, float32.layers, strict=True):
        for name in PROJECTIONS:
            weight = getattr(ours, name)
            assert isinstance(weight, QuantizedWeight) and weight.group_size == 32
            assert torch.equal(weight.dequantize(), getattr(theirs, name)), name
    assert (
        "int4: 210 kept from Q4_1 blocks, 1 quantized at load from Q8_0 to int8 per channel"
        in messages[-1]
    )
    assert int4.output.bits == 8 and int4.output.group_size == 576
    output_error = relative_error(int4.output.dequantize(), float32.output.double())
    assert 0 < output_error < 0.02  # requantized from Q8_0 per channel: close, not equal


@pytest.mark.clause("LOOP-GRAMMAR-1", "FWD-QUANT-1")
@settings(max_examples=6)
@given(data=st.data(), fmt=st.sampled_from(FORMATS), backend=st.sampled_from(("spec", "torch")))
def test_constrained_requests_in_each_format_are_each_the_spec_loop(data, fmt, backend):
    """Structured outputs: every token of a constrained request in the grammar, and the
    spec loop with the same matcher, in each format."""

    workload = data.draw(structured.constrained_workloads(max_requests=3))
    engine = Engine(
        model(data.draw(st.integers(0, 50)), fmt), structured.TOKENIZER, backend=backend
    )
    ids, events = structured.run(engine, workload)
    with mock.patch.object(test_engine_vs_spec, "NEAR_TIE", BF16_NEAR_TIE):
        structured.check(engine, engine.weights, workload, ids, events)


@pytest.mark.clause("LOOP-SAMPLE-1", "QUANT-LINEAR-1")
@settings(max_examples=3)
@given(workload=workloads(max_requests=2), fmt=st.sampled_from(("int8", "int4")))
def test_the_triton_backend_runs_each_quantized_format_as_the_spec_loop(workload, fmt):
    """Its projections on `kernels.quantized_linear` (the Triton interpreter without a
    GPU: one layer, few tokens)."""
    pytest.importorskip("triton")
    weights = model(3, fmt, num_layers=1)
    engine = Engine(weights, ByteTokenizer(), backend="triton", block_size=4, cache_tokens=64)
    assert type(engine.weights.layers[0].q_proj).__name__ == "KernelLinear"
    check_all(engine, *run_workload(engine, workload))


def test_a_hugging_face_directory_loads_in_each_format(tmp_path, monkeypatch):
    """`load_formats` on a safetensors checkpoint: each format from the same float32
    tensors (its int4 quantized at load), the tokenizer read once beside them."""
    from decodespec.reference import loader
    from tests.engine.checkpoints import hf_model, save_hf

    directory = save_hf(hf_model("llama"), tmp_path)
    monkeypatch.setattr(loader.Tokenizer, "from_file", lambda where: ("tokenizer of", where))
    models, tokenizer = loader.load_formats(directory, ["float32", "int8", "int4"])
    assert tokenizer == ("tokenizer of", directory)
    float32 = loader.load_weights(directory)
    assert torch.equal(models["float32"].layers[0].q_proj, float32.layers[0].q_proj)
    for fmt, bits in (("int8", 8), ("int4", 4)):
        q_proj = models[fmt].layers[0].q_proj
        assert isinstance(q_proj, QuantizedWeight) and q_proj.bits == bits
        assert relative_error(q_proj.dequantize(), float32.layers[0].q_proj.double()) < 0.2
