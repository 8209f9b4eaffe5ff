"""The spec's rule for quantizing float weights (QUANT-ROUND-1) and its code layout,
and the activation-quantized linear (QUANT-A8-1).

The quantized linear itself (QUANT-LINEAR-1 and its tolerance) is a registry
operation: tests/conformance/test_quantized_linear.py checks it, on the spec
too. Here: what `quantize_weight` produces, written out element by element.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from decodespec.spec.quant import (
    QuantizedWeight,
    activation_quantized_linear,
    pack_codes,
    quantize_activations,
    quantize_weight,
    quantized_linear,
    unpack_codes,
)


@st.composite
def float_weights(draw: st.DrawFn) -> torch.Tensor:
    rows = draw(st.integers(1, 6))
    group_size = draw(st.sampled_from((2, 8, 32)))
    groups = draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**32 - 1))
    scale = draw(st.sampled_from((1e-3, 1.0, 50.0)))
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, groups * group_size, generator=g) * scale
    if draw(st.booleans()):  # constant and all-zero groups: scale 0
        weight[0, :group_size] = draw(st.sampled_from((0.0, 0.75, -3.0)))
    return weight, group_size


@pytest.mark.clause("QUANT-ROUND-1")
@given(case=float_weights())
def test_4_bit_groups_are_asymmetric_min_max_rounded_half_to_even(case):
    weight, group_size = case
    q = quantize_weight(weight, bits=4, group_size=group_size)
    codes = unpack_codes(q.qweight, 4)
    for row in range(weight.shape[0]):
        for g in range(weight.shape[1] // group_size):
            values = weight[row, g * group_size : (g + 1) * group_size]
            low, high = float(values.min()), float(values.max())
            scale = torch.tensor((high - low) / 15, dtype=torch.float32)
            assert float(q.offsets[row, g]) == low
            assert torch.equal(q.scales[row, g], (values.max() - values.min()) / 15)
            for i, w in enumerate(values):
                want = 0 if scale == 0 else int(((w - low) / scale).round().clamp(0, 15))
                assert int(codes[row, g * group_size + i]) == want
    # A constant group is restored exactly; every weight within half a step.
    restored = q.dequantize()
    step = q.scales.repeat_interleave(group_size, dim=1)
    assert bool(((restored - weight).abs() <= step / 2 + 1e-6 * weight.abs().max()).all())


@pytest.mark.clause("QUANT-ROUND-1")
@given(case=float_weights())
def test_8_bit_groups_are_symmetric_absmax(case):
    weight, group_size = case
    q = quantize_weight(weight, bits=8, group_size=group_size)
    assert not bool(q.offsets.any())
    groups = weight.view(weight.shape[0], -1, group_size)
    assert torch.equal(q.scales, groups.abs().amax(dim=-1) / 127)
    codes = unpack_codes(q.qweight, 8).view_as(groups)
    safe = torch.where(q.scales == 0, 1.0, q.scales)[..., None]
    want = torch.where(q.scales[..., None] == 0, 0.0, (groups / safe).round()).clamp(-127, 127)
    assert torch.equal(codes.float(), want)
    assert int(codes.abs().max()) <= 127


@pytest.mark.clause("QUANT-ROUND-1")
def test_rounding_is_half_to_even():
    # s = 1: (w − min) / s is 0, 0.5, 2.5, 15: codes 0, 0 and 2 (to even), 15.
    q = quantize_weight(torch.tensor([[0.0, 0.5, 2.5, 15.0]]), bits=4, group_size=4)
    assert unpack_codes(q.qweight, 4).tolist() == [[0, 0, 2, 15]]


@pytest.mark.clause("QUANT-ROUND-1")
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weights_cannot_be_quantized(bad):
    weight = torch.ones(2, 8)
    weight[1, 3] = bad
    with pytest.raises(ValueError, match="non-finite"):
        quantize_weight(weight, bits=4, group_size=8)


@pytest.mark.clause("QUANT-CODES-1")
def test_4_bit_codes_are_packed_low_nibble_first():
    codes = torch.tensor([[1, 2, 3, 4, 15, 0]])
    packed = pack_codes(codes, 4)
    assert packed.dtype == torch.uint8 and packed.tolist() == [[0x21, 0x43, 0x0F]]
    assert torch.equal(unpack_codes(packed, 4), codes.to(torch.int32))


@pytest.mark.clause("QUANT-VALID-1")
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(bits=3, group_size=8), "bits must be 4 or 8"),
        (dict(bits=4, group_size=0), "group_size must be a positive int"),
        (dict(bits=4, group_size=True), "group_size must be a positive int"),
        (dict(bits=4, group_size=3), "not a multiple of group_size 3"),
        (dict(bits=4, group_size=1, shape=(2, 7)), "in_features must be even, got 7"),
    ],
)
def test_bad_quantization_arguments_are_named(kwargs, message):
    shape = kwargs.pop("shape", (2, 8))
    with pytest.raises(ValueError, match=message):
        quantize_weight(torch.randn(*shape), **kwargs)


@pytest.mark.clause("QUANT-VALID-1")
def test_a_quantized_weight_checks_itself_on_construction():
    good = quantize_weight(torch.randn(4, 16), bits=4, group_size=8)
    with pytest.raises(ValueError, match="scales must be"):
        QuantizedWeight(good.qweight, good.scales[:, :1], good.offsets, 8, 4)
    with pytest.raises(ValueError, match="qweight for bits=8"):
        QuantizedWeight(good.qweight, good.scales, good.offsets, 8, 8)
    with pytest.raises(TypeError, match=r"offsets must be a torch\.Tensor"):
        QuantizedWeight(good.qweight, good.scales, 0.0, 8, 4)


# ---------------------------------------------------------------- QUANT-A8-1


def scalar_activation_codes(row: list[float]) -> tuple[list[int], float]:
    """One block of 32 activations quantized element by element in numpy float32."""
    block = np.asarray(row, dtype=np.float32)
    scale = np.float32(np.abs(block).max()) / np.float32(127)
    inverse = np.float32(0) if scale == 0 else np.float32(1) / scale
    return [int(np.rint(v * inverse)) for v in block], float(scale)


@st.composite
def activations(draw: st.DrawFn) -> torch.Tensor:
    rows, blocks = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    x = torch.randn(rows, 32 * blocks, generator=g) * draw(st.sampled_from((1e-4, 1.0, 300.0)))
    if draw(st.booleans()):
        x[0, :32] = 0.0  # a block of zeros: scale 0, codes 0
    if draw(st.booleans()):
        x[-1, 5] = 1e4  # an outlier takes its block's scale
    return x


@pytest.mark.clause("QUANT-A8-1")
@given(x=activations())
def test_activations_are_quantized_in_blocks_of_32_by_absmax(x):
    codes, scales = quantize_activations(x)
    assert codes.dtype == torch.int8 and scales.shape == (x.shape[0], x.shape[1] // 32)
    for m in range(x.shape[0]):
        for b in range(x.shape[1] // 32):
            want, scale = scalar_activation_codes(x[m, 32 * b : 32 * b + 32].tolist())
            assert codes[m, 32 * b : 32 * b + 32].tolist() == want
            assert scales[m, b].item() == scale
    assert int(codes.abs().max()) <= 127


@pytest.mark.clause("QUANT-A8-1")
@given(x=activations(), bits=st.sampled_from((4, 8)), per_row=st.booleans())
def test_the_activation_quantized_linear_is_the_product_of_the_quantized_activations(
    x, bits, per_row
):
    """`y` is `x̂ · Wᵀ` with `x̂ = d · c`, the integer sums exact; and `x̂` is within
    half a step of `x`, so `y` within `Σ_k (d_k / 2) |w_k|` of QUANT-LINEAR-1's."""
    k = x.shape[1]
    group = k if per_row else 32
    w = quantize_weight(torch.randn(5, k, generator=torch.Generator().manual_seed(k)),
                        bits=bits, group_size=group)  # fmt: skip
    y = activation_quantized_linear(x, w.qweight, w.scales, w.offsets, group_size=group, bits=bits)
    codes, scales = quantize_activations(x)
    x_hat = codes.double() * scales.double().repeat_interleave(32, dim=1)
    want = x_hat @ w.dequantize().double().T  # W as QUANT-GROUP-1 rounds it, in float32
    terms = x_hat.abs() @ w.dequantize().double().abs().T
    assert y.dtype == x.dtype and ((y.double() - want).abs() <= 1e-6 * terms).all()
    assert ((x_hat - x.double()).abs() <= scales.double().repeat_interleave(32, 1) / 2).all()
    exact = quantized_linear(x.double(), w.qweight, w.scales.double(), w.offsets.double(),
                             group_size=group, bits=bits)  # fmt: skip
    half_steps = scales.double().repeat_interleave(32, dim=1) / 2
    bound = half_steps @ w.dequantize().double().abs().T
    assert ((y.double() - exact).abs() <= bound * (1 + 1e-6) + 1e-12).all()


@pytest.mark.clause("QUANT-A8-1")
def test_activation_blocks_and_weight_groups_must_be_multiples_of_32():
    w = quantize_weight(torch.randn(2, 48), bits=8, group_size=16)
    with pytest.raises(ValueError, match="group_size must be a multiple of 32"):
        activation_quantized_linear(torch.randn(1, 48), w.qweight, w.scales, w.offsets,
                                    group_size=16, bits=8)  # fmt: skip
    with pytest.raises(ValueError, match="K a multiple of 32"):
        quantize_activations(torch.randn(1, 48))
