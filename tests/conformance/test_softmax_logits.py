"""Conformance: softmax, temperature, projection and logit processors against the spec."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from decodespec.spec import registry
from tests.strategies import DEVICE, FLOAT_DTYPES, logits, make_logits, per_row, temperatures


def assert_relative(out: torch.Tensor, ref: torch.Tensor, op: str, dtype: torch.dtype) -> None:
    """‖out − ref‖ / ‖ref‖ within the registry's tolerance, on the finite entries."""
    rtol = registry.OPERATIONS[op].tolerance.rtol[dtype]
    out, ref = out.double().cpu(), ref.double().cpu()
    same_inf = (out == ref) | (torch.isnan(out) & torch.isnan(ref))
    finite = torch.isfinite(ref)
    assert bool((same_inf | finite).all()), f"{op}: non-finite entries differ"
    assert bool(torch.isfinite(out[finite]).all()), f"{op}: non-finite output where ref is finite"
    diff = (out[finite] - ref[finite]).norm()
    scale = ref[finite].norm().clamp(min=1e-30)
    assert diff / scale <= rtol, f"{op}: relative error {diff / scale:.3g} > {rtol:g}"


@pytest.mark.clause("SOFTMAX-STABLE-1", "SOFTMAX-INF-1")
@given(x=logits())
def test_softmax_matches_reference(impl, x):
    out = impl.op("softmax")(x)
    ref = registry.OPERATIONS["softmax"].reference(x.double())
    assert_relative(out, ref, "softmax", torch.float32)
    assert bool(((out >= 0) & (out <= 1)).all())
    assert torch.allclose(
        out.double().sum(-1),
        torch.ones(x.shape[0], dtype=torch.float64, device=x.device),
        atol=1e-5,
    )
    assert bool((out[x == -math.inf] == 0).all()), "masked tokens must get probability 0"


@pytest.mark.clause("SOFTMAX-STABLE-1")
@pytest.mark.parametrize("scale", [1e4, 1e30, 3e38])
def test_softmax_never_overflows(impl, scale):
    x = torch.tensor([[1.0, 0.5, -1.0]], device=DEVICE) * scale
    out = impl.op("softmax")(x)
    assert bool(torch.isfinite(out).all()), out
    assert out[0, 0].item() == 1.0


@pytest.mark.clause("SOFTMAX-LOG-1", "SOFTMAX-INF-1")
@given(x=logits())
def test_log_softmax_matches_reference(impl, x):
    out = impl.op("log_softmax")(x)
    ref = registry.OPERATIONS["log_softmax"].reference(x.double())
    assert_relative(out, ref, "log_softmax", torch.float32)
    assert bool((out[x == -math.inf] == -math.inf).all())


@pytest.mark.clause("SOFTMAX-LOG-1")
def test_log_softmax_keeps_tiny_probabilities(impl):
    x = torch.tensor([[0.0, -200.0, -1000.0]], device=DEVICE)
    out = impl.op("log_softmax")(x)
    # exp(-1000) underflows float32; ln(softmax) would give -inf here.
    assert torch.allclose(out.cpu(), torch.tensor([[0.0, -200.0, -1000.0]]), rtol=0, atol=1e-4)


@pytest.mark.clause("SOFTMAX-DTYPE-1")
@pytest.mark.parametrize("dtype", [*FLOAT_DTYPES, torch.float64])
def test_softmax_dtype(impl, dtype):
    if dtype == torch.float64:
        impl.require("float64")
    x = make_logits(2, 17, "normal", 0).to(dtype).to(DEVICE)
    expected = torch.float64 if dtype == torch.float64 else torch.float32
    for op in ("softmax", "log_softmax"):
        assert impl.op(op)(x).dtype == expected, op
    t = torch.ones(2, device=DEVICE)
    assert impl.op("apply_temperature")(x, t).dtype == expected


@pytest.mark.clause("SOFTMAX-DTYPE-1")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_computes_in_float32(impl, dtype):
    impl.require("bfloat16" if dtype == torch.bfloat16 else "float16")
    # 4096 equal logits: a float16/bfloat16 sum of their probabilities drifts far from 1.
    x = torch.zeros(1, 4096, dtype=dtype, device=DEVICE)
    out = impl.op("softmax")(x)
    assert abs(out.double().sum().item() - 1.0) < 1e-5
    assert out[0, 0].item() == pytest.approx(1 / 4096, rel=1e-6)


@pytest.mark.clause("SOFTMAX-TEMP-1")
@given(data=st.data(), x=logits())
def test_temperature_matches_reference(impl, data, x):
    t = per_row(data.draw, x.shape[0], temperatures(), torch.float32)
    out = impl.op("apply_temperature")(x, t)
    ref = registry.OPERATIONS["apply_temperature"].reference(x.double(), t)
    assert_relative(out, ref, "apply_temperature", torch.float32)
    assert bool((out.amax(-1) == 0).all()), "the maximum of every row maps to 0"
    assert not bool(torch.isnan(out).any())


@pytest.mark.clause("SOFTMAX-TEMP-1")
@pytest.mark.parametrize("temperature", [1e-30, 1e-45, 1e30])
def test_extreme_temperatures_stay_finite_at_the_max(impl, temperature):
    x = torch.tensor([[3.0, 1.0, 3.0, -2.0]], device=DEVICE)
    out = impl.op("apply_temperature")(x, torch.tensor([temperature], device=DEVICE))
    assert not bool(torch.isnan(out).any()), out
    assert out[0, 0].item() == 0 and out[0, 2].item() == 0
    assert bool((out <= 0).all())


@pytest.mark.clause("LOGITS-PROJ-1")
@given(
    rows=st.integers(1, 4),
    hidden=st.integers(1, 64),
    vocab=st.integers(1, 300),
    dtype=st.sampled_from(FLOAT_DTYPES),
    seed=st.integers(0, 2**32 - 1),
)
def test_compute_logits_matches_reference(impl, rows, hidden, vocab, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, hidden, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(vocab, hidden, generator=g) / hidden**0.5).to(dtype).to(DEVICE)
    out = impl.op("compute_logits")(h, w)
    assert out.dtype == torch.float32 and out.shape == (rows, vocab)
    ref = registry.OPERATIONS["compute_logits"].reference(h.double(), w.double())
    assert_relative(out, ref, "compute_logits", torch.float32)


@pytest.mark.clause("LOGITS-BIAS-1")
@given(x=logits(dtypes=(torch.float32,)), seed=st.integers(0, 2**32 - 1))
def test_logit_bias_matches_reference(impl, x, seed):
    g = torch.Generator().manual_seed(seed)
    bias = (
        (torch.rand(x.shape, generator=g) * 200 - 100) * (torch.rand(x.shape, generator=g) < 0.2)
    ).to(DEVICE)
    out = impl.op("apply_logit_bias")(x, bias)
    ref = registry.OPERATIONS["apply_logit_bias"].reference(x.double(), bias)
    assert_relative(out, ref, "apply_logit_bias", torch.float32)


@pytest.mark.clause("LOGITS-MINTOK-1")
@given(x=logits(dtypes=(torch.float32,)), data=st.data())
def test_min_tokens_bans_stop_ids_until_reached(impl, x, data):
    batch, vocab = x.shape
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**32 - 1)))
    stop_mask = (torch.rand(batch, vocab, generator=g) < 0.1).to(DEVICE)
    min_tokens = per_row(data.draw, batch, st.integers(0, 5), torch.int64)
    step = per_row(data.draw, batch, st.integers(0, 6), torch.int64)
    out = impl.op("apply_min_tokens")(x, stop_mask, min_tokens, step)
    ref = registry.OPERATIONS["apply_min_tokens"].reference(x.double(), stop_mask, min_tokens, step)
    assert_relative(out, ref, "apply_min_tokens", torch.float32)
    banned = stop_mask & (step < min_tokens)[:, None]
    assert bool((out[banned] == -math.inf).all())
    assert torch.equal(out[~banned], x[~banned])


@pytest.mark.clause("LOGITS-MINTOK-1")
def test_min_tokens_keeps_nan_visible(impl):
    x = torch.tensor([[float("nan"), 1.0]], device=DEVICE)
    out = impl.op("apply_min_tokens")(
        x,
        torch.tensor([[True, False]], device=DEVICE),
        torch.tensor([3], device=DEVICE),
        torch.tensor([0], device=DEVICE),
    )
    assert math.isnan(out[0, 0].item()), "masking a NaN stop id must not hide the invalid row"


def _penalty_inputs(draw, batch, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    prompt_mask = (torch.rand(batch, vocab, generator=g) < 0.3).to(DEVICE)
    counts = (
        (
            torch.randint(0, 4, (batch, vocab), generator=g)
            * (torch.rand(batch, vocab, generator=g) < 0.3)
        )
        .to(torch.int32)
        .to(DEVICE)
    )
    rep = per_row(
        draw, batch, st.sampled_from((1.0, 0.5, 1.3, 2.0)) | st.floats(0.1, 5.0), torch.float32
    )
    freq = per_row(draw, batch, st.floats(-2.0, 2.0), torch.float32)
    pres = per_row(draw, batch, st.floats(-2.0, 2.0), torch.float32)
    return prompt_mask, counts, rep, freq, pres


@pytest.mark.clause("LOGITS-REP-1", "LOGITS-FREQ-1", "LOGITS-PRES-1")
@given(x=logits(dtypes=(torch.float32,)), data=st.data())
def test_penalties_match_reference(impl, x, data):
    inputs = _penalty_inputs(data.draw, *x.shape, data.draw(st.integers(0, 2**32 - 1)))
    out = impl.op("apply_penalties")(x, *inputs)
    ref = registry.OPERATIONS["apply_penalties"].reference(x.double(), *inputs)
    assert_relative(out, ref, "apply_penalties", torch.float32)


@pytest.mark.clause("LOGITS-REP-1")
def test_repetition_penalty_discourages_whatever_the_sign(impl):
    x = torch.tensor([[2.0, -2.0, 2.0, -2.0]], device=DEVICE)
    seen = torch.tensor([[True, True, False, False]], device=DEVICE)
    zeros = torch.zeros(1, 4, dtype=torch.int32, device=DEVICE)
    f = torch.zeros(1, device=DEVICE)
    out = impl.op("apply_penalties")(x, seen, zeros, torch.tensor([2.0], device=DEVICE), f, f)
    assert out.cpu().tolist() == [[1.0, -4.0, 2.0, -2.0]]
    # Output tokens count as seen too, once each however often they occur.
    counts = torch.tensor([[0, 0, 5, 0]], dtype=torch.int32, device=DEVICE)
    out = impl.op("apply_penalties")(
        x, seen & False, counts, torch.tensor([2.0], device=DEVICE), f, f
    )
    assert out.cpu().tolist() == [[2.0, -2.0, 1.0, -2.0]]


@pytest.mark.clause("LOGITS-FREQ-1", "LOGITS-PRES-1")
def test_frequency_counts_output_only_presence_counts_once(impl):
    x = torch.zeros(1, 3, device=DEVICE)
    prompt = torch.tensor([[True, False, False]], device=DEVICE)
    counts = torch.tensor([[0, 3, 1]], dtype=torch.int32, device=DEVICE)
    one = torch.ones(1, device=DEVICE)
    out = impl.op("apply_penalties")(
        x,
        prompt,
        counts,
        one,
        torch.tensor([0.5], device=DEVICE),
        torch.tensor([0.25], device=DEVICE),
    )
    assert out.cpu().tolist() == [[0.0, -1.75, -0.75]]


# ---------------------------------------------------------------- arguments


def valid_processor_args(op: str) -> dict:
    """A valid call of `compute_logits` or a processor, its arguments in order."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, generator=g).to(DEVICE)

    def rows(values: list, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=DEVICE)

    return {
        "compute_logits": lambda: {
            "hidden_states": torch.randn(2, 4, generator=g).to(DEVICE),
            "output_weight": torch.randn(5, 4, generator=g).to(DEVICE),
        },
        "apply_logit_bias": lambda: {
            "logits": x,
            "logit_bias": (torch.rand(2, 5, generator=g) * 4 - 2).to(DEVICE),
        },
        "apply_min_tokens": lambda: {
            "logits": x,
            "stop_token_mask": (torch.rand(2, 5, generator=g) < 0.3).to(DEVICE),
            "min_tokens": rows([2, 0], torch.int64),
            "step": rows([1, 0], torch.int64),
        },
        "apply_penalties": lambda: {
            "logits": x,
            "prompt_mask": (torch.rand(2, 5, generator=g) < 0.5).to(DEVICE),
            "output_counts": torch.randint(0, 3, (2, 5), generator=g).to(DEVICE),
            "repetition_penalty": rows([1.3, 1.0]),
            "frequency_penalty": rows([0.0, 0.0]),
            "presence_penalty": rows([0.0, 0.0]),
        },
    }[op]()


PROCESSOR_TENSORS = [
    (op, name)
    for op in ("compute_logits", "apply_logit_bias", "apply_min_tokens", "apply_penalties")
    for name in valid_processor_args(op)
]


@pytest.mark.clause("LOGITS-VALID-1")
@pytest.mark.parametrize("kind", ["float", "list"])
@pytest.mark.parametrize(("op", "name"), PROCESSOR_TENSORS)
def test_processors_name_an_argument_that_is_not_a_tensor(impl, op, name, kind):
    args = valid_processor_args(op)
    args[name] = 1.5 if kind == "float" else args[name].tolist()
    with pytest.raises(TypeError, match=rf"\b{name}\b"):
        impl.op(op)(*args.values())


SOFTMAX_OPERATIONS = ("softmax", "log_softmax", "apply_temperature")


def valid_softmax_args(op: str, batch: int = 2, vocab: int = 5) -> dict:
    """A valid call of `softmax`, `log_softmax` or `apply_temperature`, its arguments in
    order."""
    g = torch.Generator().manual_seed(batch * 1000 + vocab)
    args = {"logits": torch.randn(batch, vocab, generator=g).to(DEVICE)}
    if op == "apply_temperature":
        args["temperature"] = torch.tensor([0.7, 0.0][:batch], device=DEVICE)
    return args


SOFTMAX_TENSORS = [(op, name) for op in SOFTMAX_OPERATIONS for name in valid_softmax_args(op)]


@pytest.mark.clause("SOFTMAX-VALID-1")
@pytest.mark.parametrize("kind", ["float", "list"])
@pytest.mark.parametrize(("op", "name"), SOFTMAX_TENSORS)
def test_softmax_operations_name_an_argument_that_is_not_a_tensor(impl, op, name, kind):
    args = valid_softmax_args(op)
    args[name] = 1.5 if kind == "float" else args[name].tolist()
    with pytest.raises(TypeError, match=rf"\b{name}\b"):
        impl.op(op)(*args.values())


@pytest.mark.clause("SOFTMAX-VALID-1")
@pytest.mark.parametrize("batch", [2, 0])
@pytest.mark.parametrize("op", SOFTMAX_OPERATIONS)
def test_softmax_operations_reject_an_empty_vocabulary(impl, op, batch):
    args = valid_softmax_args(op, batch=batch, vocab=0)
    with pytest.raises(ValueError, match=r"\blogits\b"):
        impl.op(op)(*args.values())
