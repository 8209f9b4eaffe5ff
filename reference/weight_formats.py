"""Weight formats: what `--weights` loads a model as, and how much memory it holds.

The loader assembles every checkpoint as dense float32 weights (a GGUF file's
blocks dequantized, except those `int4` keeps: `keeps_blocks`);
`convert_weights` turns them into the requested format:

- `float32`: as assembled; the reference every other format is measured
  against (`decodespec perplexity`).
- `bfloat16`: every tensor bfloat16; activations bfloat16.
- `int8`: every projection (the seven of each layer and the output
  projection) int8 with one scale per output channel (QUANT-ROUND-1 with
  `group_size = in_features`: the layout PyTorch's CPU int8 kernel runs);
  activations float32. A GGUF tensor in 4-bit blocks is not kept (groups of
  32 are not one scale a row): its dequantized weights are quantized at load
  like any other's, and the load summary says from which type.
- `int4`: the seven projections of each layer int4 in groups of 32. A GGUF
  tensor stored in 4-bit blocks (Q4_0, Q4_1, Q4_K) keeps its own codes,
  scales and offsets exactly (GGUF-GROUPS-1); any other tensor is quantized
  at load (QUANT-ROUND-1), and the load summary says which. The output
  projection is int8 per channel, as llama.cpp's 4-bit files keep it at 6
  or 8 bits (the bundled Q4_1 file's is Q8_0): measured on the bundled model
  (3,072 tokens of the perplexity text), an int4 output projection made the
  mean KL divergence to float32 0.053 and top-1 agreement 86%, an int8 one
  0.003 and 97%. Activations float32.

The embedding stays a dense table in the activation dtype (a lookup reads one
row per token). In the quantized formats a tied output projection becomes a
quantized copy of the embedding. Their activations (the residual stream,
norms, attention, the KV cache) stay float32, as llama.cpp keeps them beside
quantized weights; only the CPU kernels' inputs are rounded to bfloat16
(`cpu_linear`), because PyTorch's CPU weight-only kernels are fast only for
bfloat16 inputs (measured at batch 1 on the bundled model's 211 projections,
2 threads: int4 5.4 ms per token with bfloat16 inputs, 130 ms with float32).

`auto` is not a format but a choice of one: the file's own (`native_format`,
`loader.resolve_format`). A GGUF file whose layers' projections are mostly
in 4-bit blocks (Q4_0, Q4_1, Q4_K) loads as `int4`, the blocks kept bit for
bit; Q8_0 blocks as `int8` (per channel: requantized, as `int8` always
does); F32, F16 and BF16 weights as `float32`, which holds all three
exactly (not `bfloat16` for a BF16 file: its activations would be rounded
too, which the file does not imply, and float32 is the CPU's fast path);
any other quantized type as the nearest format, by its codes' bits: up to
5 bits (Q2_K ... Q5_K, IQ*) `int4`, 6 to 8 bits (Q6_K, Q8_1, Q8_K) `int8`,
requantized at load. A Hugging Face directory loads as `float32`. The load
summary says which format `auto` chose and why, e.g. `int4 (auto: the
file's Q4_1 blocks): 210 kept from Q4_1 blocks, ...`, and carries the
format (`LoadSummary.weights`).

Which kernel multiplies a quantized projection is the backend's choice
(`backend.Backend.prepare_weights`): the spec backend computes the definition,
`QuantizedWeight.linear`; the torch backend packs the weights for PyTorch's
CPU kernels (`cpu_linear`).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from decodespec.spec.forward import LayerWeights, ModelWeights, Weight
from decodespec.spec.quant import QuantizedWeight, quantize_weight

from .gguf_fast import groups_fast
from .hf_checkpoint import EMBEDDING, OUTPUT, layer_tensor_name

WEIGHT_FORMATS = ("float32", "bfloat16", "int8", "int4")  # the formats themselves
AUTO = "auto"  # the file's own format (`native_format`)
WEIGHT_CHOICES = (AUTO, *WEIGHT_FORMATS)  # what `--weights` and the loader accept
GROUP_SIZE = 32  # int4's group, GGUF's block size
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FOUR_BIT_GGUF_TYPES = ("Q4_0", "Q4_1", "Q4_K")
FLOAT_GGUF_TYPES = ("F32", "F16", "BF16", "F64")
# the codes' bits in a GGUF type's name: Q5_K, IQ4_NL, TQ2_0, MXFP4
_CODE_BITS = re.compile(r"(?:I|T|MX|NV)?(?:Q|FP)(\d)")
ACTIVATION_DTYPE = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "int8": torch.float32,
    "int4": torch.float32,
}


class LoadSummary(str):
    """A progress message that stays: what a weight format kept and what it quantized.
    Progress callbacks take it as any message; one that redraws a status line keeps
    this one (`cli_options.load_model_with_progress`): nothing is requantized unsaid.
    `weights` is the format loaded (what `auto` chose), None where not given."""

    weights: str | None

    def __new__(cls, text: str, weights: str | None = None) -> LoadSummary:
        summary = super().__new__(cls, text)
        summary.weights = weights
        return summary


class NativeFormat(NamedTuple):
    """The format `auto` chooses for a file, and why (a phrase for the load summary)."""

    weights: str
    reason: str


@dataclass(frozen=True)
class GGUFBlocks:
    """A GGUF tensor's raw blocks: `data` uint8 `[rows, row_bytes]`, its type, its columns."""

    data: Tensor
    type_name: str
    columns: int


def check_format(weights: str) -> str:
    """`weights` if it names a format, else ValueError listing them."""
    if weights not in WEIGHT_FORMATS:
        raise ValueError(
            f"unknown weight format {weights!r}: choose one of {', '.join(WEIGHT_FORMATS)}"
        )
    return weights


def check_choice(weights: str) -> str:
    """`weights` if it names a format or `auto`, else ValueError listing them."""
    if weights not in WEIGHT_CHOICES:
        raise ValueError(
            f"unknown weight format {weights!r}: choose one of {', '.join(WEIGHT_CHOICES)}"
        )
    return weights


def native_format(elements_by_type: Mapping[str, int]) -> NativeFormat:
    """The format `auto` loads a GGUF file as (see the module docstring), from the GGUF
    types of its layers' projections and how many weights each type holds: the type
    holding most of them decides. No projections at all: float32.

    Example:
        >>> native_format({"Q4_1": 9_000, "Q6_K": 1_000}).reason
        "the file's Q4_1 blocks (90% of its projections' weights)"
    """
    if not elements_by_type:
        return NativeFormat("float32", "no quantized projections in the file")
    total = sum(elements_by_type.values())
    kind, count = max(elements_by_type.items(), key=lambda item: item[1])
    share = f" ({count / total:.0%} of its projections' weights)" if count < total else ""
    if kind in FOUR_BIT_GGUF_TYPES:
        return NativeFormat("int4", f"the file's {kind} blocks{share}")
    if kind == "Q8_0":
        return NativeFormat("int8", f"the file's {kind} blocks{share}")
    if kind in FLOAT_GGUF_TYPES:
        return NativeFormat("float32", f"the file's {kind} weights{share}")
    match = _CODE_BITS.match(kind)
    bits = int(match.group(1)) if match else 8
    weights = "int4" if bits <= 5 else "int8"
    to = "int8 per channel" if weights == "int8" else "int4"
    return NativeFormat(
        weights, f"the file's {kind} blocks{share}, {bits}-bit: requantized to {to}, the nearest"
    )


def keeps_blocks(weights: str, name: str, type_name: str) -> bool:
    """Whether format `weights` holds tensor `name` (a Hugging Face name) of GGUF type
    `type_name` as the file's own blocks, never reading its dequantized values: int4's
    layer projections in 4-bit blocks."""
    if weights != "int4" or type_name not in FOUR_BIT_GGUF_TYPES:
        return False
    parts = name.split(".")
    return len(parts) > 3 and parts[:2] == ["model", "layers"] and parts[-2] in PROJECTIONS


def int8_per_channel(weight: Tensor) -> QuantizedWeight:
    """`quantize_weight(weight, bits=8, group_size=in_features)` bit for bit (QUANT-ROUND-1,
    one scale a row), in fewer passes over the weights and in numpy (no torch
    parallel region per projection: see `gguf_fast`): finiteness is checked on the
    row maxima (a NaN or an infinity makes its row's maximum non-finite), and
    `w − 0` and the zero-scale `where` are left out (identities for finite weights: a
    row whose scale is 0 is all zeros, and 0 / 1 rounds to 0); division and rounding
    to nearest even are IEEE's in both libraries. Whatever the definition refuses
    (non-finite weights, a shape it does not take) goes to `quantize_weight` for its
    error, as does any weight but a plain float32 CPU matrix.
    """
    plain = weight.dtype == torch.float32 and weight.device.type == "cpu"
    if not plain or weight.dim() != 2 or 0 in weight.shape or weight.requires_grad:
        columns = weight.shape[-1] if weight.dim() else 1
        return quantize_weight(weight, bits=8, group_size=columns)
    values = weight.numpy()
    largest = np.abs(values).max(axis=1, keepdims=True)
    if not np.isfinite(largest).all():
        return quantize_weight(weight, bits=8, group_size=weight.shape[1])
    scales = largest / np.float32(127)
    codes = values / np.where(scales == 0, np.float32(1), scales)
    np.rint(codes, out=codes)
    np.clip(codes, -127, 127, out=codes)
    return QuantizedWeight(
        torch.from_numpy(codes.astype(np.int8)),
        torch.from_numpy(scales),
        torch.zeros(scales.shape),
        weight.shape[1],
        8,
    )


def convert_weights(
    model: ModelWeights,
    weights: str,
    *,
    gguf_blocks: Mapping[str, GGUFBlocks] | None = None,
    gguf_types: Mapping[str, str] | None = None,
    spelling: Mapping[str, str] | None = None,
    source: object = "the model",
    report: Callable[[str], None] = lambda _message: None,
    reason: str | None = None,
) -> ModelWeights:
    """`model` (dense float32) in format `weights` (see the module docstring).

    Args:
        model: the assembled float32 weights; not modified.
        weights: one of `WEIGHT_FORMATS`.
        gguf_blocks: raw blocks of GGUF tensors by Hugging Face name; int4
            keeps those in 4-bit blocks exactly.
        gguf_types: each GGUF tensor's type by Hugging Face name, for the summary.
        spelling: the file's own name of each Hugging Face name, for messages.
        source: the checkpoint, for messages.
        report: called once with a `LoadSummary` of what was kept and what quantized
            (for float32 and bfloat16 only where `reason` is given).
        reason: why `auto` chose `weights` (`native_format`), for the summary:
            `int4 (auto: the file's Q4_1 blocks): 210 kept from Q4_1 blocks, ...`.

    Raises:
        ValueError: an unknown format, or a projection whose shape the format
            cannot hold (`in_features` not a multiple of the group size),
            naming the tensor and the format.
    """
    check_format(weights)
    dtype = ACTIVATION_DTYPE[weights]
    label = weights if reason is None else f"{weights} (auto: {reason})"
    if weights in ("float32", "bfloat16"):
        if reason is not None:
            report(LoadSummary(f"{label}: every tensor {weights}", weights))
        return _dense(model, dtype)
    blocks = gguf_blocks or {}
    names = spelling or {}
    origin: dict[str, int] = {}
    bits = 8 if weights == "int8" else 4

    def quantize(name: str, weight: Tensor, bits: int) -> QuantizedWeight:
        spelled = names.get(name, name)
        rows, columns = weight.shape
        # int8: PyTorch's CPU kernel reads 16 columns at a time; int4: whole groups.
        multiple = 16 if bits == 8 else GROUP_SIZE
        if columns % multiple:
            raise ValueError(
                f"{source}: tensor {spelled} [{rows}, {columns}] cannot be {weights}: "
                f"in_features {columns} is not a multiple of {multiple}"
            )
        raw = blocks.get(name)
        if bits == 4 and raw is not None and raw.type_name in FOUR_BIT_GGUF_TYPES:
            key = f"kept from {raw.type_name} blocks"
            origin[key] = origin.get(key, 0) + 1
            return groups_fast(raw.data, raw.type_name, raw.columns)
        kind = (gguf_types or {}).get(name) or str(weight.dtype).removeprefix("torch.")
        key = f"quantized at load from {kind}" + (" to int8 per channel" if bits == 8 else "")
        origin[key] = origin.get(key, 0) + 1
        if bits == 8:
            return int8_per_channel(weight)
        return quantize_weight(weight, bits=4, group_size=GROUP_SIZE)

    layers = []
    for index, layer in enumerate(model.layers):
        values = {}
        for field in fields(layer):
            value = getattr(layer, field.name)
            if field.name in PROJECTIONS:
                values[field.name] = quantize(layer_tensor_name(index, field.name), value, bits)
            else:
                values[field.name] = None if value is None else value.to(dtype)
        layers.append(LayerWeights(**values))
    tied = model.output is model.embedding
    output = quantize(EMBEDDING if tied else OUTPUT, model.output, 8)
    summary = ", ".join(f"{count} {how}" for how, count in origin.items())
    tied_note = " (the output projection tied to the embedding)" if tied else ""
    report(LoadSummary(f"{label}: {summary}{tied_note}", weights))
    return ModelWeights(
        model.config, model.embedding.to(dtype), layers, model.final_norm.to(dtype), output
    )


def _dense(model: ModelWeights, dtype: torch.dtype) -> ModelWeights:
    if model.dtype == dtype:
        return model
    layers = [
        LayerWeights(
            **{
                f.name: None if getattr(layer, f.name) is None else getattr(layer, f.name).to(dtype)
                for f in fields(layer)
            }
        )
        for layer in model.layers
    ]
    embedding = model.embedding.to(dtype)
    output = embedding if model.output is model.embedding else model.output.to(dtype)
    return ModelWeights(model.config, embedding, layers, model.final_norm.to(dtype), output)


def map_quantized(
    model: ModelWeights, convert: Callable[[QuantizedWeight], Weight]
) -> ModelWeights:
    """`model` with every `QuantizedWeight` projection replaced by `convert(weight)` (a
    new object; everything else shared). An error of `convert` names the projection."""

    def converted(where: str, weight: Weight | None) -> Weight | None:
        if not isinstance(weight, QuantizedWeight):
            return weight
        try:
            return convert(weight)
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from error

    layers = [
        LayerWeights(
            **{
                f.name: converted(f"layer {i} {f.name}", getattr(layer, f.name))
                for f in fields(layer)
            }
        )
        for i, layer in enumerate(model.layers)
    ]
    output = converted("the output projection", model.output)
    return ModelWeights(model.config, model.embedding, layers, model.final_norm, output)


def weight_bytes(model: ModelWeights) -> int:
    """Bytes the model's weights hold (a tensor shared by two fields counted once)."""
    seen: set[int] = set()
    total = 0

    def count(value: Weight | None) -> None:
        nonlocal total
        value = getattr(value, "unwrapped", value)  # a batch_invariance.RowBlockLinear's
        if value is None or id(value) in seen:
            return
        seen.add(id(value))
        total += value.nbytes  # a tensor's, or a quantized projection's codes and scales

    for layer in model.layers:
        for field in fields(layer):
            count(getattr(layer, field.name))
    for value in (model.embedding, model.final_norm, model.output):
        count(value)
    return total


def describe(model: ModelWeights) -> str:
    """One line: the projections' formats, the activations and the memory, e.g.
    `projections int4 g32 ×210, int8 ×1; activations float32; weights 208.2 MB`."""
    projections = [getattr(layer, name) for layer in model.layers for name in PROJECTIONS]
    kinds = Counter(_kind(weight) for weight in [*projections, model.output])
    parts = ", ".join(f"{kind} ×{count}" for kind, count in kinds.items())
    return (
        f"projections {parts}; activations {str(model.dtype).removeprefix('torch.')}; "
        f"weights {weight_bytes(model) / 1e6:.1f} MB"
    )


def _kind(weight: Weight) -> str:
    weight = getattr(weight, "unwrapped", weight)  # a batch_invariance.RowBlockLinear's
    if isinstance(weight, Tensor):
        return str(weight.dtype).removeprefix("torch.")
    if weight.bits == 32:  # a float32 tensor on the C product (`cpu_linear.DenseLinear`)
        return "float32"
    group = "" if weight.group_size == weight.shape[1] else f" g{weight.group_size}"
    return f"int{weight.bits}{group}"
