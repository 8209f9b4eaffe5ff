"""One request's logit processors never reach another row of its batch.

A batch's processor tensors (`sampling_tensors`) are dense `[batch, vocab]`
rows built from each request's `SamplingParams`: one request's logit_bias,
repetition / frequency / presence penalty or min_tokens must change its own
row only. Each row of a batch, processed or sampled by the spec, must equal
that request processed alone, in a batch of one, where a request without
processors gets no processor tensors at all.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from decodespec.spec.params import SamplingParams, SamplingTensors, sampling_tensors
from decodespec.spec.sampling import process_logits, sample

EOS = 0  # token 0 is EOS; min_tokens bans it and the request's stop ids (never all tokens)


@st.composite
def requests(draw: st.DrawFn, vocab: int) -> tuple[SamplingParams, list[int], list[int]]:
    """One request: its parameters (each processor on or off), prompt and output so far."""
    ids = st.integers(0, vocab - 1)
    params = {
        "temperature": draw(st.sampled_from((0.0, 0.7, 1.0, 1.5))),
        "top_k": draw(st.sampled_from((0, 0, 3))),
        "top_p": draw(st.sampled_from((1.0, 1.0, 0.8))),
        "min_p": draw(st.sampled_from((0.0, 0.0, 0.1))),
        "seed": draw(st.integers(0, 2**64 - 1)),
    }
    if draw(st.booleans()):
        biased = draw(st.lists(ids, min_size=1, max_size=4, unique=True))
        values = st.sampled_from((-100.0, -3.5, 2.25, 7.0, 100.0))
        params["logit_bias"] = {i: draw(values) for i in biased}
    if draw(st.booleans()):
        params["repetition_penalty"] = draw(st.sampled_from((0.5, 1.3, 2.0)))
    if draw(st.booleans()):
        params["frequency_penalty"] = draw(st.sampled_from((-1.5, 0.5, 2.0)))
    if draw(st.booleans()):
        params["presence_penalty"] = draw(st.sampled_from((-2.0, 0.75, 1.25)))
    if draw(st.booleans()):
        params["min_tokens"] = draw(st.integers(1, 6))
        params["stop_token_ids"] = draw(st.lists(st.integers(1, vocab - 2), max_size=2))
    prompt = draw(st.lists(ids, min_size=1, max_size=6))
    output = draw(st.lists(ids, max_size=5))
    return SamplingParams(**params), prompt, output


@st.composite
def batches(draw: st.DrawFn) -> tuple[torch.Tensor, list]:
    """Logits and 2-5 requests, at least one with a processor and one without any."""
    vocab = draw(st.integers(3, 24))
    batch = draw(st.integers(2, 5))
    rows = [draw(requests(vocab)) for _ in range(batch)]
    # One row without processors and one with all of them, at drawn positions.
    bare, busy = draw(st.permutations(range(batch)))[:2]
    params, prompt, output = rows[bare]
    rows[bare] = (SamplingParams(temperature=params.temperature, seed=params.seed), prompt, output)
    params, prompt, output = rows[busy]
    rows[busy] = (
        SamplingParams(
            temperature=params.temperature,
            seed=params.seed,
            logit_bias={vocab - 1: 5.0, 1: -7.5},
            repetition_penalty=1.7,
            frequency_penalty=0.9,
            presence_penalty=-1.1,
            min_tokens=len(output) + 1,
            stop_token_ids=[1],
        ),
        prompt,
        output,
    )
    seed = draw(st.integers(0, 2**32 - 1))
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * 3
    return logits, rows


def tensors_of(rows: list, vocab: int) -> SamplingTensors:
    params, prompts, outputs = zip(*rows, strict=True)
    return sampling_tensors(
        params,
        vocab_size=vocab,
        prompt_token_ids=prompts,
        output_token_ids=outputs,
        eos_token_ids=[EOS],
    )


@pytest.mark.clause(
    "LOGITS-BIAS-1", "LOGITS-MINTOK-1", "LOGITS-REP-1", "LOGITS-FREQ-1", "LOGITS-PRES-1"
)
@given(case=batches())
def test_a_rows_processors_never_leak_into_another_row(case):
    logits, rows = case
    vocab = logits.shape[1]
    together = tensors_of(rows, vocab)
    processed = process_logits(logits, **together.process_logits_args)
    tokens = sample(logits, **together)
    for row, request in enumerate(rows):
        alone = tensors_of([request], vocab)
        params = request[0]
        expected = process_logits(logits[row : row + 1], **alone.process_logits_args)[0]
        assert torch.equal(processed[row], expected), (
            f"row {row} ({params}) processed in its batch differs from the row alone:\n"
            f"{processed[row].tolist()}\n{expected.tolist()}"
        )
        token = sample(logits[row : row + 1], **alone)[0]
        assert tokens[row] == token, f"row {row} ({params}): {tokens[row]} in its batch, {token}"
