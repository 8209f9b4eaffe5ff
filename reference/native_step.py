"""The torch backend's forward pass on the CPU: C between the products.

A decode step of the spec's decoder (`spec/forward.py`) on a 2-core CPU is
mostly dispatch: beside the projections, the ~75 tensor operations a layer
(norms, RoPE, the KV append, attention, SiLU, residual adds, casts) took
about 11 ms a token of SmolLM2-135M, each too small to be worth its call, and
even one Python call per projection and per loop cost about 4 ms a token.
`NativeStep` runs every layer in one C call (`decoder_layers` in
`native_step.c`): the four projections on the C products (QUANT-A8-1's,
which `cpu_linear.ActivationQuantizedLinear` calls, or the float32 one
`cpu_linear.DenseLinear` calls; float32 in and out) and, between them,
three loops that compute what the spec computes there, in float32, on the
float32 residual stream and KV cache:

    h = norm(x)             add_rms_norm   FWD-NORM-1
    qkv = h W_qkvᵀ          product
    a = attention(qkv)      attention      RoPE, append_kv, paged_attention
    o = a W_oᵀ              product
    x += o; h = norm(x)     add_rms_norm   FWD-LAYER-1
    gu = h W_guᵀ            product
    m = silu(g) · u         silu_mul       FWD-MLP-1
    x += m W_downᵀ          product, then add_rms_norm of the next layer

The final norm is the spec's `rms_norm`; the runner projects the logits.

It agrees with `spec.forward.cached_hidden_states` on the same packed
weights to float32's rounding: the products are the same calls, only the
order of the other float32 sums differs; a sum that moves in its last bit
can move an activation's int8 code, which the tests allow for
(tests/engine/test_native_step.py).

It takes a model whose every projection is on a C product, with Q/K/V and
gate/up each stacked as one (`cpu_linear.pack_for_cpu` makes both for the
int8, int4 and float32 formats), and passes of up to `MAX_TOKENS` tokens:
decode steps, speculative verification and prompts (in chunks of the token
budget, which the engine holds to `MAX_TOKENS`). A longer pass takes the
batched PyTorch path.

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

import torch
from torch import Tensor

from decodespec.spec import append
from decodespec.spec.attention import check_attention_args
from decodespec.spec.forward import (
    ModelWeights,
    PagedBatch,
    cached_hidden_states,
    check_tokens,
    rms_norm,
    rope_angles,
    rope_inverse_frequencies,
)

from . import native_library
from .cpu_linear import ActivationQuantizedLinear, DenseLinear, SharedInputMember
from .native_library import NativeUnavailable, describe, library

# Longer passes run the batched PyTorch path. The step's own buffers take about 33 KB a
# token on SmolLM2-135M (135 MB at this bound). A prompt in one pass on it, int4, 2 cores:
# 500 tokens 1.2 s against 2.0 s batched, 2,000 tokens 8.7-9.2 s against 19.9-20.5 s.
MAX_TOKENS = 4096


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
        if not all(isinstance(w, (ActivationQuantizedLinear, DenseLinear)) for w in products):
            return f"layer {i}'s projections are not on the C products (QUANT-A8-1, float32)"
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
        # decoder_layers' table (native_step.c): a row a layer, its four products'
        # weights, then the addresses of its norms and biases; `vectors` holds what
        # those addresses point into.
        rows, self.vectors = [], []
        for layer in weights.layers:
            biases = (layer.q_bias, layer.k_bias, layer.v_bias)
            bias = None if biases[0] is None else torch.cat(biases).float().contiguous()
            norms = [n.float().contiguous() for n in (layer.attn_norm, layer.mlp_norm)]
            self.vectors += [*norms, *([] if bias is None else [bias])]
            products = (layer.q_proj.shared.kernel, layer.o_proj,
                        layer.gate_proj.shared.kernel, layer.down_proj)  # fmt: skip
            rows.append([field for p in products for field in p.arguments]
                        + [norms[0].data_ptr(), norms[1].data_ptr(),
                           0 if bias is None else bias.data_ptr()])  # fmt: skip
        self.table = torch.tensor(rows, dtype=torch.int64)
        self.dims = torch.tensor([c.hidden_size, c.intermediate_size, c.num_heads,
                                  c.num_kv_heads, c.head_dim], dtype=torch.int64)  # fmt: skip
        self.max_tokens = MAX_TOKENS
        self.inv_freq = rope_inverse_frequencies(c, torch.float32)
        self.eps = float(c.rms_norm_eps)
        # The caches `_check` last passed, and their addresses for decoder_layers.
        self._checked: list[tuple[Tensor, Tensor]] = []
        self._addresses = torch.empty(0, 2, dtype=torch.int64)

    def __call__(
        self, token_ids: Tensor, batch: PagedBatch, kv_cache: list[tuple[Tensor, Tensor]]
    ) -> Tensor:
        """`[tokens, hidden]` final-normed hidden states; K/V appended to `kv_cache`
        (the arguments and errors of `cached_hidden_states`)."""
        w, c = self.weights, self.weights.config
        if len(kv_cache) != len(w.layers):
            raise ValueError(f"kv_cache has {len(kv_cache)} layers, the model {len(w.layers)}")
        check_tokens(c, token_ids, batch.positions)
        tokens = token_ids.shape[0]
        caches = self._check(tokens, batch, kv_cache)
        if tokens == 0:
            return torch.empty(0, c.hidden_size)
        slots, table, seq_lens, starts = (t.to(torch.int64).contiguous() for t in (
            batch.slot_mapping, batch.block_table, batch.seq_lens, batch.query_start))  # fmt: skip
        cos, sin = (a.reshape(tokens, c.head_dim // 2).contiguous() for a in
                    rope_angles(batch.positions, self.inv_freq, torch.float32))  # fmt: skip
        x = w.embedding[token_ids].float().contiguous()
        failed = self.lib.decoder_layers(
            self.table.data_ptr(), caches.data_ptr(), len(w.layers), self.dims.data_ptr(),
            self.eps, x.data_ptr(), tokens, cos.data_ptr(), sin.data_ptr(),
            kv_cache[0][0].shape[1], slots.data_ptr(), table.data_ptr(), table.shape[1],
            seq_lens.data_ptr(), starts.data_ptr(), len(seq_lens), torch.get_num_threads(),
        )  # fmt: skip
        if failed:
            raise MemoryError("no memory for the native step's activations")
        return rms_norm(x, w.final_norm, c.rms_norm_eps)

    def _check(
        self, tokens: int, batch: PagedBatch, kv_cache: list[tuple[Tensor, Tensor]]
    ) -> Tensor:
        """ATTN-VALID-1 and APPEND-VALID-1 for the pass (every layer shares the layout),
        and the float32 contiguous caches the C loops address: their addresses,
        `[layers, 2]` int64. The caches' own checks run once for the same tensors."""
        c = self.weights.config
        k_cache, v_cache = kv_cache[0]
        addresses = [[k.data_ptr(), v.data_ptr()] for k, v in kv_cache]
        same = addresses == self._addresses.tolist() and all(
            k is k0 and v is v0 for (k, v), (k0, v0) in zip(kv_cache, self._checked, strict=True)
        )
        if not same:
            for k, v in kv_cache:
                for t in (k, v):
                    if (t.dtype != torch.float32 or not t.is_contiguous()
                            or t.device.type != "cpu"):  # fmt: skip
                        raise ValueError("the native step needs contiguous float32 KV caches")
                    if t.shape != k_cache.shape:
                        raise ValueError("every layer's KV cache must have one shape")
            self._checked = list(kv_cache)  # held: an identity match is never a recycled id
            self._addresses = torch.tensor(addresses, dtype=torch.int64)
        q = torch.empty(tokens, c.num_heads, c.head_dim)
        kv = torch.empty(tokens, c.num_kv_heads, c.head_dim)
        append.check_append_args(kv, kv, k_cache, v_cache, batch.slot_mapping)  # the spec's own
        check_attention_args(
            q, k_cache, v_cache, batch.block_table, batch.seq_lens, batch.query_start, None
        )
        return self._addresses


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


def hidden_states(
    step: NativeStep | None,
    weights: ModelWeights,
    token_ids: Tensor,
    batch: PagedBatch,
    kv_cache: list[tuple[Tensor, Tensor]],
    *,
    attention: Callable[..., Tensor],
    append: Callable[..., None],
) -> Tensor:
    """`spec.forward.cached_hidden_states` of a pass: on `step` (the native step for
    `weights`) where it takes the pass (up to its `max_tokens` tokens), otherwise the
    spec's decoder with the backend's `attention` and `append`. The target's passes
    and a model drafter's go through here, so both compute a row the same way."""
    if step is not None and token_ids.shape[0] <= step.max_tokens:
        return step(token_ids, batch, kv_cache)
    return cached_hidden_states(
        weights, token_ids, batch, kv_cache, attention=attention, append=append
    )
