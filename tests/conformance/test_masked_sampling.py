"""Conformance: sampling under a grammar's token mask (`token_bitmask` of `sample`
and `process_logits`, MASK-SAMPLE-1).

The mask is applied in the same pass as the rest of the pipeline, and must
give exactly what the implementation gives for logits masked beforehand
(the mask is a select, so nothing may differ in any bit); that in turn must
conform to the spec as any logits do. Masks mix rows without a grammar (all
bits set), sparse and dense random masks, and rows with a single allowed
token, across the 32-bit words and the vocabulary chunks of the kernels.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

from decodespec.spec.token_mask import allowed_token_mask, apply_token_bitmask, bitmask_words
from tests.conformance.test_process_logits import assert_processed_conforms, without_seed
from tests.conformance.test_sampling import (
    add_processor_args,
    assert_invalid_logits_error,
    assert_tokens_conform,
)
from tests.conformance.test_token_mask import BITMASK_LAYOUTS, laid_out_bitmask, op_under_test
from tests.strategies import CHUNK_SIZES, DEVICE, LARGE, logits, make_logits, sampling_args

ROW_KINDS = ("unconstrained", "sparse", "dense", "single")


def bitmask_of(allowed: torch.Tensor) -> torch.Tensor:
    """The int32 bitmask `[batch, ceil(V/32)]` of a `[batch, V]` bool mask."""
    batch, vocab = allowed.shape
    words = bitmask_words(vocab)
    padded = torch.zeros(batch, words * 32, dtype=torch.int64)
    padded[:, :vocab] = allowed.cpu().to(torch.int64)
    values = (padded.view(batch, words, 32) << torch.arange(32)).sum(-1)
    return torch.where(values >= 2**31, values - 2**32, values).to(torch.int32).to(DEVICE)


@st.composite
def token_masks(draw: st.DrawFn, x: torch.Tensor) -> torch.Tensor:
    """`[batch, vocab]` bool: each row one of ROW_KINDS, allowing at least one of the
    row's finite logits (a row with nothing left is another test's business)."""
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    batch, vocab = x.shape
    finite = (x > -math.inf).cpu()
    rows = []
    for b in range(batch):
        kind = draw(st.sampled_from(ROW_KINDS))
        if kind == "unconstrained":
            row = torch.ones(vocab, dtype=torch.bool)
        elif kind == "single":
            row = torch.zeros(vocab, dtype=torch.bool)
        else:
            row = torch.rand(vocab, generator=g) < (0.1 if kind == "sparse" else 0.8)
        candidates = finite[b].nonzero().flatten()
        row[candidates[torch.randint(len(candidates), (1,), generator=g)]] = True
        rows.append(row)
    return torch.stack(rows)


def masked_args(data, x: torch.Tensor, args: dict) -> tuple[dict, torch.Tensor]:
    """`args` with a drawn `token_bitmask`, and the logits masked beforehand."""
    allowed = data.draw(token_masks(x))
    bitmask = bitmask_of(allowed)
    note(f"allowed tokens per row: {allowed.sum(-1).tolist()}")
    return {**args, "token_bitmask": bitmask}, apply_token_bitmask(x, bitmask)


@pytest.mark.clause("MASK-SAMPLE-1", "MASK-ORDER-1")
@given(x=logits(), data=st.data())
def test_sample_with_a_mask_is_sample_of_the_masked_logits(impl, x, data):
    impl.require("token_bitmask")
    args = data.draw(sampling_args(*x.shape))
    with_mask, masked = masked_args(data, x, args)
    tokens = impl.op("sample")(x, **with_mask)
    assert torch.equal(tokens, impl.op("sample")(masked, **args))
    assert_tokens_conform(masked, args, tokens)
    allowed = with_mask["token_bitmask"]
    for row, token in enumerate(tokens.tolist()):
        assert (int(allowed[row, token // 32]) >> (token % 32)) & 1, (row, token)


@pytest.mark.clause("MASK-SAMPLE-1", "MASK-ORDER-1", "LOGITS-ORDER-1")
@given(x=logits(dtypes=(torch.float32,)), data=st.data())
def test_the_processors_run_after_the_mask(impl, x, data):
    impl.require("token_bitmask")
    args = data.draw(sampling_args(*x.shape))
    add_processor_args(impl, data, args, *x.shape)
    with_mask, masked = masked_args(data, x, args)
    try:
        want = impl.op("sample")(masked, **args)
    except ValueError as error:  # min_tokens may ban every token a row allows
        assert_invalid_logits_error(error)
        with pytest.raises(ValueError) as caught:
            impl.op("sample")(x, **with_mask)
        assert_invalid_logits_error(caught.value)
        assert caught.value.rows == error.rows
        return
    assert torch.equal(impl.op("sample")(x, **with_mask), want)
    assert_tokens_conform(masked, args, want)


@pytest.mark.clause("MASK-SAMPLE-1", "MASK-ORDER-1")
@given(x=logits(), data=st.data())
def test_process_logits_with_a_mask_is_process_logits_of_the_masked_logits(impl, x, data):
    impl.require("token_bitmask")
    args = without_seed(data.draw(sampling_args(*x.shape)))
    with_mask, masked = masked_args(data, x, args)
    out = impl.op("process_logits")(x, **with_mask)
    assert torch.equal(out.isinf(), impl.op("process_logits")(masked, **args).isinf())
    assert_processed_conforms(masked, args, out)


@pytest.mark.clause("MASK-SAMPLE-1", "MASK-ORDER-1")
@pytest.mark.parametrize("chunk", CHUNK_SIZES)
@given(data=st.data())
def test_a_single_allowed_token_is_chosen_whatever_the_filters(impl, chunk, data):
    """Across a vocabulary chunk boundary: the one allowed token is far from the row's
    maximum, yet top-k 1, top-p and min-p all keep it, since they see the mask first."""
    impl.require("token_bitmask")
    vocab = chunk + 40 if LARGE or chunk == CHUNK_SIZES[0] else chunk // 2
    token = data.draw(st.integers(0, vocab - 1))
    x = torch.linspace(10.0, -10.0, vocab, device=DEVICE)[None].repeat(3, 1)
    allowed = torch.zeros(3, vocab, dtype=torch.bool)
    allowed[:, token] = True
    tokens = impl.op("sample")(
        x,
        temperature=torch.tensor([0.0, 1.0, 0.5], device=DEVICE),
        top_k=torch.tensor([0, 1, 2], device=DEVICE),
        top_p=torch.tensor([1.0, 0.1, 0.5], device=DEVICE),
        min_p=torch.tensor([0.0, 0.9, 0.5], device=DEVICE),
        seed=torch.tensor([1, 2, 3], device=DEVICE),
        token_bitmask=bitmask_of(allowed),
    )
    assert tokens.tolist() == [token] * 3


@pytest.mark.clause("MASK-SAMPLE-1", "MASK-WIDTH-1")
@pytest.mark.parametrize("layout", BITMASK_LAYOUTS)
def test_a_token_bitmask_of_any_width_and_strides_is_read_row_by_row(impl, layout):
    """An engine's bitmask need not be ceil(V / 32) contiguous words (MASK-WIDTH-1): wider
    (a padded vocabulary: the extra words are ignored), narrower (the columns past it are
    disallowed), or a view with its own row stride (a slice of a bigger buffer, one row
    broadcast to the batch). `sample` and `process_logits` read each row at the bitmask's
    own strides: bit for bit what they give for the logits the spec masked beforehand,
    and the spec's tokens."""
    impl.require("token_bitmask")
    batch, vocab = 3, 70
    x = make_logits(batch, vocab, "normal", seed=11).to(DEVICE)
    bitmask = laid_out_bitmask(batch, vocab, layout, seed=12)
    allowed = allowed_token_mask(bitmask.cpu(), vocab)
    assert bool(allowed.any(dim=-1).all())  # every row has a token to sample
    masked = apply_token_bitmask(x, bitmask)  # the spec's mask
    args = {
        "temperature": torch.tensor([0.0, 1.0, 0.7], device=DEVICE),
        "top_k": torch.tensor([0, 8, 0], device=DEVICE),
        "top_p": torch.tensor([1.0, 1.0, 0.9], device=DEVICE),
        "min_p": torch.tensor([0.0, 0.0, 0.05], device=DEVICE),
        "seed": torch.tensor([1, -2, 3], device=DEVICE),
        "step": torch.tensor([0, 4, 9], device=DEVICE),
    }
    tokens = impl.op("sample")(x, **args, token_bitmask=bitmask)
    assert torch.equal(tokens, impl.op("sample")(masked, **args))
    assert_tokens_conform(masked, args, tokens)
    assert bool(allowed[torch.arange(batch), tokens.cpu()].all()), tokens.tolist()
    out = impl.op("process_logits")(x, **without_seed(args), token_bitmask=bitmask)
    want = impl.op("process_logits")(masked, **without_seed(args))
    assert torch.equal(out.view(torch.int32), want.view(torch.int32)), (
        f"differs at {(out.view(torch.int32) != want.view(torch.int32)).nonzero().tolist()[:10]}"
    )
    assert_processed_conforms(masked, args, out)


@pytest.mark.clause("MASK-SAMPLE-1", "SAMPLE-GREEDY-1")
def test_a_masked_maximum_tied_with_an_allowed_one_loses(impl):
    """Greedy takes the smallest allowed index among the maxima: masked tokens tied
    with it (here the smaller index 3) are not candidates."""
    impl.require("token_bitmask")
    x = torch.zeros(1, 40, device=DEVICE)
    x[0, [3, 35]] = 7.0
    allowed = torch.ones(1, 40, dtype=torch.bool)
    allowed[0, 3] = False
    out = impl.op("sample")(
        x, temperature=torch.zeros(1, device=DEVICE), token_bitmask=bitmask_of(allowed)
    )
    assert out.tolist() == [35]


@pytest.mark.clause("MASK-SAMPLE-1", "LOGITS-BIAS-1", "LOGITS-REP-1")
def test_the_processors_cannot_revive_a_masked_token(impl):
    impl.require("token_bitmask")
    impl.require("logit_bias")
    impl.require("penalties")
    x = torch.tensor([[0.0, 1.0, -1.0]], device=DEVICE)
    allowed = torch.tensor([[False, True, True]])
    out = impl.op("process_logits")(
        x,
        temperature=torch.ones(1, device=DEVICE),
        token_bitmask=bitmask_of(allowed),
        logit_bias=torch.tensor([[100.0, 0.0, 0.0]], device=DEVICE),
        prompt_mask=torch.tensor([[True, False, False]], device=DEVICE),
        output_counts=torch.tensor([[2, 0, 0]], device=DEVICE),
        repetition_penalty=torch.tensor([0.5], device=DEVICE),
        frequency_penalty=torch.tensor([-2.0], device=DEVICE),
        presence_penalty=torch.tensor([-2.0], device=DEVICE),
    )
    assert out[0, 0].item() == -math.inf and bool((out[0, 1:] > -math.inf).all())


@pytest.mark.clause("MASK-SAMPLE-1", "MASK-EMPTY-1", "SAMPLE-VALID-1", "SAMPLE-VALID-2")
@pytest.mark.parametrize("nan", [False, True])
def test_a_row_whose_mask_allows_nothing_is_invalid_alone(impl, nan):
    """An empty mask is an invalid row, reported by row with the other rows' tokens:
    never a silent EOS. A NaN the mask removes does not make a row invalid."""
    impl.require("token_bitmask")
    x = torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0], [1.0, 2.0, 3.0]], device=DEVICE)
    if nan:
        x[2, 2] = math.nan
    bitmask = torch.tensor([[-1], [0], [0b011]], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError) as caught:
        impl.op("sample")(x, temperature=torch.zeros(3, device=DEVICE), token_bitmask=bitmask)
    assert_invalid_logits_error(caught.value)
    assert caught.value.rows == [1]
    assert caught.value.tokens.tolist() == [2, -1, 1]


@pytest.mark.clause("MASK-MINTOK-1", "LOGITS-MINTOK-1")
def test_min_tokens_against_a_complete_grammar_is_an_invalid_row(impl):
    """The grammar allows only the stop token 0 and min_tokens holds it back: the row
    is invalid; the same grammar after min_tokens gives the stop token."""
    impl.require("token_bitmask")
    impl.require("min_tokens")
    x = torch.tensor([[0.0, 5.0, 1.0]] * 2, device=DEVICE)
    args = {
        "temperature": torch.tensor([1.0, 1.0], device=DEVICE),
        "seed": torch.tensor([4, 4], device=DEVICE),
        "step": torch.tensor([1, 2], device=DEVICE),
        "token_bitmask": torch.tensor([[0b001], [0b001]], dtype=torch.int32, device=DEVICE),
        "stop_token_mask": torch.tensor([[True, False, False]] * 2, device=DEVICE),
        "min_tokens": torch.tensor([2, 2], device=DEVICE),
    }
    with pytest.raises(ValueError) as caught:
        impl.op("sample")(x, **args)
    assert_invalid_logits_error(caught.value)
    assert caught.value.rows == [0]
    assert caught.value.tokens.tolist() == [-1, 0]


@pytest.mark.clause("MASK-VALID-1", "MASK-SAMPLE-1")
@pytest.mark.parametrize(
    ("bitmask", "problem"),
    [
        (torch.full((2, 1), -1, dtype=torch.int64), "int32"),
        (torch.full((2, 1), -1.0), "int32"),
        (torch.full((3, 1), -1, dtype=torch.int32), "shape"),
        (torch.full((2, 0), -1, dtype=torch.int32), "shape"),
        (torch.full((2,), -1, dtype=torch.int32), "shape"),
        (torch.full((2, 1, 1), -1, dtype=torch.int32), "shape"),
        (torch.full((2, 1), 1, dtype=torch.uint32), "int32"),
        (torch.empty((2, 1), dtype=torch.int32, device="meta"), "meta"),
    ],
)
@pytest.mark.parametrize("op", ["sample", "process_logits"])
@pytest.mark.parametrize("under", ["spec", "impl"])
def test_a_malformed_token_bitmask_is_named(impl, under, op, bitmask, problem):
    """Refused, naming token_bitmask, by the spec itself and by the implementation. Any
    width of at least one word is well formed (MASK-WIDTH-1): a narrower bitmask is no
    error, its columns past 32 · words are disallowed."""
    if under == "impl":
        impl.require("token_bitmask")
    if bitmask.device.type != "meta":
        bitmask = bitmask.to(DEVICE)
    args = {"temperature": torch.zeros(2, device=DEVICE), "token_bitmask": bitmask}
    with pytest.raises(ValueError, match=rf"token_bitmask.*{problem}|{problem}.*token_bitmask"):
        op_under_test(impl, under, op)(torch.zeros(2, 5, device=DEVICE), **args)
