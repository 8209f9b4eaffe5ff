"""Conformance: `process_logits`, the distribution a token is drawn from.

This is the sampling pipeline without the random choice: processors
(LOGITS-ORDER-1), then for sampled rows temperature and the filters
(SAMPLE-ORDER-1), for greedy rows nothing more (SAMPLE-GREEDY-1). An engine
whose random numbers are not the spec's (every engine but this one) is still
checked on what it samples from.

The comparison is shift-invariant, since softmax is: the kept set (finite
entries) must lie between the oracle's strict and loose sets, and each
token kept by both must sit at the spec's distance from the row's maximum.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from decodespec.spec import registry
from decodespec.spec.logits import apply_logit_processors
from tests import oracle
from tests.conformance.test_sampling import (
    SAMPLE_TENSORS,
    add_processor_args,
    assert_rows_banned_entirely,
    call_with_logits_first,
    not_a_tensor,
    processor_args,
    reference_kept,
    valid_sample_args,
)
from tests.strategies import logits, sampling_args

PROCESS = registry.OPERATIONS["process_logits"]


def without_seed(args: dict) -> dict:
    return {k: v for k, v in args.items() if k != "seed"}


def assert_processed_conforms(x: torch.Tensor, args: dict, out: torch.Tensor) -> None:
    """Kept sets between strict and loose; kept values equal relative to the row maximum."""
    assert out.shape == x.shape, (out.shape, x.shape)
    assert out.dtype == (torch.float64 if x.dtype == torch.float64 else torch.float32), out.dtype
    ref = PROCESS.reference(x.double(), **without_seed(args)).cpu()
    out = out.double().cpu()
    assert not bool(out.isnan().any()), "NaN in the processed logits of a valid row"
    assert not bool((out == math.inf).any()), "+inf in the processed logits"
    greedy = (args["temperature"] == 0).cpu()
    _, kept = reference_kept(x, args)
    processed = apply_logit_processors(x.double(), **processor_args(args)).cpu()
    strict = torch.where(greedy[:, None], processed > -math.inf, kept.strict.cpu())
    loose = torch.where(greedy[:, None], processed > -math.inf, kept.loose.cpu())
    oracle.assert_between(out > -math.inf, oracle.Kept(strict, loose), "process_logits")
    both = (out > -math.inf) & (ref > -math.inf)
    from_max = out - out.amax(-1, keepdim=True)
    ref_from_max = ref - ref.amax(-1, keepdim=True)
    rtol = registry.RELATIVE.rtol[torch.float32 if x.dtype != torch.float64 else torch.float64]
    error = (from_max - ref_from_max).abs().masked_fill(~both, 0)
    # Rounding is relative to the operands of `z - max z`, not to their difference:
    # a token near the maximum of a row of logits in the hundreds is as uncertain as
    # the row's largest magnitude (scaled by 1/T, as the difference is).
    finite = processed.masked_fill(processed == -math.inf, 0).abs().amax(-1, keepdim=True)
    temperature = args["temperature"].cpu().double()[:, None]
    row_scale = finite / torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    bound = rtol * torch.maximum(ref_from_max.abs(), row_scale).clamp(min=1).masked_fill(~both, 1)
    bad = error > bound
    assert not bool(bad.any()), (
        f"(row, token) {bad.nonzero().tolist()[:8]}: distance from the row maximum "
        f"{from_max[bad].tolist()[:8]}, the spec's {ref_from_max[bad].tolist()[:8]}"
    )


@pytest.mark.clause("SAMPLE-ORDER-1")
@given(x=logits(), data=st.data())
def test_process_logits_of_sampled_rows_matches_reference(impl, x, data):
    args = without_seed(data.draw(sampling_args(*x.shape, greedy=False)))
    out = impl.op("process_logits")(x, **args)
    assert_processed_conforms(x, args, out)


@pytest.mark.clause("SAMPLE-GREEDY-1")
@given(x=logits(), data=st.data())
def test_process_logits_of_greedy_rows_keeps_every_token(impl, x, data):
    args = without_seed(data.draw(sampling_args(*x.shape, greedy=True)))
    out = impl.op("process_logits")(x, **args)
    assert_processed_conforms(x, args, out)


@pytest.mark.clause(
    "LOGITS-ORDER-1",
    "LOGITS-BIAS-1",
    "LOGITS-MINTOK-1",
    "LOGITS-REP-1",
    "LOGITS-FREQ-1",
    "LOGITS-PRES-1",
)
@given(x=logits(dtypes=(torch.float32,)), data=st.data())
def test_process_logits_with_processors_matches_reference(impl, x, data):
    args = without_seed(data.draw(sampling_args(*x.shape)))
    add_processor_args(impl, data, args, *x.shape)
    try:
        out = impl.op("process_logits")(x, **args)
    except ValueError as error:  # min_tokens may ban every finite token of a row
        assert_rows_banned_entirely(x, args, error)
        return
    assert_processed_conforms(x, args, out)


# ---------------------------------------------------------------- arguments


@pytest.mark.clause("SAMPLE-VALID-3")
@pytest.mark.parametrize("kind", ["float", "list"])
@pytest.mark.parametrize("name", [name for name in SAMPLE_TENSORS if name != "seed"])
def test_process_logits_names_an_argument_that_is_not_a_tensor(impl, name, kind):
    args = without_seed(valid_sample_args(impl, name))
    args[name] = not_a_tensor(args[name], kind)
    with pytest.raises(TypeError, match=rf"\b{name}\b"):
        call_with_logits_first(impl.op("process_logits"), args)


@pytest.mark.clause("SAMPLE-VALID-3")
def test_process_logits_names_a_missing_temperature(impl):
    args = without_seed(valid_sample_args(impl))
    args["temperature"] = None
    with pytest.raises(TypeError, match=r"\btemperature\b"):
        call_with_logits_first(impl.op("process_logits"), args)


@pytest.mark.clause("SAMPLE-VALID-3")
@pytest.mark.parametrize("batch", [2, 0])
def test_process_logits_rejects_an_empty_vocabulary(impl, batch):
    args = without_seed(valid_sample_args(impl, batch=batch, vocab=0))
    with pytest.raises(ValueError, match=r"\blogits\b"):
        call_with_logits_first(impl.op("process_logits"), args)
