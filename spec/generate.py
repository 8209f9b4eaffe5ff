"""The loop: one request's generation, from its prompt to its finish reason.

`prefill` runs the prompt into the request's paged KV cache,
`decode_one_token` runs one token through it, and `generate` chooses each
token, computes its logprobs and hands it to the stop checker, streaming a
`StepOutput` per token. Every engine configuration (batched, preempted,
speculative, either backend) must reproduce this loop, run on the request
alone, token for token.

[LOOP-REQUEST-1] The request is checked against the model first
(`validate_request`, PARAM-REQUEST-1), and a request with temperature > 0
must carry its seed: the loop raises ValueError rather than draw one
(`resolve_seed` is the caller's, SAMPLE-SEED-1). `generate` is a generator,
so these errors are raised when iteration starts, before the model runs.

[LOOP-CACHE-1] The loop owns the request's cache: per layer a K and a V
tensor `[num_blocks, block_size, num_kv_heads, head_dim]` in the weights'
dtype for prompt + max_tokens positions (the model's context when max_tokens
is None), the request's block j in cache block j (so position p is flat slot
p). Every slot is NaN until written: a step reading a slot not yet written
would get NaN logits.

[LOOP-PREFILL-1] The prompt's n tokens run through the model in one
`forward_cached` call at positions 0 … n − 1, appending their K/V to the
cache; the logits after the last prompt token are the first step's logits.

[LOOP-PREFIX-1] Reusing a cached prefix changes nothing. By FWD-CACHE-1 the
keys and values at position p depend only on the tokens at positions 0 … p,
so an engine may start a request with its first m positions already cached —
keys and values another request computed for the same tokens at the same
positions (prefix caching) — and run only the tokens after them, m short of
the whole sequence (the last token always runs: its logits choose the next
one). The request's tokens, text, logprobs and finish reason are the loop's.
Fewer tokens in a pass may change a logit in its last bits, as batching
does; equality is then decided with the same explicit near-tie ambiguity —
except for a batch-invariant engine, where it is bitwise (LOOP-INVARIANT-1).

[LOOP-INVARIANT-1] Batch invariance. An engine whose every operation computes
a row from that row alone reproduces the loop bitwise: each step's logits,
hence its token under a seed and every logprob, are the bits of this loop run
on the request alone with the engine's forward pass (`hidden_states`) and
stage functions, whatever else the engine runs (other requests, their number,
lengths and arrival, the token budget's chunks, the block size, preemption),
after a cached prefix, and under speculation (a position's logits in a
(k + 1)-token verify pass are its logits computed alone). Attention
(ATTN-INVARIANT-1) and the sampling stages (SAMPLE-INVARIANT-1,
VERIFY-OUTPUT-1) have it by their own clauses, the norms, RoPE and the MLP's
elementwise steps row by row as they are written; the projections need it of
their matmul, which no stage clause asks: a BLAS picks other kernels, summing
in other orders, for different numbers of rows. decodespec's default engine
(the torch backend on the CPU) has it by construction, with no option: every
pass runs its native step, whose products sum each (weight row, activation
row) pair in one order fixed by the weight's shape (QUANT-A8-1's for
quantized weights, `reference/native_dense.c` for float32 ones) and whose
attention computes each (row, head) alone, and its sampling stages run on one
thread. Elsewhere (the spec and triton backends, bfloat16 weights, a machine
without a C compiler) `--batch-invariant` gives it where the machine's GEMM
keeps a row's bits at every row count (`reference/batch_invariance.py`,
which measures it and refuses otherwise).

[LOOP-DECODE-1] Every later step t (counting from 0) runs exactly one token,
the one step t − 1 emitted, at position n + t − 1 through the cache; the
logits after it are step t's logits (by FWD-CACHE-1, `forward_naive`'s on
the prompt and the first t output tokens).

[LOOP-SAMPLE-1] The token of step t is `sample(logits[None], **tensors)[0]`
with `tensors = sampling_tensors([params], vocab_size=V,
prompt_token_ids=[prompt], output_token_ids=[output[:t]],
eos_token_ids=eos, device=logits.device)`: the step's raw logits as a batch
of one row, step counter t (the number of tokens generated so far: the
random-number counter of SAMPLE-RNG-2 and the min_tokens clock), penalties
that see the prompt and the output so far. A `sample` passed to `generate`
is called exactly so, once per step.

[LOOP-GRAMMAR-1] A constrained request (`generate(..., matcher=m)`, a
`TokenMatcher`, MASK-MATCHER-1) is the same loop with the grammar's mask at
every step: step t's tensors carry `token_bitmask`, the `[1, ceil(V / 32)]`
int32 row `m.fill_bitmask` writes after the first t output tokens
(MASK-SAMPLE-1), and the chosen token is accepted into the matcher before the
step is streamed (MASK-ADVANCE-1); a step's `TokenLogprobs.removed` are the
ids of its top list that the mask disallowed (raw logprobs are the model's,
so its alternatives may include them; LOOP-LOGPROB-1). A token the matcher refuses raises
ValueError (the mask allowed it, so the matcher and its mask disagree). A
grammar ends the output with its stop token, so `ignore_eos` with a matcher
is a ValueError at the start (LOOP-REQUEST-1). The step whose mask leaves
nothing is invalid (LOOP-VALID-1, MASK-MINTOK-1).

[LOOP-LOGPROB-1] When `params.top_logprobs` is not None, a step's
`TokenLogprobs` are `compute_logprobs(L, [token], top_logprobs)`, with L the
step's raw logits (mode "raw", LOGPROB-RAW-1) or `process_logits` of them
with the step's sampling tensors less the seed (mode "processed"): the
token's logprob and rank and the (token id, logprob) pairs of the top list.
Otherwise they are None.

[LOOP-STOP-1] Each chosen token is appended to the request's `StopChecker`
(prompt length n, the model's context) at once, and the step streams
`StepOutput(token, delta.text, delta.finish_reason, logprobs)`. The loop
ends with the first step that has a finish reason: every chosen token is
streamed, the last carries "stop" or "length", no step runs after it, and
the streamed texts join into the output text.

[LOOP-VALID-1] Invalid logits at a step (SAMPLE-VALID-1: NaN, +inf or all
−inf after the processors) make `sample` raise `InvalidLogitsError`; the
loop raises it on, after the steps already streamed and with no
`StepOutput` for the failed one. The spec's loop has no "error" finish
reason: an engine, which must not raise for one request, maps the error to
a last event with finish reason "error" for that request alone.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from . import sampling
from .append import append_kv
from .attention import paged_attention
from .forward import ModelWeights, PagedBatch, forward_cached, project_logits
from .params import SamplingParams, SamplingTensors, sampling_tensors, validate_request
from .stop import FinishReason, StopChecker
from .token_mask import TokenMatcher, bitmask_words, removed_tokens

KVCache = list[tuple[Tensor, Tensor]]
# hidden_states(token_ids, batch, kv_cache) -> the final hidden states of the tokens,
# their K/V appended: `cached_hidden_states`, or an engine's own forward pass
HiddenStates = Callable[[Tensor, PagedBatch, KVCache], Tensor]


@dataclass(frozen=True)
class TokenLogprobs:
    """Logprob, rank and top alternatives of one generated token (LOOP-LOGPROB-1), and
    the ids of `top` that the request's grammar removed at that step (LOOP-GRAMMAR-1)."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]
    removed: tuple[int, ...] = ()


@dataclass(frozen=True)
class StepOutput:
    """One step's token, the text newly safe to show (STOP-STREAM-1), "stop" or
    "length" on the last step (None before), and its logprobs (LOOP-STOP-1)."""

    token_id: int
    text: str
    finish_reason: FinishReason | None
    logprobs: TokenLogprobs | None


def run_tokens(
    weights: ModelWeights,
    kv_cache: KVCache,
    token_ids: Tensor,
    batch: PagedBatch,
    attention: Callable[..., Tensor],
    append: Callable[..., None],
    hidden_states: HiddenStates | None,
) -> Tensor:
    """`forward_cached`'s logits, the hidden states by `hidden_states` when given."""
    if hidden_states is None:
        return forward_cached(
            weights, token_ids, batch, kv_cache, attention=attention, append=append
        )
    hidden = hidden_states(token_ids, batch, kv_cache)
    return project_logits(hidden[batch.logits_indices], weights.output)


def request_batch(kv_cache: KVCache, start: int, count: int) -> PagedBatch:
    """Where `count` new tokens at positions start, start + 1, … go (LOOP-CACHE-1).

    The block table is 0 … num_blocks − 1, so position p goes to slot p;
    the last token is projected to logits.
    """
    num_blocks, block_size = kv_cache[0][0].shape[:2]
    end = start + count
    if not 0 <= start < end <= num_blocks * block_size:
        raise ValueError(f"positions {start}..{end - 1} do not fit {num_blocks * block_size} slots")
    device = kv_cache[0][0].device
    positions = torch.arange(start, end, device=device)
    return PagedBatch(
        positions=positions,
        query_start=torch.tensor([0, count], device=device),
        seq_lens=torch.tensor([end], device=device),
        block_table=torch.arange(num_blocks, device=device)[None],
        slot_mapping=positions,
        logits_indices=torch.tensor([count - 1], device=device),
    )


@torch.no_grad()
def prefill(
    weights: ModelWeights,
    kv_cache: KVCache,
    prompt_ids: Sequence[int],
    *,
    attention: Callable[..., Tensor] = paged_attention,
    append: Callable[..., None] = append_kv,
    hidden_states: HiddenStates | None = None,
) -> Tensor:
    """Run the prompt into the request's empty cache; `[vocab]` logits after it (LOOP-PREFILL-1)."""
    token_ids = torch.tensor(list(prompt_ids), dtype=torch.int64, device=weights.device)
    batch = request_batch(kv_cache, 0, len(token_ids))
    logits = run_tokens(weights, kv_cache, token_ids, batch, attention, append, hidden_states)
    return logits[0]


@torch.no_grad()
def decode_one_token(
    weights: ModelWeights,
    kv_cache: KVCache,
    token_id: int,
    position: int,
    *,
    attention: Callable[..., Tensor] = paged_attention,
    append: Callable[..., None] = append_kv,
    hidden_states: HiddenStates | None = None,
) -> Tensor:
    """Run one token at `position` through the cache; `[vocab]` logits after it (LOOP-DECODE-1)."""
    token_ids = torch.tensor([token_id], dtype=torch.int64, device=weights.device)
    batch = request_batch(kv_cache, position, 1)
    logits = run_tokens(weights, kv_cache, token_ids, batch, attention, append, hidden_states)
    return logits[0]


def token_logprobs(
    logits: Tensor,
    token_id: int,
    params: SamplingParams,
    tensors: SamplingTensors,
    process_logits: Callable[..., Tensor] = sampling.process_logits,
    compute_logprobs: Callable[..., sampling.Logprobs] = sampling.compute_logprobs,
) -> TokenLogprobs | None:
    """The logprobs of the token chosen from a step's `[vocab]` logits (LOOP-LOGPROB-1)."""
    if params.top_logprobs is None:
        return None
    source = logits[None]
    if params.logprobs_mode == "processed":
        source = process_logits(source, **tensors.process_logits_args)
    chosen = torch.tensor([token_id], dtype=torch.int64, device=logits.device)
    lp = compute_logprobs(source, chosen, params.top_logprobs)
    top = list(zip(lp.top_token_ids[0].tolist(), lp.top_logprobs[0].tolist(), strict=True))
    bitmask = tensors.token_bitmask
    removed = () if bitmask is None else removed_tokens(bitmask[0], [t for t, _ in top])
    return TokenLogprobs(token_id, float(lp.token_logprobs[0]), int(lp.ranks[0]), top, removed)


def generate(
    weights: ModelWeights,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    *,
    eos_token_ids: Iterable[int],
    token_bytes: Callable[[int], bytes],
    block_size: int = 16,
    attention: Callable[..., Tensor] = paged_attention,
    append: Callable[..., None] = append_kv,
    sample: Callable[..., Tensor] = sampling.sample,
    process_logits: Callable[..., Tensor] = sampling.process_logits,
    compute_logprobs: Callable[..., sampling.Logprobs] = sampling.compute_logprobs,
    matcher: TokenMatcher | None = None,
    hidden_states: HiddenStates | None = None,
) -> Iterator[StepOutput]:
    """Generate one request, streaming one `StepOutput` per token (the LOOP clauses).

    The stage functions default to the spec's; others with the same
    signatures may be passed (the kernels, or a `sample` wrapping the
    spec's: it is called as `sample(logits[None], **tensors)` with
    `tensors["step"]` the step, LOOP-SAMPLE-1).

    Args:
        weights: the model.
        prompt_ids: the prompt's token ids, at least one.
        params: the request's parameters, with a seed when temperature > 0.
        eos_token_ids: the model's end-of-sequence ids.
        token_bytes: the bytes of a token id (the text, STOP-UTF8-1).
        block_size: positions per block of the request's cache, >= 1.
        matcher: the request's grammar, fresh (LOOP-GRAMMAR-1); None: unconstrained.
        hidden_states: an engine's forward pass over the cache in place of
            `cached_hidden_states` (with `attention` and `append`), for
            LOOP-INVARIANT-1's comparison; None: the spec's.

    Raises:
        ValueError: an invalid request, or no seed (LOOP-REQUEST-1).
        InvalidLogitsError: a step's logits are invalid (LOOP-VALID-1).

    Example:
        >>> params = SamplingParams(temperature=0.7, seed=1, max_tokens=32)
        >>> for step in generate(weights, tokenizer.encode("Hi"), params,  # doctest: +SKIP
        ...                      eos_token_ids=tokenizer.eos_token_ids,
        ...                      token_bytes=tokenizer.token_bytes):
        ...     print(step.text, end="")
    """
    config = weights.config
    prompt = [operator.index(t) for t in prompt_ids]
    validate_request(params, prompt, vocab_size=config.vocab_size, max_context=config.max_context)
    if params.temperature > 0 and params.seed is None:
        raise ValueError("temperature > 0 needs a seed: resolve the seed first (resolve_seed)")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if matcher is not None and params.ignore_eos:
        raise ValueError("ignore_eos cannot be combined with a grammar (LOOP-GRAMMAR-1)")
    eos = tuple(eos_token_ids)
    stop = StopChecker(
        params,
        eos_token_ids=eos,
        token_bytes=token_bytes,
        prompt_len=len(prompt),
        max_context=config.max_context,
    )
    # The request's cache (LOOP-CACHE-1): room for every position it can reach, all NaN.
    capacity = config.max_context if params.max_tokens is None else len(prompt) + params.max_tokens
    shape = (-(-capacity // block_size), block_size, config.num_kv_heads, config.head_dim)
    nan = {"fill_value": torch.nan, "dtype": weights.dtype, "device": weights.device}
    kv_cache = [(torch.full(shape, **nan), torch.full(shape, **nan)) for _ in weights.layers]

    stages = {"attention": attention, "append": append, "hidden_states": hidden_states}
    logits = prefill(weights, kv_cache, prompt, **stages)
    output: list[int] = []
    while True:
        bitmask = None
        if matcher is not None:
            bitmask = torch.empty(1, bitmask_words(config.vocab_size), dtype=torch.int32)
            matcher.fill_bitmask(bitmask[0])
        tensors = sampling_tensors(
            [params],
            vocab_size=config.vocab_size,
            prompt_token_ids=[prompt],
            output_token_ids=[output],
            eos_token_ids=eos,
            device=logits.device,
            token_bitmask=bitmask,
        )
        token = int(sample(logits[None], **tensors)[0])
        if matcher is not None and not matcher.accept_token(token):
            raise ValueError(f"step {len(output)}: the matcher refuses token {token}")
        logprobs = token_logprobs(logits, token, params, tensors, process_logits, compute_logprobs)
        output.append(token)
        delta = stop.append(token)
        yield StepOutput(token, delta.text, delta.finish_reason, logprobs)
        if delta.finish_reason is not None:
            return
        position = len(prompt) + len(output) - 1
        logits = decode_one_token(weights, kv_cache, token, position, **stages)
