"""The torch backend's forward pass for quantized models on the CPU: C between the products.

A decode step of the spec's decoder (`spec/forward.py`) on a 2-core CPU is
mostly dispatch: beside the projections, the ~75 tensor operations a layer
(norms, RoPE, the KV append, attention, SiLU, residual adds, casts) took
about 11 ms a token of SmolLM2-135M, each too small to be worth its call.
`NativeStep` runs the same layer as eight calls: the four projections on
QUANT-A8-1's C product (`cpu_linear.ActivationQuantizedLinear`, float32 in
and out) and, between them, four calls of three loops in C (`native_step.c`)
that compute what the spec computes there, in float32, on the float32
residual stream and KV cache:

    h = norm(x)             add_rms_norm   FWD-NORM-1
    qkv = h W_qkvᵀ          product
    a = attention(qkv)      attention      RoPE, append_kv, paged_attention
    o = a W_oᵀ              product
    x += o; h = norm(x)     add_rms_norm   FWD-LAYER-1
    gu = h W_guᵀ            product
    m = silu(g) · u         silu_mul       FWD-MLP-1
    x += m W_downᵀ          product, then add_rms_norm of the next layer

It agrees with `spec.forward.cached_hidden_states` on the same packed
weights to float32's rounding: the products are the same calls, only the
order of the other float32 sums differs; a sum that moves in its last bit
can move an activation's int8 code, which the tests allow for
(tests/engine/test_native_step.py).

It takes a model whose every projection is on the C product, with Q/K/V and
gate/up each stacked as one (`cpu_linear.pack_for_cpu` makes both for the
int8 and int4 formats), and passes of up to `MAX_TOKENS` tokens: decode
steps and speculative verification. Longer passes (prefill) stay on the
batched PyTorch path, whose attention uses both cores.

`attention`'s KV append and attention are the C functions `append_kv` and
`paged_attention`, which `native_attention.py` exposes as the stage
contract's operations: the conformance suite runs on them
(`--impl decodespec.reference.native_attention`).

The C loops are compiled once per machine (`native_library`). Where that
fails (no compiler, a compile error, an unwritable cache directory, a
library that does not load from a noexec one) the backend says so in one
line on stderr and runs the PyTorch path;
`status()` says which path runs ("native step (C, cc 12.2.0)" or "off:
<why>"). `DECODESPEC_NATIVE=0` turns the native step off.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from decodespec.spec import append
from decodespec.spec.attention import check_attention_args
from decodespec.spec.forward import (
    ModelWeights,
    PagedBatch,
    check_tokens,
    rms_norm,
    rope_angles,
    rope_inverse_frequencies,
)

from . import native_library
from .cpu_linear import ActivationQuantizedLinear, SharedInputMember
from .native_library import NativeUnavailable, describe, library

# Longer passes run the batched PyTorch path, faster for one prompt from about 56 tokens
# (SmolLM2-135M int4 on PyTorch's kernels, 2 cores: 48 tokens 81 ms native, 84 ms batched;
# 64 tokens 111 and 107; not remeasured with the C product).
MAX_TOKENS = 48


def status(weights: ModelWeights | None = None) -> str:
    """Which path the torch backend's short passes take, in a few words: "native step
    (C, cc 12.2.0)", or "off: <why>" when they run the batched PyTorch path
    (`DECODESPEC_NATIVE=0`, a model the step does not take, or a library that cannot
    be built or loaded here). Builds the library if no one has yet."""
    if native_library.disabled():
        return "off: DECODESPEC_NATIVE=0"
    try:
        lib = library()
    except NativeUnavailable as e:
        return f"off: {e}"
    reason = None if weights is None else unsupported(weights)
    return f"off: {reason}" if reason is not None else f"native step ({describe(lib)})"


@dataclass
class _Layer:
    """One layer's products (bound) and the addresses of its float32 vectors."""

    qkv: Callable[[Tensor], Tensor]
    o: Callable[[Tensor], Tensor]
    gate_up: Callable[[Tensor], Tensor]
    down: Callable[[Tensor], Tensor]
    attn_norm: int
    mlp_norm: int
    bias: int | None  # q, k and v biases side by side


def _stacked(members: list[object], widths: list[int]) -> object | None:
    """The one kernel computing `members` side by side, in order, or None."""
    if not all(isinstance(m, SharedInputMember) for m in members):
        return None
    shared = members[0].shared
    starts = [sum(widths[:i]) for i in range(len(widths))]
    if any(m.shared is not shared or m.start != s for m, s in zip(members, starts, strict=True)):
        return None
    return shared.kernel


def unsupported(weights: ModelWeights) -> str | None:
    """Why `NativeStep` cannot run `weights`, or None when it can."""
    c = weights.config
    if weights.device.type != "cpu" or weights.dtype != torch.float32:
        return "the native step runs float32 activations on the CPU"
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    for i, layer in enumerate(weights.layers):
        qkv = _stacked([layer.q_proj, layer.k_proj, layer.v_proj], [q, kv, kv])
        gate_up = _stacked([layer.gate_proj, layer.up_proj], [c.intermediate_size] * 2)
        if qkv is None or gate_up is None:
            return f"layer {i}'s Q/K/V or gate/up projections are not one CPU kernel"
        products = (qkv, gate_up, layer.o_proj, layer.down_proj)
        if not all(isinstance(w, ActivationQuantizedLinear) for w in products):
            return f"layer {i}'s projections are not on the C product (QUANT-A8-1)"
    return None


class NativeStep:
    """`spec.forward.cached_hidden_states` for a model packed by `cpu_linear.pack_for_cpu`,
    its steps between the projections in C (see the module docstring).

    Example:
        >>> step = NativeStep(weights)                         # doctest: +SKIP
        >>> hidden = step(token_ids, paged_batch, kv_cache)    # doctest: +SKIP
    """

    def __init__(self, weights: ModelWeights) -> None:
        reason = unsupported(weights)
        if reason is not None:
            raise ValueError(reason)
        self.lib = library()
        self.description = f"native step ({describe(self.lib)})"  # as `status` says
        self.weights = weights
        c = weights.config
        self.layers = []
        self.vectors: list[Tensor] = []  # what the layers' addresses point into
        for layer in weights.layers:
            biases = (layer.q_bias, layer.k_bias, layer.v_bias)
            bias = None if biases[0] is None else torch.cat(biases).float().contiguous()
            norms = [n.float().contiguous() for n in (layer.attn_norm, layer.mlp_norm)]
            self.vectors += [*norms, *([] if bias is None else [bias])]
            self.layers.append(
                _Layer(
                    layer.q_proj.shared.kernel.linear,
                    layer.o_proj.linear,
                    layer.gate_proj.shared.kernel.linear,
                    layer.down_proj.linear,
                    norms[0].data_ptr(),
                    norms[1].data_ptr(),
                    None if bias is None else bias.data_ptr(),
                )
            )
        self.max_tokens = MAX_TOKENS
        self.inv_freq = rope_inverse_frequencies(c, torch.float32)
        self.eps = float(c.rms_norm_eps)

    def __call__(
        self, token_ids: Tensor, batch: PagedBatch, kv_cache: list[tuple[Tensor, Tensor]]
    ) -> Tensor:
        """`[tokens, hidden]` final-normed hidden states; K/V appended to `kv_cache`
        (the arguments and errors of `cached_hidden_states`)."""
        w, c = self.weights, self.weights.config
        if len(kv_cache) != len(w.layers):
            raise ValueError(f"kv_cache has {len(kv_cache)} layers, the model {len(w.layers)}")
        check_tokens(c, token_ids, batch.positions)
        tokens, d = token_ids.shape[0], c.head_dim
        caches = self._check(tokens, batch, kv_cache)
        if tokens == 0:
            return torch.empty(0, c.hidden_size)
        lens = batch.seq_lens.tolist()
        index = [t.to(torch.int64).contiguous() for t in (
            batch.slot_mapping, batch.block_table, batch.seq_lens, batch.query_start)]  # fmt: skip
        cos, sin = (a.reshape(tokens, d // 2).contiguous() for a in
                    rope_angles(batch.positions, self.inv_freq, torch.float32))  # fmt: skip
        width = (c.num_heads + 2 * c.num_kv_heads) * d
        scratch = torch.empty(tokens * width + d + max(lens, default=0))
        x = w.embedding[token_ids].float().contiguous()
        h = torch.empty(tokens, c.hidden_size)
        attended = torch.empty(tokens, c.num_heads * d)
        mlp = torch.empty(tokens, c.intermediate_size)
        slots, table, seq_lens, starts = index
        # The arguments every layer's attention shares, after its qkv and bias and
        # before its caches; then those after its caches.
        shape = (c.num_heads, c.num_kv_heads, d, cos.data_ptr(), sin.data_ptr())
        layout = (kv_cache[0][0].shape[1], slots.data_ptr(), table.data_ptr(), table.shape[1],
                  seq_lens.data_ptr(), starts.data_ptr(), len(lens), scratch.data_ptr(),
                  attended.data_ptr())  # fmt: skip
        lib, eps, hidden, intermediate = self.lib, self.eps, c.hidden_size, c.intermediate_size
        x_, h_, mlp_ = x.data_ptr(), h.data_ptr(), mlp.data_ptr()
        residual, residual_stride = None, 0
        for layer, (k_cache, v_cache) in zip(self.layers, caches, strict=True):
            lib.add_rms_norm(
                x_, residual, residual_stride, layer.attn_norm, eps, h_, tokens, hidden
            )
            qkv = layer.qkv(h)
            lib.attention(qkv.data_ptr(), qkv.stride(0), layer.bias, *shape, k_cache, v_cache,
                          *layout)  # fmt: skip
            o = layer.o(attended)
            lib.add_rms_norm(x_, o.data_ptr(), o.stride(0), layer.mlp_norm, eps, h_, tokens, hidden)
            gate_up = layer.gate_up(h)
            lib.silu_mul(gate_up.data_ptr(), gate_up.stride(0), intermediate, mlp_, tokens)
            down = layer.down(mlp)
            residual, residual_stride = down.data_ptr(), down.stride(0)
        lib.add_rms_norm(x_, residual, residual_stride, None, eps, None, tokens, hidden)
        return rms_norm(x, w.final_norm, c.rms_norm_eps)

    def _check(
        self, tokens: int, batch: PagedBatch, kv_cache: list[tuple[Tensor, Tensor]]
    ) -> list[tuple[int, int]]:
        """ATTN-VALID-1 and APPEND-VALID-1 for the pass (every layer shares the layout),
        and the float32 contiguous caches the C loops address: their addresses."""
        c = self.weights.config
        k_cache, v_cache = kv_cache[0]
        addresses = []
        for k, v in kv_cache:
            for t in (k, v):
                if t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu":
                    raise ValueError("the native step needs contiguous float32 KV caches")
                if t.shape != k_cache.shape:
                    raise ValueError("every layer's KV cache must have one shape")
            addresses.append((k.data_ptr(), v.data_ptr()))
        q = torch.empty(tokens, c.num_heads, c.head_dim)
        kv = torch.empty(tokens, c.num_kv_heads, c.head_dim)
        append.check_append_args(kv, kv, k_cache, v_cache, batch.slot_mapping)  # the spec's own
        check_attention_args(
            q, k_cache, v_cache, batch.block_table, batch.seq_lens, batch.query_start, None
        )
        return addresses


def native_step(weights: ModelWeights) -> NativeStep | None:
    """The native step for `weights`, or None where it does not apply: the model's
    reason (`unsupported`), `DECODESPEC_NATIVE=0`, or the machine's (the library
    cannot be built or loaded: `native_library` says so on stderr, once a process).
    `status(weights)` says which, for the engine to show."""
    if native_library.disabled():
        return None
    try:
        library()
    except NativeUnavailable:
        return None
    return None if unsupported(weights) is not None else NativeStep(weights)
