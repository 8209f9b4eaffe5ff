"""Hugging Face transformers' sampling stage as conformance operations.

`GenerationMixin.generate` casts the last position's logits to float32,
runs them through a `LogitsProcessorList` built by `_get_logits_processor`
(processors, then warpers when `do_sample=True`), and picks `argmax` of the
result when `do_sample=False`. Each operation here calls those public
processor and warper classes, one row at a time: they take one parameter
value for the whole batch, and each row of the spec has its own.

The glue turns the spec's dense tensors into what the classes take: a
row's `prompt_mask | output_counts > 0` into `input_ids` (for the
repetition penalty, which penalises each id present once), `step` into an
`input_ids` of that many new tokens (for min-new-tokens), a dense bias into
`sequence_bias` entries of one token, and a kept set back into a mask
(`out > -inf`). A parameter value that makes `generate` leave a warper out
(top_k 0, top_p 1, temperature 1) leaves it out here too.

transformers has no frequency or presence penalty, so a non-zero one is
refused with NotImplementedError rather than ignored.
"""

from __future__ import annotations

import math

import torch
import transformers
from torch import Tensor
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

__version__ = transformers.__version__
PEER = {
    "name": "transformers",
    "package": "transformers",
    "functions": "generate's logits processors and warpers (SequenceBias, RepetitionPenalty, "
    "MinNewTokensLength, Temperature, TopK, TopP, MinP) and its greedy argmax",
}
CONFORMANCE_UNSUPPORTED = {
    "float64": "generate casts the logits to float32 before any processor runs",
    "token_bitmask": "generate has no bitmask input (PrefixConstrainedLogitsProcessor takes a "
    "function of the ids)",
}

# The history a processor sees: generate passes prompt and output ids; the
# warpers ignore them, so they get none.
_NO_IDS = torch.zeros(1, 0, dtype=torch.int64)


def _scores(logits: Tensor) -> Tensor:
    """What generate hands its processors: the logits as float32 (a copy)."""
    return logits.to(dtype=torch.float32, copy=True)


def _rows(scores: Tensor, processors_of_row) -> Tensor:
    """Run each row's own processors, in order, on that row alone (`[1, vocab]`).

    `processors_of_row(row)` lists `(processor, input_ids)` pairs: the ids are
    the history that processor reads (the penalty's seen ids, min-new-tokens'
    new tokens), as generate would pass them.
    """
    out = torch.empty_like(scores)
    for row in range(scores.shape[0]):
        z = scores[row : row + 1].clone()
        for processor, input_ids in processors_of_row(row):
            z = processor(input_ids, z)
        out[row] = z[0]
    return out


def _kept(out: Tensor) -> Tensor:
    return out > -math.inf


# ------------------------------------------------------------------------- warpers


def _warpers(t: float, k: int = 0, p: float = 1.0, m: float | None = None) -> list:
    """generate's warpers for do_sample=True, in its order, as it leaves them out."""
    warpers = []
    if t != 1.0:
        warpers.append(TemperatureLogitsWarper(t))
    if k != 0:
        warpers.append(TopKLogitsWarper(top_k=k))
    if p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=p))
    if m is not None:
        warpers.append(MinPLogitsWarper(min_p=m))
    return [(warper, _NO_IDS) for warper in warpers]


def apply_temperature(logits: Tensor, temperature: Tensor) -> Tensor:
    """TemperatureLogitsWarper per row; a row with T == 0 is greedy and generate scales nothing."""
    t = temperature.tolist()
    return _rows(_scores(logits), lambda r: _warpers(t[r]) if t[r] > 0 else [])


def top_k_mask(logits: Tensor, top_k: Tensor) -> Tensor:
    k = top_k.tolist()
    return _kept(_rows(_scores(logits), lambda r: _warpers(1.0, k=k[r])))


def top_p_mask(logits: Tensor, top_p: Tensor) -> Tensor:
    p = top_p.tolist()
    return _kept(_rows(_scores(logits), lambda r: _warpers(1.0, p=p[r])))


def min_p_mask(logits: Tensor, min_p: Tensor) -> Tensor:
    m = min_p.tolist()
    return _kept(_rows(_scores(logits), lambda r: _warpers(1.0, m=m[r])))


def greedy(logits: Tensor) -> Tensor:
    """generate's greedy choice: `torch.argmax` of the processed float32 scores."""
    return torch.argmax(_scores(logits), dim=-1)


# ---------------------------------------------------------------------- processors


def _bias(logit_bias: Tensor, row: int) -> list:
    ids = logit_bias[row].nonzero().flatten().tolist()
    if not ids:
        return []
    values = logit_bias[row, ids].tolist()
    bias = SequenceBiasLogitsProcessor([[[i], v] for i, v in zip(ids, values, strict=True)])
    return [(bias, _NO_IDS)]


def _min_new_tokens(stop_token_mask: Tensor, min_tokens: int, step: int, row: int) -> list:
    """min-new-tokens after an empty prompt: its input_ids are the row's `step` new tokens."""
    stop_ids = stop_token_mask[row].nonzero().flatten()
    if min_tokens == 0 or stop_ids.numel() == 0:  # generate adds it only for min_new_tokens > 0
        return []
    new_tokens = torch.zeros(1, step, dtype=torch.int64)
    return [(MinNewTokensLengthLogitsProcessor(0, min_tokens, stop_ids), new_tokens)]


def _repetition(prompt_mask: Tensor, output_counts: Tensor, theta: float, row: int) -> list:
    """The repetition penalty over the row's prompt and output ids, each id once."""
    if theta == 1.0:
        return []
    seen = (prompt_mask[row] | (output_counts[row] > 0)).nonzero().flatten()[None, :]
    return [(RepetitionPenaltyLogitsProcessor(theta), seen)]


def _refuse_frequency_and_presence(frequency_penalty: Tensor, presence_penalty: Tensor) -> None:
    for name, value in (("frequency", frequency_penalty), ("presence", presence_penalty)):
        if bool((value != 0).any()):
            raise NotImplementedError(f"transformers' generate has no {name} penalty")


def apply_logit_bias(logits: Tensor, logit_bias: Tensor) -> Tensor:
    """SequenceBiasLogitsProcessor with one single-token sequence per biased id."""
    return _rows(_scores(logits), lambda r: _bias(logit_bias, r))


def apply_min_tokens(
    logits: Tensor, stop_token_mask: Tensor, min_tokens: Tensor, step: Tensor
) -> Tensor:
    """MinNewTokensLengthLogitsProcessor with the row's stop ids as its eos ids."""
    minimum, steps = min_tokens.tolist(), step.tolist()
    return _rows(
        _scores(logits), lambda r: _min_new_tokens(stop_token_mask, minimum[r], steps[r], r)
    )


def apply_penalties(
    logits: Tensor,
    prompt_mask: Tensor,
    output_counts: Tensor,
    repetition_penalty: Tensor,
    frequency_penalty: Tensor,
    presence_penalty: Tensor,
) -> Tensor:
    """RepetitionPenaltyLogitsProcessor; a frequency or presence penalty is refused."""
    _refuse_frequency_and_presence(frequency_penalty, presence_penalty)
    theta = repetition_penalty.tolist()
    return _rows(_scores(logits), lambda r: _repetition(prompt_mask, output_counts, theta[r], r))


def process_logits(
    logits: Tensor,
    *,
    temperature: Tensor,
    top_k: Tensor | None = None,
    top_p: Tensor | None = None,
    min_p: Tensor | None = None,
    step: Tensor | None = None,
    logit_bias: Tensor | None = None,
    stop_token_mask: Tensor | None = None,
    min_tokens: Tensor | None = None,
    prompt_mask: Tensor | None = None,
    output_counts: Tensor | None = None,
    repetition_penalty: Tensor | None = None,
    frequency_penalty: Tensor | None = None,
    presence_penalty: Tensor | None = None,
) -> Tensor:
    """The list `_get_logits_processor` builds for each row's parameters, in its order.

    Processors: sequence bias, repetition penalty, min new tokens. Warpers,
    for rows with temperature > 0 (`do_sample=True`): temperature, top-k,
    top-p, min-p. Greedy rows get the processors only. A row whose every
    token ends at −inf comes back so: transformers reports no invalid row.
    """
    batch = logits.shape[0]
    t = temperature.tolist()
    k = top_k.tolist() if top_k is not None else [0] * batch
    p = top_p.tolist() if top_p is not None else [1.0] * batch
    m = min_p.tolist() if min_p is not None else [None] * batch
    steps = step.tolist() if step is not None else [0] * batch
    if prompt_mask is not None:
        _refuse_frequency_and_presence(frequency_penalty, presence_penalty)

    def row(r: int) -> list:
        processors = []
        if logit_bias is not None:
            processors += _bias(logit_bias, r)
        if prompt_mask is not None:
            theta = repetition_penalty[r].item()
            processors += _repetition(prompt_mask, output_counts, theta, r)
        if stop_token_mask is not None:
            processors += _min_new_tokens(stop_token_mask, min_tokens[r].item(), steps[r], r)
        if t[r] > 0:
            processors += _warpers(t[r], k[r], p[r], m[r])
        return processors

    return _rows(_scores(logits), row)
