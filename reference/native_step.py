"""The torch backend's forward pass for quantized models on the CPU: C between the kernels.

A decode step of the spec's decoder (`spec/forward.py`) on a 2-core CPU is
mostly dispatch: the int4 kernels take about 4.6 ms a token of SmolLM2-135M,
the other ~75 tensor operations a layer (norms, RoPE, the KV append,
attention, SiLU, residual adds, casts) about 11 ms, each too small to be
worth its call. `NativeStep` runs the same layer as eight calls: the four
projections on PyTorch's CPU kernels (`cpu_linear`, bfloat16 in and out)
and, between them, four calls of three loops in C (`native_step.c`) that
compute what the spec computes there, in float32, on the float32 residual
stream and KV cache:

    h = norm(x)             add_rms_norm   FWD-NORM-1
    qkv = h W_qkvᵀ          kernel
    a = attention(qkv)      attention      RoPE, append_kv, paged_attention
    o = a W_oᵀ              kernel
    x += o; h = norm(x)     add_rms_norm   FWD-LAYER-1
    gu = h W_guᵀ            kernel
    m = silu(g) · u         silu_mul       FWD-MLP-1
    x += m W_downᵀ          kernel, then add_rms_norm of the next layer

It agrees with `spec.forward.cached_hidden_states` on the same packed
weights within bfloat16's tolerance: the kernels' inputs are rounded to
bfloat16 exactly where `CpuInt4Linear.linear` rounds them and only the order
of float32 sums differs, but a sum that differs in its last bit can round to
the neighbouring bfloat16 (tests/engine/test_native_step.py).

It takes a model whose every projection is on a CPU kernel, with Q/K/V and
gate/up each stacked as one (`cpu_linear.pack_for_cpu` makes both for the
int8 and int4 formats), and passes of up to `MAX_TOKENS` tokens: decode
steps and speculative verification. Longer passes (prefill) stay on the
batched PyTorch path, whose attention uses both cores.

`attention`'s KV append and attention are the C functions `append_kv` and
`paged_attention`, which `native_attention.py` exposes as the stage
contract's operations: the conformance suite runs on them
(`--impl decodespec.reference.native_attention`).

The C loops are compiled once per machine with the system's C compiler into
the user's cache directory. Where that fails (no compiler, a compile error,
an unwritable cache directory, a library that does not load from a noexec
one) the backend says so in one line on stderr and runs the PyTorch path;
`status()` says which path runs ("native step (C, cc 12.2.0)" or "off:
<why>"). `DECODESPEC_NATIVE=0` turns the native step off.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

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

from .cpu_linear import KERNEL_DTYPE, CpuInt4Linear, CpuInt8Linear, SharedInputMember

SOURCE = Path(__file__).with_name("native_step.c")
# Reassociation lets the compiler vectorize the dot products and sums (attention's,
# the norm's): another order of float32 sums, as any kernel's.
CFLAGS = ("-O3", "-shared", "-fPIC", "-ffp-contract=off", "-fno-math-errno",
          "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros")  # fmt: skip
# Longer passes run the batched PyTorch path, faster for one prompt from about 56 tokens
# (SmolLM2-135M int4, 2 cores: 48 tokens 81 ms native, 84 ms batched; 64 tokens 111 and 107).
MAX_TOKENS = 48

_VOID_P, _I64, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "add_rms_norm": [_VOID_P, _VOID_P, _I64, _VOID_P, _F32, _VOID_P, _I64, _I64],
    "silu_mul": [_VOID_P, _I64, _I64, _VOID_P, _I64],
    "attention": [_VOID_P, _I64, _VOID_P, _I64, _I64, _I64, _VOID_P, _VOID_P, _VOID_P, _VOID_P,
                  _I64, _VOID_P, _VOID_P, _I64, _VOID_P, _VOID_P, _I64, _VOID_P, _VOID_P],
    # The stage contract's operations, which `attention` calls (native_attention.py).
    "append_kv": [_VOID_P, _I64, _VOID_P, _I64, _VOID_P, _VOID_P, _I64, _VOID_P, _I64],
    "paged_attention": [_VOID_P, _I64, _I64, _I64, _I64, _F32, _VOID_P, _VOID_P, _I64, _VOID_P,
                        _I64, _VOID_P, _VOID_P, _I64, _VOID_P, _VOID_P, _I64, _VOID_P],
}  # fmt: skip


class NativeUnavailable(RuntimeError):
    """The C library cannot be built or loaded here; the message says why, on one line."""


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "decodespec"


def compiler() -> str:
    return os.environ.get("CC", "cc")


def _first_error(stderr: str) -> str:
    """The compiler's first error line (the one that says what is wrong), or its first line."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    return (errors or lines or ["no message"])[0]


def library_path() -> Path:
    """Where the library of this source, these flags and this compiler lives."""
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join((compiler(), *CFLAGS)).encode()).hexdigest()[:16]
    return cache_dir() / f"native_step-{key}.so"


def build_library() -> Path:
    """The compiled `native_step.c` (`library_path`), built once per source, flags and
    compiler.

    Raises:
        NativeUnavailable: no C compiler, the compile failed (its first error line
            attached), or the cache directory cannot be written.
    """
    target = library_path()
    if target.exists():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        # Built beside the target and renamed into place: concurrent builds (test
        # workers) never load a half-written library.
        with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
            built = Path(scratch) / target.name
            try:
                result = subprocess.run(
                    [compiler(), *CFLAGS, "-o", str(built), str(SOURCE), "-lm"],
                    capture_output=True,
                    text=True,
                )
            except FileNotFoundError as e:
                raise NativeUnavailable(f"no C compiler ({compiler()!r} not found)") from e
            except OSError as e:  # not executable, say
                raise NativeUnavailable(f"cannot run {compiler()!r}: {e.strerror or e}") from e
            if result.returncode != 0:
                raise NativeUnavailable(
                    f"{compiler()} failed on {SOURCE.name}: {_first_error(result.stderr)}"
                )
            os.replace(built, target)
    except OSError as e:  # a read-only home, a cache path through a file, a full disk
        raise NativeUnavailable(f"cannot build in {target.parent}: {e.strerror or e}") from e
    return target


_LIBRARY: ctypes.CDLL | None = None
_FAILURE: str | None = None  # why the library could not be built or loaded, once tried


def _load() -> ctypes.CDLL:
    path = build_library()
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:  # a noexec cache directory, a damaged file; dlerror names the path
        raise NativeUnavailable(f"cannot load {e}") from e
    for name, argtypes in _SIGNATURES.items():
        getattr(lib, name).argtypes = argtypes
        getattr(lib, name).restype = None
    lib.compiler_version.argtypes, lib.compiler_version.restype = [], ctypes.c_char_p
    return lib


def library() -> ctypes.CDLL:
    """The loaded C functions, built on first use.

    A failure is remembered: later calls raise it again without another compile.

    Raises:
        NativeUnavailable: as `build_library`, or the library does not load.
    """
    global _LIBRARY, _FAILURE
    if _LIBRARY is None:
        if _FAILURE is not None:
            raise NativeUnavailable(_FAILURE)
        try:
            _LIBRARY = _load()
        except NativeUnavailable as e:
            _FAILURE = " ".join(str(e).split())  # one line, for stderr and `status`
            raise NativeUnavailable(_FAILURE) from e.__cause__
    return _LIBRARY


def status(weights: ModelWeights | None = None) -> str:
    """Which path the torch backend's short passes take, in a few words: "native step
    (C, cc 12.2.0)", or "off: <why>" when they run the batched PyTorch path
    (`DECODESPEC_NATIVE=0`, a model the step does not take, or a library that cannot
    be built or loaded here). Builds the library if no one has yet."""
    if os.environ.get("DECODESPEC_NATIVE", "1") == "0":
        return "off: DECODESPEC_NATIVE=0"
    reason = None if weights is None else unsupported(weights)
    if reason is not None:
        return f"off: {reason}"
    try:
        return _describe(library())
    except NativeUnavailable as e:
        return f"off: {e}"


def _describe(lib: ctypes.CDLL) -> str:
    return f"native step (C, {Path(compiler()).name} {lib.compiler_version().decode()})"


Kernel = CpuInt4Linear | CpuInt8Linear


def kernel_product(kernel: Kernel) -> Callable[[Tensor], Tensor]:
    """The kernel's raw product: bfloat16 `x` `[tokens, in_features]` to bfloat16
    `[tokens, out_features (padded)]`, its operator overload bound once."""
    if isinstance(kernel, CpuInt4Linear):
        int4_mm = torch.ops.aten._weight_int4pack_mm_for_cpu.default
        packed, group_size, scale_and_zero = kernel.packed, kernel.group_size, kernel.scale_and_zero
        return lambda x: int4_mm(x, packed, group_size, scale_and_zero)
    int8_mm = torch.ops.aten._weight_int8pack_mm.default
    return lambda x: int8_mm(x, kernel.qweight, kernel.scales)


@dataclass
class _Layer:
    """One layer's kernels (bound products) and the addresses of its float32 vectors."""

    qkv: Callable[[Tensor], Tensor]
    o: Callable[[Tensor], Tensor]
    gate_up: Callable[[Tensor], Tensor]
    down: Callable[[Tensor], Tensor]
    attn_norm: int
    mlp_norm: int
    bias: int | None  # q, k and v biases side by side


def _stacked(members: list[object], widths: list[int]) -> Kernel | None:
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
        if not all(
            isinstance(w, (CpuInt4Linear, CpuInt8Linear)) for w in (layer.o_proj, layer.down_proj)
        ):
            return f"layer {i}'s o_proj or down_proj is not on a CPU kernel"
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
        self.description = _describe(self.lib)  # what the engine reports (`status`)
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
                    kernel_product(layer.q_proj.shared.kernel),
                    kernel_product(layer.o_proj),
                    kernel_product(layer.gate_proj.shared.kernel),
                    kernel_product(layer.down_proj),
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
        h = torch.empty(tokens, c.hidden_size, dtype=KERNEL_DTYPE)
        attended = torch.empty(tokens, c.num_heads * d, dtype=KERNEL_DTYPE)
        mlp = torch.empty(tokens, c.intermediate_size, dtype=KERNEL_DTYPE)
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
    cannot be built or loaded), which one line on stderr reports, once a process.
    `status(weights)` says which, for the engine to show."""
    if os.environ.get("DECODESPEC_NATIVE", "1") == "0" or unsupported(weights) is not None:
        return None
    reported = _FAILURE is not None
    try:
        return NativeStep(weights)
    except NativeUnavailable as e:
        if not reported:
            print(f"decodespec: native decode step off ({e}); running PyTorch's", file=sys.stderr)
        return None
