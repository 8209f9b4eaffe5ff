"""Forward pass: the Llama-family decoder, from token ids to logits.

One decoder serves Llama, Mistral, Qwen2 and SmolLM checkpoints (they differ
only in the options of `ModelConfig`). It runs in two modes over the same
weights and the same layer code:

- naive (`forward_naive`): one sequence, every position recomputed from
  scratch, plain causal attention — the definition of what the model computes;
- cached (`forward_cached`): the tokens of several sequences packed in one
  call, their K/V appended to a paged cache (`decodespec.spec.append.append_kv`) and
  their queries attending over it (`decodespec.spec.attention.paged_attention`): prefill,
  decode and chunked prefill are all this one function.

[FWD-EMBED-1] The input of the first layer is the row of the embedding
matrix `E` (`[vocab, hidden]`) of each token id.

[FWD-NORM-1] RMSNorm: `y = x / sqrt(mean(x²) + ε) · w`, with the mean and the
square root in float32 whatever the activation dtype; the result is cast back
to the activation dtype before the weight multiplies it (as Llama's reference
code does).

[FWD-ROPE-1] Rotary position embedding, half-split layout: the head dimension
d is split into halves (x₁, x₂) and position m rotates them by angles
`m · θ^(−2i/d)`, i = 0 … d/2 − 1:
`(x₁ cos − x₂ sin, x₂ cos + x₁ sin)`. Angles are computed in float32 (float64
for float64 weights). GGUF files store Q and K rows interleaved for
llama.cpp's layout; the loader un-permutes them into this one.

[FWD-ROPE-2] Llama 3 scaled RoPE (`rope_scaling.rope_type == "llama3"`):
inverse frequencies with wavelength above `original_context / low_freq_factor`
are divided by `factor`; below `original_context / high_freq_factor` they are
kept; in between they are interpolated with
`s = (original_context / wavelength − low) / (high − low)`:
`(1 − s) · f / factor + s · f`.

[FWD-ATTN-1] Attention: `q = x W_qᵀ (+ b_q)`, `k = x W_kᵀ (+ b_k)`,
`v = x W_vᵀ (+ b_v)` (biases only for configs with `attention_bias`, e.g.
Qwen2), RoPE on q and k, causal softmax attention with scale 1/√d where query
head h reads KV head `h // (num_heads / num_kv_heads)` (grouped-query
attention), then `o W_oᵀ`.

[FWD-MLP-1] The MLP is SwiGLU: `W_down (silu(W_gate x) ⊙ W_up x)`.

[FWD-LAYER-1] A layer is pre-norm with residuals:
`h = x + attn(norm₁(x))`, `out = h + mlp(norm₂(h))`. After the last layer the
final norm is applied and the output projection gives the logits
(LOGITS-PROJ-1); with `tie_word_embeddings` the output projection is `E`.

[FWD-QUANT-1] A projection (Q, K, V, O, gate, up, down, or the output
projection) may be stored quantized (`decodespec.spec.quant.QuantizedWeight`,
QUANT-GROUP-1): `x Wᵀ` is then the weight-only quantized linear of
QUANT-LINEAR-1, in the activation dtype, and the logits are its result cast
to float32. The activation dtype is the embedding's. Nothing else changes.

[FWD-CACHE-1] Cached and naive mode compute the same function: for every
sequence and position, the logits of `forward_cached` (whatever the split into
prefill chunks and decode steps, the block size, the block table and the other
sequences in the batch) equal those of `forward_naive` on the whole sequence,
within floating-point tolerance.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from .append import append_kv
from .attention import paged_attention
from .logits import compute_logits
from .quant import QuantizedWeight

# A projection: dense `[out_features, in_features]`, or quantized (FWD-QUANT-1). Engines
# may pass any object with QuantizedWeight's `shape`, `linear`, `dequantize` and `to`.
Weight = Tensor | QuantizedWeight


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3 RoPE scaling parameters (FWD-ROPE-2)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_context: int


@dataclass(frozen=True)
class ModelConfig:
    """The shape and options of a Llama-family decoder."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_context: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10_000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads < 1 or self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a positive multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim < 2 or self.head_dim % 2:
            raise ValueError(f"head_dim must be even (RoPE rotates pairs), got {self.head_dim}")


@dataclass
class LayerWeights:
    """One decoder layer; projections are `[out_features, in_features]`."""

    attn_norm: Tensor  # [hidden]
    q_proj: Weight  # [num_heads * head_dim, hidden]
    k_proj: Weight  # [num_kv_heads * head_dim, hidden]
    v_proj: Weight  # [num_kv_heads * head_dim, hidden]
    o_proj: Weight  # [hidden, num_heads * head_dim]
    mlp_norm: Tensor  # [hidden]
    gate_proj: Weight  # [intermediate, hidden]
    up_proj: Weight  # [intermediate, hidden]
    down_proj: Weight  # [hidden, intermediate]
    q_bias: Tensor | None = None  # [num_heads * head_dim], configs with attention_bias
    k_bias: Tensor | None = None
    v_bias: Tensor | None = None


@dataclass
class ModelWeights:
    """All weights of a model, with its config."""

    config: ModelConfig
    embedding: Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    final_norm: Tensor  # [hidden]
    output: Weight  # [vocab, hidden]; the embedding itself when tied

    @property
    def dtype(self) -> torch.dtype:
        return self.embedding.dtype

    @property
    def device(self) -> torch.device:
        return self.embedding.device

    def to(self, device: torch.device | str) -> ModelWeights:
        """The same weights on `device` (a tied output stays tied: one tensor)."""

        def move(t: Weight | None) -> Weight | None:
            return None if t is None else t.to(device)

        layers = [
            LayerWeights(**{f.name: move(getattr(layer, f.name)) for f in fields(layer)})
            for layer in self.layers
        ]
        embedding = self.embedding.to(device)
        output = embedding if self.output is self.embedding else self.output.to(device)
        return ModelWeights(self.config, embedding, layers, self.final_norm.to(device), output)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dimension (FWD-NORM-1).

    `F.rms_norm` computes `x / sqrt(mean(x²) + ε)`; it runs on the float32
    upcast, and the weight multiplies after the cast back to x's dtype.
    """
    x32 = x.to(torch.promote_types(x.dtype, torch.float32))
    normed = torch.nn.functional.rms_norm(x32, (x.shape[-1],), eps=eps)
    return weight * normed.to(x.dtype)


def rope_inverse_frequencies(config: ModelConfig, dtype: torch.dtype) -> Tensor:
    """`[head_dim / 2]` inverse frequencies θ^(−2i/d), Llama 3 scaled if configured.

    (FWD-ROPE-1, FWD-ROPE-2.)
    """
    d = config.head_dim
    inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, d, 2, dtype=dtype) / d)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    wavelength = 2 * math.pi / inv_freq
    low_wavelength = scaling.original_context / scaling.low_freq_factor
    high_wavelength = scaling.original_context / scaling.high_freq_factor
    s = (scaling.original_context / wavelength - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    interpolated = (1 - s) * inv_freq / scaling.factor + s * inv_freq
    scaled = torch.where(wavelength > low_wavelength, inv_freq / scaling.factor, inv_freq)
    medium = (wavelength >= high_wavelength) & (wavelength <= low_wavelength)
    return torch.where(medium, interpolated, scaled)


def rope_angles(positions: Tensor, inv_freq: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and sin of each token's rotation angles, `[tokens, 1, head_dim / 2]` (FWD-ROPE-1).

    Computed once per forward pass and shared by every layer.
    """
    angles = positions.to(inv_freq.dtype)[:, None] * inv_freq[None, :]
    return angles.cos()[:, None, :].to(dtype), angles.sin()[:, None, :].to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the halves of `x` `[tokens, heads, head_dim]` by the angles (FWD-ROPE-1)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _linear(x: Tensor, weight: Weight, bias: Tensor | None = None) -> Tensor:
    """`x Wᵀ (+ b)`; a quantized `W` computes its own product (FWD-QUANT-1)."""
    out = x @ weight.T if isinstance(weight, Tensor) else weight.linear(x)
    return out if bias is None else out + bias


def project_logits(hidden_states: Tensor, output: Weight) -> Tensor:
    """Float32 logits of final hidden states (LOGITS-PROJ-1; FWD-QUANT-1 when quantized)."""
    if isinstance(output, Tensor):
        return compute_logits(hidden_states, output)
    return output.linear(hidden_states).to(torch.promote_types(hidden_states.dtype, torch.float32))


# attend(layer_index, q, k, v) -> attention output, all [tokens, heads, head_dim]
Attend = Callable[[int, Tensor, Tensor, Tensor], Tensor]


def decoder_layer(
    index: int,
    layer: LayerWeights,
    config: ModelConfig,
    x: Tensor,
    rope: tuple[Tensor, Tensor],
    attend: Attend,
) -> Tensor:
    """One pre-norm decoder layer (FWD-ATTN-1, FWD-MLP-1, FWD-LAYER-1).

    `rope` is the (cos, sin) pair of `rope_angles` for the tokens of `x`.
    """
    tokens = x.shape[0]
    d = config.head_dim
    h = rms_norm(x, layer.attn_norm, config.rms_norm_eps)
    q = _linear(h, layer.q_proj, layer.q_bias).view(tokens, config.num_heads, d)
    k = _linear(h, layer.k_proj, layer.k_bias).view(tokens, config.num_kv_heads, d)
    v = _linear(h, layer.v_proj, layer.v_bias).view(tokens, config.num_kv_heads, d)
    # q and k rotate by the same angles: one call over their heads side by side.
    q, k = apply_rope(torch.cat([q, k], dim=1), *rope).split(
        [config.num_heads, config.num_kv_heads], dim=1
    )
    attention = attend(index, q, k, v).reshape(tokens, config.num_heads * d)
    x = x + _linear(attention, layer.o_proj)
    h = rms_norm(x, layer.mlp_norm, config.rms_norm_eps)
    mlp = _linear(
        torch.nn.functional.silu(_linear(h, layer.gate_proj)) * _linear(h, layer.up_proj),
        layer.down_proj,
    )
    return x + mlp


def check_tokens(config: ModelConfig, token_ids: Tensor, positions: Tensor) -> None:
    """ValueError unless `token_ids` and `positions` are 1-D of one length, the ids in
    the vocabulary (what every forward pass checks first)."""
    if token_ids.dim() != 1 or positions.shape != token_ids.shape:
        raise ValueError(
            f"token_ids and positions must be 1-D of the same length, got "
            f"{list(token_ids.shape)} and {list(positions.shape)}"
        )
    if token_ids.numel() and (
        int(token_ids.min()) < 0 or int(token_ids.max()) >= config.vocab_size
    ):
        raise ValueError(f"token_ids must be in [0, {config.vocab_size})")


def forward_hidden(
    weights: ModelWeights, token_ids: Tensor, positions: Tensor, attend: Attend
) -> Tensor:
    """`[tokens, hidden]` final-normed hidden states of packed tokens (FWD-EMBED-1 .. -LAYER-1)."""
    config = weights.config
    check_tokens(config, token_ids, positions)
    inv_freq = rope_inverse_frequencies(config, torch.promote_types(weights.dtype, torch.float32))
    rope = rope_angles(positions, inv_freq.to(weights.device), weights.dtype)
    x = weights.embedding[token_ids]
    for index, layer in enumerate(weights.layers):
        x = decoder_layer(index, layer, config, x, rope, attend)
    return rms_norm(x, weights.final_norm, config.rms_norm_eps)


def causal_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Plain causal GQA attention of one sequence, `[tokens, heads, head_dim]` (FWD-ATTN-1)."""
    tokens, num_heads, d = q.shape
    group = num_heads // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    compute = torch.promote_types(q.dtype, torch.float32)
    scores = torch.einsum("qhd,khd->hqk", q.to(compute), k.to(compute)) / math.sqrt(d)
    future = torch.ones(tokens, tokens, dtype=torch.bool, device=q.device).triu(1)
    probs = scores.masked_fill(future, -math.inf).softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v.to(compute)).to(q.dtype)


def forward_naive(weights: ModelWeights, token_ids: Tensor, *, last_only: bool = False) -> Tensor:
    """Logits of the positions of one sequence, everything recomputed from scratch.

    Args:
        weights: the model.
        token_ids: `[tokens]` int, one sequence.
        last_only: project only the last position (what naive decoding needs).

    Returns:
        `[tokens, vocab]` (`[1, vocab]` with last_only) float32 logits (float64
        for float64 weights): row t is the distribution of the token after
        position t.
    """
    hidden = naive_hidden_states(weights, token_ids)
    return project_logits(hidden[-1:] if last_only else hidden, weights.output)


def naive_hidden_states(weights: ModelWeights, token_ids: Tensor) -> Tensor:
    """`forward_naive` before the projection: `[tokens, hidden]` final-normed states."""
    positions = torch.arange(token_ids.shape[0], device=token_ids.device)
    return forward_hidden(
        weights, token_ids, positions, lambda _, q, k, v: causal_attention(q, k, v)
    )


@dataclass
class PagedBatch:
    """Where the packed tokens of one cached forward call go (SEMANTICS.md layout).

    Attributes:
        positions: `[tokens]` position of each token in its sequence.
        query_start: `[batch + 1]` rows of sequence b are query_start[b]..[b+1].
        seq_lens: `[batch]` KV length of each sequence including the new tokens.
        block_table: `[batch, max_blocks]` cache block of each block of positions.
        slot_mapping: `[tokens]` flat cache slot each token's K/V is written to.
        logits_indices: `[rows]` which packed tokens to project to logits
            (usually the last token of each sequence).
    """

    positions: Tensor
    query_start: Tensor
    seq_lens: Tensor
    block_table: Tensor
    slot_mapping: Tensor
    logits_indices: Tensor


def cached_hidden_states(
    weights: ModelWeights,
    token_ids: Tensor,
    batch: PagedBatch,
    kv_cache: list[tuple[Tensor, Tensor]],
    *,
    attention: Callable[..., Tensor] = paged_attention,
    append: Callable[..., None] = append_kv,
) -> Tensor:
    """`forward_cached` before the projection: `[tokens, hidden]` final-normed states
    of every packed token, its K/V appended to the cache (arguments as there)."""
    if len(kv_cache) != len(weights.layers):
        raise ValueError(f"kv_cache has {len(kv_cache)} layers, the model {len(weights.layers)}")

    def attend(index: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        k_cache, v_cache = kv_cache[index]
        # Every layer shares the batch layout and cache shape: check them at the first.
        check = index == 0
        append(k, v, k_cache, v_cache, batch.slot_mapping, validate=check)
        return attention(
            q,
            k_cache,
            v_cache,
            batch.block_table,
            batch.seq_lens,
            batch.query_start,
            validate=check,
        )

    return forward_hidden(weights, token_ids, batch.positions, attend)


def forward_cached(
    weights: ModelWeights,
    token_ids: Tensor,
    batch: PagedBatch,
    kv_cache: list[tuple[Tensor, Tensor]],
    *,
    attention: Callable[..., Tensor] = paged_attention,
    append: Callable[..., None] = append_kv,
) -> Tensor:
    """Run packed tokens of several sequences through the model over a paged KV cache.

    Each layer appends the tokens' K/V to its cache (`append`), then their
    queries attend over everything cached for their sequence (`attention`).
    `attention` and `append` default to the spec; the engine's triton
    backend passes the kernels (same signatures).

    Args:
        weights: the model.
        token_ids: `[tokens]` int, the new tokens of all sequences, packed.
        batch: positions, sequence layout and cache addresses.
        kv_cache: per layer `(k_cache, v_cache)`, each
            `[num_blocks, block_size, num_kv_heads, head_dim]`, updated in place.

    Returns:
        `[len(batch.logits_indices), vocab]` float32 logits (FWD-CACHE-1).
    """
    hidden = cached_hidden_states(
        weights, token_ids, batch, kv_cache, attention=attention, append=append
    )
    return project_logits(hidden[batch.logits_indices], weights.output)
