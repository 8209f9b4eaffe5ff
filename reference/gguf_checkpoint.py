"""GGUF files as Llama-family checkpoints: their config and tensors, as the decoder has them.

`read_gguf_checkpoint` turns an open GGUF file (`gguf_file.GGUFFile`) into
what `loader` assembles: a `ModelConfig` from the `{arch}.*` metadata, and
every tensor dequantized to float32 (or, for a format that keeps a tensor's
own blocks, those blocks), un-permuted where llama.cpp's converter
permuted it (`llama` Q and K, FWD-ROPE-1), and renamed from llama.cpp's names
to Hugging Face's through `gguf.TensorNameMap`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from decodespec.spec.forward import ModelConfig

from .gguf_file import GGUFFile, dequantize_tensors, gguf_tensor_names
from .hf_checkpoint import EMBEDDING, OUTPUT, layer_tensor_name, tensor_names
from .weight_formats import GGUFBlocks

GGUF_ARCHITECTURES = ("llama", "qwen2")
_NUMPY_DTYPES = (torch.float32, torch.float16, torch.float64, torch.uint8)


class GGUFCheckpoint(NamedTuple):
    """A GGUF file's model, read (see `read_gguf_checkpoint`)."""

    config: ModelConfig
    tensors: dict[str, Tensor]  # float32, by Hugging Face name (meta for blocks only)
    spelling: dict[str, str]  # Hugging Face name -> the file's own name, for messages
    blocks: dict[str, GGUFBlocks]  # raw blocks of the tensors of `keep_types`, by HF name
    types: dict[str, str]  # each tensor's GGUF type ("Q4_1", "F32", ...), by HF name


def read_gguf_checkpoint(
    file: GGUFFile,
    *,
    progress: Callable[[str], None],
    keep_types: tuple[str, ...] = (),
    blocks_only: Callable[[str, str], bool] | None = None,
) -> GGUFCheckpoint:
    """The config and the tensors of a GGUF file with `general.architecture` llama or qwen2.

    Args:
        file: the open file.
        progress: called with a message every few tensors.
        keep_types: GGUF tensor types (`"Q4_1"`, ...) whose raw blocks are
            returned too (views of the file, rows un-permuted like the
            dequantized tensors), for formats that keep them.
        blocks_only: called with a Hugging Face name and a type name; a kept
            tensor for which it is true is not dequantized (a format that
            keeps its blocks never reads its values: dequantizing the
            bundled file's Q4_1 projections took most of an int4 load):
            `tensors` holds a meta-device placeholder of its shape instead.

    Raises:
        ValueError: another architecture, llama.cpp's `rope_freqs` tensor, a
            missing or invalid key (see `config_from_gguf`), or a tensor that
            cannot be dequantized.
    """
    architecture = file.string("general.architecture")
    if architecture not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"{file.source}: unsupported architecture {architecture!r} "
            f"(supported: {', '.join(GGUF_ARCHITECTURES)})"
        )
    if "rope_freqs.weight" in file.tensor_names:
        raise ValueError(
            f"{file.source}: tensor rope_freqs.weight (llama.cpp's per-frequency RoPE factors, "
            f"Llama 3.1+ scaling) is not supported; load the Hugging Face checkpoint instead, "
            f"whose config.json carries the llama3 rope scaling"
        )
    config = config_from_gguf(file, architecture)
    spelling = gguf_tensor_names(architecture, config.num_layers, tensor_names(config.num_layers))
    hf_names = {gguf_name: name for name, gguf_name in spelling.items()}
    named = [(hf_names.get(tensor.name, tensor.name), tensor) for tensor in file.tensors]
    kept = [
        (name, tensor)
        for name, tensor in named
        if tensor.type_name in keep_types and len(tensor.dims) == 2
    ]
    placeholders = {
        tensor.name: torch.empty(tensor.shape, device="meta")
        for name, tensor in kept
        if blocks_only is not None and blocks_only(name, tensor.type_name)
    }
    dense = dequantize_tensors(file, progress=progress, skip=placeholders)
    tensors = {name: placeholders.get(t.name, dense.get(t.name)) for name, t in named}
    blocks = {
        name: GGUFBlocks(file.tensor_data(tensor), tensor.type_name, tensor.dims[0])
        for name, tensor in kept
    }
    if architecture == "llama":
        unpermute_llama_qk(tensors, config)
        unpermuted = {name: block.data for name, block in blocks.items()}
        unpermute_llama_qk(unpermuted, config)
        blocks = {name: replace(block, data=unpermuted[name]) for name, block in blocks.items()}
    types = {name: tensor.type_name for name, tensor in named}
    return GGUFCheckpoint(config, tensors, spelling, blocks, types)


def config_from_gguf(file: GGUFFile, architecture: str) -> ModelConfig:
    """Translate GGUF metadata (`{arch}.block_count`, ...) into a `ModelConfig`.

    The head dimension is `{arch}.attention.key_length` if present, else
    embedding_length / head_count; `{arch}.rope.dimension_count` must equal it.
    The vocabulary size is `{arch}.vocab_size`, else the length of
    `tokenizer.ggml.tokens`, else the embedding's row count. Attention biases
    are on when layer 0 has a Q bias tensor (`blk.0.attn_q.bias`); embeddings
    are tied when there is no output projection (`output.weight`).

    Raises:
        ValueError: a missing or invalid key, partial rotary embeddings, or a
            RoPE scaling type the decoder does not have.
    """
    source = file.source
    prefix = architecture + "."
    hidden = file.integer(prefix + "embedding_length")
    heads = file.integer(prefix + "attention.head_count")
    kv_heads = file.integer(prefix + "attention.head_count_kv", heads)
    head_dim = file.integer(prefix + "attention.key_length", hidden // heads if heads else 0)
    value_dim = file.integer(prefix + "attention.value_length", head_dim)
    rope_dim = file.integer(prefix + "rope.dimension_count", head_dim)
    if value_dim != head_dim:
        raise ValueError(f"{source}: key length {head_dim} != value length {value_dim}")
    if rope_dim != head_dim:
        raise ValueError(
            f"{source}: partial rotary embeddings (rope.dimension_count {rope_dim}, "
            f"head_dim {head_dim}) are not supported"
        )
    scaling_type = file.string(prefix + "rope.scaling.type", "none")
    if scaling_type != "none":
        raise ValueError(f"{source}: unsupported rope scaling type {scaling_type!r}")
    names = file.tensor_names
    spelling = gguf_tensor_names(
        architecture, 1, (EMBEDDING, OUTPUT, layer_tensor_name(0, "q_bias"))
    )
    fields = dict(
        vocab_size=_gguf_vocab_size(file, prefix, spelling[EMBEDDING]),
        hidden_size=hidden,
        intermediate_size=file.integer(prefix + "feed_forward_length"),
        num_layers=file.integer(prefix + "block_count"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        max_context=file.integer(prefix + "context_length"),
        rms_norm_eps=file.number(prefix + "attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=file.number(prefix + "rope.freq_base", 10_000.0),
        tie_word_embeddings=spelling[OUTPUT] not in names,
        attention_bias=spelling[layer_tensor_name(0, "q_bias")] in names,
    )
    try:
        return ModelConfig(**fields)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{source}: invalid model configuration: {error}") from error


def _gguf_vocab_size(file: GGUFFile, prefix: str, embedding: str) -> int:
    if file.has(prefix + "vocab_size"):
        return file.integer(prefix + "vocab_size")
    tokens = file.array_length("tokenizer.ggml.tokens")
    if tokens is not None:
        return tokens
    for tensor in file.tensors:
        if tensor.name == embedding:
            return int(tensor.dims[-1])  # GGUF lists dimensions innermost first
    raise ValueError(f"{file.source}: cannot tell the vocabulary size (no {prefix}vocab_size)")


def unpermute_rope_rows(weight: Tensor, num_heads: int) -> Tensor:
    """Undo llama.cpp's interleaving of a Q or K projection's rows (or bias).

    llama.cpp's converter (`convert_hf_to_gguf.py`, `LlamaModel.permute`)
    maps the half-split layout to its interleaved one with
    `w.reshape(heads, 2, d/2, ...).swapaxes(1, 2)`: within each head, row
    `i` of the first half and row `i` of the second half become rows `2i`
    and `2i + 1`. This is the inverse, as in transformers' own GGUF loader
    (`LlamaTensorProcessor._reverse_permute_weights`).

    Args:
        weight: `[heads * d, ...]` rows in llama.cpp's order.
        num_heads: heads of this projection (KV heads for K).

    Returns:
        The same tensor with rows in the half-split order of FWD-ROPE-1.
    """
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise ValueError(f"{rows} rows cannot be split into {num_heads} heads of even size")
    half = rows // num_heads // 2
    rest = weight.shape[1:]
    if weight.device.type == "cpu" and weight.dtype in _NUMPY_DTYPES and not weight.requires_grad:
        # the same copy by numpy: a torch copy is a parallel region per tensor, each
        # waiting milliseconds on a busy 2-core machine (see `gguf_fast`)
        values = weight.numpy().reshape(num_heads, half, 2, *rest).swapaxes(1, 2)
        return torch.from_numpy(np.ascontiguousarray(values).reshape(weight.shape))
    return weight.reshape(num_heads, half, 2, *rest).transpose(1, 2).reshape(weight.shape)


def unpermute_llama_qk(tensors: dict[str, Tensor], config: ModelConfig) -> None:
    """Un-permute the Q and K projections (and biases) of every layer, in place.

    Args:
        tensors: the tensors by Hugging Face name.
        config: the model's config (the head counts).
    """
    heads = {"q": config.num_heads, "k": config.num_kv_heads}
    for index in range(config.num_layers):
        for field in ("q_proj", "q_bias", "k_proj", "k_bias"):
            name = layer_tensor_name(index, field)
            tensor = tensors.get(name)
            count = heads[field[0]]
            if tensor is not None and tensor.shape[0] % (2 * count) == 0:
                tensors[name] = unpermute_rope_rows(tensor, count)  # else _assemble reports it
