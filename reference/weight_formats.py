"""Weight formats: what `--weights` loads a model as, and how much memory it holds.

The loader assembles every checkpoint as dense float32 weights (a GGUF file's
blocks dequantized); `convert_weights` turns them into the requested format:

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

Which kernel multiplies a quantized projection is the backend's choice
(`backend.Backend.prepare_weights`): the spec backend computes the definition,
`QuantizedWeight.linear`; the torch backend packs the weights for PyTorch's
CPU kernels (`cpu_linear`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from decodespec.spec.forward import LayerWeights, ModelWeights, Weight
from decodespec.spec.gguf_blocks import gguf_groups
from decodespec.spec.quant import QuantizedWeight, quantize_weight

from .hf_checkpoint import EMBEDDING, OUTPUT, layer_tensor_name

WEIGHT_FORMATS = ("float32", "bfloat16", "int8", "int4")
GROUP_SIZE = 32  # int4's group, GGUF's block size
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FOUR_BIT_GGUF_TYPES = ("Q4_0", "Q4_1", "Q4_K")
ACTIVATION_DTYPE = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "int8": torch.float32,
    "int4": torch.float32,
}


class LoadSummary(str):
    """A progress message that stays: what a weight format kept and what it quantized.
    Progress callbacks take it as any message; one that redraws a status line keeps
    this one (`cli_options.load_model_with_progress`): nothing is requantized unsaid."""


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


def convert_weights(
    model: ModelWeights,
    weights: str,
    *,
    gguf_blocks: Mapping[str, GGUFBlocks] | None = None,
    gguf_types: Mapping[str, str] | None = None,
    spelling: Mapping[str, str] | None = None,
    source: object = "the model",
    report: Callable[[str], None] = lambda _message: None,
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
        report: called once with a `LoadSummary` of what was kept and what quantized.

    Raises:
        ValueError: an unknown format, or a projection whose shape the format
            cannot hold (`in_features` not a multiple of the group size),
            naming the tensor and the format.
    """
    check_format(weights)
    dtype = ACTIVATION_DTYPE[weights]
    if weights in ("float32", "bfloat16"):
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
            return gguf_groups(raw.data, raw.type_name, raw.columns)
        kind = (gguf_types or {}).get(name) or str(weight.dtype).removeprefix("torch.")
        key = f"quantized at load from {kind}" + (" to int8 per channel" if bits == 8 else "")
        origin[key] = origin.get(key, 0) + 1
        if bits == 8:
            return quantize_weight(weight, bits=8, group_size=columns)  # per channel
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
    report(LoadSummary(f"{weights}: {summary}{tied_note}"))
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
    group = "" if weight.group_size == weight.shape[1] else f" g{weight.group_size}"
    return f"int{weight.bits}{group}"
