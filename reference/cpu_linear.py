"""Quantized projections on the CPU (the torch backend's).

`pack_for_cpu` replaces every `QuantizedWeight` of a model on the CPU with an
object that has the same `shape`, `bits`, `group_size`, `linear`,
`dequantize` and `to`, and a faster product.

Where the C library can be had (`native_library`) that product is
`ActivationQuantizedLinear`: QUANT-A8-1, the activation-quantized linear GGUF
engines compute, in C (`native_quantized.c`): the activations quantized to
int8 in blocks of 32, integer dot products with the codes (4-bit weights in
tiles of eight rows packed at load, 8-bit ones in the spec's own layout). It
agrees with `spec.quant.activation_quantized_linear` within float32's
tolerance, at every number of tokens, and a row's product does not depend on
the other rows of its pass.

Where it cannot (no compiler, `DECODESPEC_NATIVE=0`), PyTorch's CPU
weight-only kernels:

- int4 in groups of 32, 64, 128 or 256: `aten._weight_int4pack_mm_for_cpu`,
  which computes `(q − 8) · s + z` per group; the spec's offset `o` maps to
  `z = o + 8s` (QUANT-GROUP-1), scales and zeros held in bfloat16. The kernel
  packs rows sixteen at a time: rows are padded to a multiple of 16 with
  zero codes and the padding's outputs dropped.
- int8 with one scale per row and zero offsets (per-channel symmetric):
  `aten._weight_int8pack_mm`, scales in bfloat16. It reads 16 columns at a
  time and returns garbage (or crashes) otherwise, so `in_features` must be
  a multiple of 16 (checked here, and at load by `weight_formats`).

Both kernels are fast only for bfloat16 inputs (float32 inputs take a slow
path, 25× slower at batch 1): `linear` casts the float32 activations to
bfloat16 and the result back. Their results differ from the definition by bfloat16 rounding of
scales, zeros and inputs, within QUANT-TOL-1's bfloat16 tolerance
(tests/engine/test_weight_formats.py checks it).
"""

from __future__ import annotations

import itertools
from dataclasses import fields, replace

import numpy as np
import torch
from torch import Tensor

from decodespec.spec.forward import LayerWeights, ModelWeights, Weight
from decodespec.spec.quant import QuantizedWeight

from . import native_library
from .weight_formats import PROJECTIONS, map_quantized

INT4_GROUP_SIZES = (32, 64, 128, 256)
KERNEL_DTYPE = torch.bfloat16
ROW_PACK = 16  # the int4 kernel's rows per packed tile
INT8_COLUMNS = 16  # the int8 kernel's columns per step
ACTIVATION_BLOCK = 32  # QUANT-A8-1's activations per scale
# byte -> its two 4-bit codes as two int32, low nibble first (QUANT-CODES-1's order),
# held as one int64 so that a lookup copies one machine word
_NIBBLE_PAIRS = np.array([[b & 0x0F, b >> 4] for b in range(256)], dtype=np.int32).view(np.int64)


def int4_codes(qweight: Tensor) -> Tensor:
    """`spec.quant.unpack_codes(qweight, 4)`: the int32 codes `[N, K]` the int4 packing
    op takes, by one table lookup per byte (torch's stack and casts took seconds on
    the bundled model's projections)."""
    pairs = np.take(_NIBBLE_PAIRS[:, 0], qweight.numpy())  # int64 [N, K / 2]
    return torch.from_numpy(pairs.view(np.int32)).reshape(qweight.shape[0], -1)


def _numpy(tensor: Tensor) -> np.ndarray:
    """A CPU tensor's values as numpy. Packing works in numpy but for PyTorch's own
    conversions: each torch operation on a large tensor is a parallel region, and on a
    2-core machine other processes also use, each region waited milliseconds for a
    descheduled worker thread (see `gguf_fast`): packing the bundled model took
    seconds of waiting for a fraction of a second of work."""
    return tensor.detach().numpy()


def _as_float16(array: np.ndarray) -> np.ndarray | None:
    """float32 `array` in float16 when every value is a float16 one (so converts back
    exactly), else None."""
    halves = array.astype(np.float16)
    return halves if np.array_equal(halves.astype(np.float32), array) else None


def to_bfloat16(array: np.ndarray) -> Tensor:
    """float32 `array` as a contiguous bfloat16 tensor, as `Tensor.to(torch.bfloat16)`
    rounds it (to nearest, ties to even: `(u + 0x7FFF + ((u >> 16) & 1)) >> 16` on the
    bits `u`), computed in numpy. An array holding a NaN goes to torch itself, whose
    NaN bits depend on the path it takes (0x7FC0 in its scalar code, 0xFFFF in its
    AVX2 code)."""
    array = np.ascontiguousarray(array, dtype=np.float32)
    if np.isnan(array).any():
        return torch.from_numpy(array).to(KERNEL_DTYPE)
    bits = array.view(np.uint32)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
    return torch.from_numpy(rounded.astype(np.uint16).view(np.int16)).view(KERNEL_DTYPE)


def _padded(array: np.ndarray, rows: int) -> np.ndarray:
    """`array` with zero rows appended up to `rows`."""
    if array.shape[0] == rows:
        return array
    padding = np.zeros((rows - array.shape[0], *array.shape[1:]), array.dtype)
    return np.concatenate([array, padding])


def _concatenate(tensors: list[Tensor]) -> Tensor:
    """`torch.cat(tensors)`, by numpy for the dtypes it has (bfloat16 it has not)."""
    if any(t.dtype == torch.bfloat16 or t.device.type != "cpu" for t in tensors):
        return torch.cat(tensors)
    return torch.from_numpy(np.concatenate([_numpy(t) for t in tensors]))


def check_layout(weight: QuantizedWeight) -> None:
    """ValueError unless a CPU kernel takes `weight`'s layout."""
    columns = weight.shape[1]
    if weight.bits == 4 and weight.group_size not in INT4_GROUP_SIZES:
        raise ValueError(
            f"the CPU int4 kernel takes groups of {INT4_GROUP_SIZES}, got {weight.group_size}"
        )
    if weight.bits == 8 and (weight.group_size != columns or bool(weight.offsets.any())):
        raise ValueError(
            "the CPU int8 kernel takes 8-bit weights with one scale per row and zero offsets"
        )
    if weight.bits == 8 and columns % INT8_COLUMNS:
        raise ValueError(
            f"the CPU int8 kernel needs in_features a multiple of {INT8_COLUMNS}, got {columns}"
        )


class CpuInt4Linear:
    """An int4 group-quantized projection packed for `_weight_int4pack_mm_for_cpu`."""

    bits = 4

    def __init__(self, weight: QuantizedWeight) -> None:
        check_layout(weight)
        rows, columns = weight.shape
        padded = -(-rows // ROW_PACK) * ROW_PACK
        # numpy beside the one conversion op: see `_numpy`
        scales = _numpy(weight.scales.float())
        zeros = _numpy(weight.offsets.float()) + np.float32(8) * scales
        codes = _padded(int4_codes(weight.qweight).numpy(), padded)
        self.shape = (rows, columns)
        self.group_size = weight.group_size
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(codes), 1)
        # [K / G, N, 2]: the kernel's layout of (scale, zero) per group and row
        pairs = np.empty((scales.shape[1], padded, 2), np.float32)
        pairs[..., 0] = _padded(scales, padded).T
        pairs[..., 1] = _padded(zeros, padded).T
        self.scale_and_zero = to_bfloat16(pairs)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scale_and_zero.nbytes

    def linear(self, x: Tensor) -> Tensor:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(KERNEL_DTYPE).contiguous(), self.packed, self.group_size, self.scale_and_zero
        )
        return out[:, : self.shape[0]].to(x.dtype)

    def dequantize(self) -> Tensor:
        """The weights the kernel multiplies by, float32 (its product with the identity)."""
        return self.linear(torch.eye(self.shape[1], dtype=KERNEL_DTYPE)).float().T

    def to(self, device: torch.device | str) -> CpuInt4Linear:
        if torch.device(device).type != "cpu":
            raise ValueError("weights packed for the CPU kernels stay on the CPU")
        return self


class CpuInt8Linear:
    """An int8 per-channel projection for `_weight_int8pack_mm`."""

    bits = 8

    def __init__(self, weight: QuantizedWeight) -> None:
        check_layout(weight)
        rows, columns = weight.shape
        self.shape = (rows, columns)
        self.group_size = columns
        self.qweight = weight.qweight.contiguous()
        self.scales = to_bfloat16(_numpy(weight.scales[:, 0].float()).copy())

    @property
    def nbytes(self) -> int:
        return self.qweight.nbytes + self.scales.nbytes

    def linear(self, x: Tensor) -> Tensor:
        out = torch.ops.aten._weight_int8pack_mm(
            x.to(KERNEL_DTYPE).contiguous(), self.qweight, self.scales
        )
        return out.to(x.dtype)

    def dequantize(self) -> Tensor:
        return self.qweight.float() * self.scales.float()[:, None]

    def to(self, device: torch.device | str) -> CpuInt8Linear:
        if torch.device(device).type != "cpu":
            raise ValueError("weights packed for the CPU kernels stay on the CPU")
        return self


def takes_activation_quantized(weight: QuantizedWeight) -> bool:
    """Whether QUANT-A8-1 applies: `in_features` and the groups multiples of 32."""
    return weight.shape[1] % ACTIVATION_BLOCK == 0 and weight.group_size % ACTIVATION_BLOCK == 0


class ActivationQuantizedLinear:
    """A group-quantized projection multiplied by QUANT-A8-1 in C (`native_quantized.c`).

    `linear(x)`: `x` `[M, K]` float32 or bfloat16 (other floating dtypes through
    float32), the result `[M, N]` in `x`'s dtype: `spec.quant.activation_quantized_linear`
    within float32's tolerance, each row in the bits it has alone. A 4-bit weight is
    held in the C product's tiles (`pack_int4_tiles`: its codes, scales and offsets,
    eight rows interleaved block by block), an 8-bit one in the spec's layout. Scales
    and offsets that are all float16 values (GGUF's Q4_0, Q4_1 and Q8_0 fields) are
    held in float16 (`half`), which converts back exactly: the same results from
    fewer bytes, which a decode step reads once per token. An 8-bit weight whose
    offsets are all zero holds none.

    Example:
        >>> from decodespec.spec.quant import quantize_weight
        >>> w = quantize_weight(torch.randn(8, 64), bits=4, group_size=32)
        >>> ActivationQuantizedLinear(w, native_library.library()).linear(torch.randn(2, 64)).shape
        torch.Size([2, 8])
    """

    def __init__(self, weight: QuantizedWeight, lib: object) -> None:
        if not takes_activation_quantized(weight):
            raise ValueError(
                f"QUANT-A8-1 needs in_features and group_size multiples of {ACTIVATION_BLOCK}, "
                f"got {weight.shape[1]} and {weight.group_size}"
            )
        self.lib = lib
        self.shape = weight.shape
        self.bits, self.group_size = weight.bits, weight.group_size
        codes = weight.qweight.contiguous()
        scales, offsets = _numpy(weight.scales.float()), _numpy(weight.offsets.float())
        scales16, offsets16 = _as_float16(scales), _as_float16(offsets)
        self.half = half = scales16 is not None and offsets16 is not None
        if half:
            scales, offsets = scales16, offsets16
        scales = torch.from_numpy(np.ascontiguousarray(scales))
        offsets = torch.from_numpy(np.ascontiguousarray(offsets))
        if weight.bits == 4:
            tiles = torch.empty(lib.int4_tiles_bytes(*self.shape, half), dtype=torch.uint8)
            lib.pack_int4_tiles(codes.data_ptr(), scales.data_ptr(), offsets.data_ptr(),
                                *self.shape, weight.group_size, half, tiles.data_ptr())  # fmt: skip
            self.held = [tiles]
            addresses = (tiles.data_ptr(), 0, 0)  # the scales and offsets are in the tiles
        else:
            held_offsets = [offsets] if offsets.any() else []  # none: all zero
            self.held = [codes, scales, *held_offsets]
            addresses = (codes.data_ptr(), scales.data_ptr(),
                         offsets.data_ptr() if held_offsets else 0)  # fmt: skip
        # the weight's arguments of every call (native_step's too)
        self.arguments = (*addresses, self.bits, *self.shape, self.group_size, half)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.held)

    def linear(self, x: Tensor) -> Tensor:
        if x.dtype not in (torch.float32, KERNEL_DTYPE):
            return self.linear(x.float()).to(x.dtype)
        x = x.contiguous()
        y = torch.empty(x.shape[0], self.shape[0], dtype=x.dtype)
        bf16, threads = x.dtype == KERNEL_DTYPE, torch.get_num_threads()
        failed = self.lib.quantized_product(
            *self.arguments, x.data_ptr(), bf16, x.shape[0], y.data_ptr(), bf16, threads
        )
        if failed:
            raise MemoryError("no memory for the activations' int8 codes")
        return y

    def dequantize(self) -> Tensor:
        if self.bits == 8:
            codes, scales = self.held[:2]
            offsets = self.held[2] if len(self.held) == 3 else torch.zeros_like(scales)
            weight = QuantizedWeight(codes, scales.float(), offsets.float(), self.group_size, 8)
            return weight.dequantize()
        dense = torch.empty(self.shape)
        self.lib.dequantize_int4_tiles(self.held[0].data_ptr(), *self.shape, self.half,
                                       dense.data_ptr())  # fmt: skip
        return dense

    def to(self, device: torch.device | str) -> ActivationQuantizedLinear:
        if torch.device(device).type != "cpu":
            raise ValueError("weights packed for the CPU kernels stay on the CPU")
        return self


class DenseLinear:
    """A float32 projection multiplied in C (`native_dense.c`), each row of the result in
    one order fixed by `in_features` alone: the same bits alone or among any rows, on
    any thread count, with the AVX2 loops or the scalar ones (which a BLAS does not
    promise: issue 40). In the engine it made float32 decode 1.7x and prefill 1.3x
    faster than PyTorch's path (`make bench-invariance`, with the native step).

    `linear(x)`: `x` `[M, K]` float32 (other floating dtypes through float32), the
    result `[M, N]` in `x`'s dtype. The weight tensor is held, not copied (a tied
    output projection stays the embedding).

    Example:
        >>> w = DenseLinear(torch.randn(8, 64), native_library.library())
        >>> x = torch.randn(3, 64)
        >>> torch.equal(w.linear(x)[1:2], w.linear(x[1:2]))
        True
    """

    bits = 32

    def __init__(self, weight: Tensor, lib: object) -> None:
        if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2:
            raise ValueError(f"DenseLinear takes a 2-D float32 CPU tensor, got {weight.dtype}")
        self.lib = lib
        self.unwrapped = weight.contiguous()  # `weight_formats` counts and names this one
        self.shape = tuple(weight.shape)
        self.group_size = self.shape[1]
        # the weight's arguments as native_step's table takes them (a product's fields)
        self.arguments = (self.unwrapped.data_ptr(), 0, 0, self.bits, *self.shape, self.shape[1], 0)

    @property
    def nbytes(self) -> int:
        return self.unwrapped.nbytes

    def linear(self, x: Tensor) -> Tensor:
        if x.dtype != torch.float32:
            return self.linear(x.float()).to(x.dtype)
        x = x.contiguous()
        y = torch.empty(x.shape[0], self.shape[0])
        self.lib.dense_product(self.unwrapped.data_ptr(), *self.shape, x.data_ptr(), x.shape[0],
                               y.data_ptr(), torch.get_num_threads())  # fmt: skip
        return y

    def dequantize(self) -> Tensor:
        return self.unwrapped

    def to(self, device: torch.device | str) -> DenseLinear:
        if torch.device(device).type != "cpu":
            raise ValueError("weights packed for the CPU kernels stay on the CPU")
        return self


class SharedInput:
    """Sibling projections of one input (a layer's Q, K and V; its gate and up) packed as
    one matrix, so that one kernel call computes all of them.

    The decoder multiplies the same tensor by each sibling in turn
    (`decoder_layer`): the first call computes the stacked product and keeps it
    with the input it was computed for; a sibling called with that very tensor
    object reads its columns, any other input is computed afresh. The input is
    held, so a match is never a recycled id.
    """

    def __init__(self, weights: list[Weight]) -> None:
        first = weights[0]
        if isinstance(first, Tensor):
            self.kernel = pack(torch.cat(weights))
        else:
            stacked = QuantizedWeight(
                _concatenate([w.qweight for w in weights]),
                _concatenate([w.scales for w in weights]),
                _concatenate([w.offsets for w in weights]),
                first.group_size,
                first.bits,
            )
            self.kernel = pack(stacked)
        self.input: Tensor | None = None
        self.output: Tensor | None = None
        bounds = [0]
        for w in weights:
            bounds.append(bounds[-1] + w.shape[0])
        self.members = [SharedInputMember(self, a, b) for a, b in itertools.pairwise(bounds)]

    def product(self, x: Tensor) -> Tensor:
        if x is not self.input:
            self.output = self.kernel.linear(x)
            self.input = x
        return self.output


class SharedInputMember:
    """One projection of a `SharedInput`: its rows `start:stop` of the stacked matrix."""

    def __init__(self, shared: SharedInput, start: int, stop: int) -> None:
        self.shared, self.start, self.stop = shared, start, stop
        kernel = shared.kernel
        self.shape = (stop - start, kernel.shape[1])
        self.bits, self.group_size = kernel.bits, kernel.group_size
        self.nbytes = kernel.nbytes * (stop - start) // kernel.shape[0]

    def linear(self, x: Tensor) -> Tensor:
        return self.shared.product(x)[:, self.start : self.stop]

    def dequantize(self) -> Tensor:
        return self.shared.kernel.dequantize()[self.start : self.stop]

    def to(self, device: torch.device | str) -> SharedInputMember:
        self.shared.kernel.to(device)  # the CPU kernels' check
        return self


SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


CpuKernel = ActivationQuantizedLinear | CpuInt4Linear | CpuInt8Linear | DenseLinear


def pack(weight: Weight) -> Weight:
    """`weight` on the C products where they apply and the library can be had: a float32
    tensor on `DenseLinear`, a quantized weight on QUANT-A8-1's; else a quantized weight
    on PyTorch's kernel for its bits (ValueError if that cannot take it) and any other
    tensor as it is (PyTorch's GEMM)."""
    lib = _library()
    if isinstance(weight, Tensor):
        takes = lib is not None and weight.dtype == torch.float32 and weight.device.type == "cpu"
        return DenseLinear(weight, lib) if takes else weight
    if lib is not None and takes_activation_quantized(weight):
        return ActivationQuantizedLinear(weight, lib)
    return CpuInt4Linear(weight) if weight.bits == 4 else CpuInt8Linear(weight)


def _library() -> object | None:
    """The C library, or None: `DECODESPEC_NATIVE=0`, or it cannot be built or loaded
    (`native_library` says why on stderr, once)."""
    if native_library.disabled():
        return None
    try:
        return native_library.library()
    except native_library.NativeUnavailable:
        return None


def products(weights: ModelWeights) -> str:
    """How the model's projections multiply, in a few words (the engine's path line):
    "int8 activations (QUANT-A8-1, C avx2)", "float32 (C, ...)" or PyTorch's kernels'."""
    kinds = set()
    for layer in weights.layers:
        for f in fields(layer):
            value = getattr(layer, f.name)
            kernel = value.shared.kernel if isinstance(value, SharedInputMember) else value
            if isinstance(kernel, ActivationQuantizedLinear):
                isa = kernel.lib.quantized_isa().decode()
                kinds.add(f"int8 activations (QUANT-A8-1, C {isa})")
            elif isinstance(kernel, (CpuInt4Linear, CpuInt8Linear)):
                kinds.add("bfloat16 activations (PyTorch's int4/int8 kernels)")
            elif isinstance(kernel, DenseLinear):
                kinds.add(f"float32 (C, one order a row, {kernel.lib.dense_isa().decode()})")
    return "; ".join(sorted(kinds))


def _shares_a_kernel(group: list[Weight]) -> bool:
    """Whether siblings `group` stack into one matrix: all quantized in one layout, or
    all float32 tensors."""
    if all(isinstance(w, Tensor) for w in group):
        return _library() is not None and all(w.dtype == torch.float32 for w in group)
    layouts = {(w.bits, w.group_size) for w in group if isinstance(w, QuantizedWeight)}
    return all(isinstance(w, QuantizedWeight) for w in group) and len(layouts) == 1


def pack_for_cpu(model: ModelWeights) -> ModelWeights:
    """`model` with every projection on a CPU kernel (`pack`: float32 ones on
    `DenseLinear`, quantized ones on QUANT-A8-1's product or PyTorch's kernels; the
    embedding, norms and biases shared); siblings of one input share a kernel call
    (`SharedInput`).

    Raises:
        ValueError: a quantized projection no CPU kernel takes (int4 groups
            other than 32/64/128/256, int8 with groups or offsets, int8 with
            `in_features` not a multiple of 16), naming the projection.
    """
    map_quantized(model, check_layout)  # every projection's own error, naming it
    layers = []
    for layer in model.layers:
        values = {f.name: getattr(layer, f.name) for f in fields(layer)}
        for names in SIBLINGS:
            group = [values[name] for name in names]
            if _shares_a_kernel(group):
                values.update(zip(names, SharedInput(group).members, strict=True))
        for name in PROJECTIONS:
            values[name] = _packed(values[name])
        layers.append(LayerWeights(**values))
    return replace(model, layers=layers, output=_packed(model.output))


def _packed(weight: Weight) -> Weight:
    """`pack(weight)`, or `weight` itself when it is packed already."""
    return pack(weight) if isinstance(weight, (Tensor, QuantizedWeight)) else weight
