"""Hugging Face style checkpoint directories: config.json and safetensors files.

What `loader.load_weights` reads from a directory: the config translated into
a `ModelConfig` (`config_from_hf`: `model_type` `llama`, `mistral` or
`qwen2`), and every tensor of the safetensors files (`model.safetensors`, the
shards `model.safetensors.index.json` lists, or, without an index, every
`*.safetensors` file), by its Hugging Face name (`tensor_names`: the names
the loader assembles the decoder from, whatever the file format). Pickled checkpoints
(`pytorch_model.bin`, `*.pt`, ...) are refused, never unpickled
(`refuse_pickled_only`, `pickle_refusal`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from decodespec.spec.forward import ModelConfig, RopeScaling

HF_ARCHITECTURES = ("llama", "mistral", "qwen2")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
# Buffers some Hugging Face checkpoints carry that the decoder recomputes.
_HF_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


# Where each weight of the decoder lives in a Hugging Face checkpoint: the names
# `loader` assembles under, for GGUF files too (through gguf.TensorNameMap).
EMBEDDING = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
OUTPUT = "lm_head.weight"
_LAYER = {
    "attn_norm": "input_layernorm.weight",
    "q_proj": "self_attn.q_proj.weight",
    "k_proj": "self_attn.k_proj.weight",
    "v_proj": "self_attn.v_proj.weight",
    "o_proj": "self_attn.o_proj.weight",
    "mlp_norm": "post_attention_layernorm.weight",
    "gate_proj": "mlp.gate_proj.weight",
    "up_proj": "mlp.up_proj.weight",
    "down_proj": "mlp.down_proj.weight",
    "q_bias": "self_attn.q_proj.bias",
    "k_bias": "self_attn.k_proj.bias",
    "v_bias": "self_attn.v_proj.bias",
    "o_bias": "self_attn.o_proj.bias",  # not in LayerWeights: refused unless zero
}


def layer_tensor_name(index: int, field: str) -> str:
    """The Hugging Face name of `LayerWeights` field `field` (or `o_bias`) of layer `index`."""
    return f"model.layers.{index}.{_LAYER[field]}"


def tensor_names(num_layers: int) -> list[str]:
    """Every tensor name the decoder has a place for (biases and `o_bias` included)."""
    layers = [layer_tensor_name(i, field) for i in range(num_layers) for field in _LAYER]
    return [EMBEDDING, *layers, FINAL_NORM, OUTPUT]


def pickle_refusal(path: Path) -> str:
    """Why a pickled checkpoint is refused, and how to convert it."""
    return (
        f"{path}: pickled PyTorch checkpoints are refused (unpickling can run arbitrary "
        f"code); convert the checkpoint to safetensors first, e.g. "
        f"`AutoModelForCausalLM.from_pretrained(dir).save_pretrained(out, "
        f"safe_serialization=True)` in a trusted environment"
    )


def read_hf_config(path: Path) -> dict[str, Any]:
    """Parse config.json.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: it is not a JSON object.
    """
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist (a Hugging Face model directory needs it)")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not valid JSON: {error}") from error
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return raw


def config_from_hf(raw: dict[str, Any], source: Path) -> ModelConfig:
    """Translate a Hugging Face config (llama, mistral, qwen2) into a `ModelConfig`.

    `num_key_value_heads` defaults to the number of heads and `head_dim` to
    hidden / heads. Qwen2 always has q/k/v biases; Llama has them when
    `attention_bias` is set. `max_context` is `max_position_embeddings`,
    capped at the sliding window where one applies (see `loader`'s module doc).

    Args:
        raw: the parsed config.json.
        source: its path, for error messages.

    Raises:
        ValueError: unsupported architecture or option, missing or invalid field.
    """
    model_type = raw.get("model_type")
    if model_type not in HF_ARCHITECTURES:
        raise ValueError(
            f"{source}: unsupported architecture {model_type!r} "
            f"(supported: {', '.join(HF_ARCHITECTURES)})"
        )
    activation = raw.get("hidden_act", "silu")
    if activation != "silu":
        raise ValueError(f"{source}: unsupported hidden_act {activation!r} (the MLP is SwiGLU)")
    if raw.get("mlp_bias", False):
        raise ValueError(f"{source}: mlp_bias is not supported (the MLP has no biases)")

    hidden = _required_int(raw, "hidden_size", source)
    heads = _required_int(raw, "num_attention_heads", source)
    kv_heads = raw.get("num_key_value_heads") or heads
    head_dim = raw.get("head_dim") or (hidden // heads if heads else 0)
    theta, scaling = rope_from_hf(raw, source)
    fields = dict(
        vocab_size=_required_int(raw, "vocab_size", source),
        hidden_size=hidden,
        intermediate_size=_required_int(raw, "intermediate_size", source),
        num_layers=_required_int(raw, "num_hidden_layers", source),
        num_heads=heads,
        num_kv_heads=int(kv_heads),
        head_dim=int(head_dim),
        max_context=_max_context_hf(raw, source),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
    )
    try:
        return ModelConfig(**fields)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{source}: invalid model configuration: {error}") from error


def _required_int(raw: dict[str, Any], key: str, source: Path) -> int:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{source}: {key} must be an integer, got {value!r}")
    return value


def _max_context_hf(raw: dict[str, Any], source: Path) -> int:
    """`max_position_embeddings`, capped at the sliding window if one is active."""
    context = _required_int(raw, "max_position_embeddings", source)
    window = raw.get("sliding_window")
    active = raw["model_type"] == "mistral" or bool(raw.get("use_sliding_window", False))
    if active and isinstance(window, int) and 0 < window < context:
        return window
    return context


def rope_from_hf(raw: dict[str, Any], source: Path) -> tuple[float, RopeScaling | None]:
    """RoPE base and scaling from a Hugging Face config.

    transformers >= 5 writes `rope_parameters` (holding `rope_theta` and
    `rope_type`); older configs have a top-level `rope_theta` and an optional
    `rope_scaling` (`rope_type`, or `type` in the oldest ones).

    Returns:
        `(rope_theta, scaling)`; scaling is None for the default RoPE.

    Raises:
        ValueError: a RoPE type other than default / llama3, partial rotary
            embeddings, or a llama3 entry with a missing field.
    """
    parameters = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(parameters, dict) or any(isinstance(v, dict) for v in parameters.values()):
        raise ValueError(f"{source}: unsupported rope parameters {parameters!r}")
    theta = float(parameters.get("rope_theta", raw.get("rope_theta", 10_000.0)))
    partial = parameters.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"{source}: partial rotary embeddings ({partial}) are not supported")
    rope_type = parameters.get("rope_type", parameters.get("type")) or "default"
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ValueError(
            f"{source}: unsupported rope type {rope_type!r} (supported: default, llama3)"
        )
    try:
        scaling = RopeScaling(
            factor=float(parameters["factor"]),
            low_freq_factor=float(parameters["low_freq_factor"]),
            high_freq_factor=float(parameters["high_freq_factor"]),
            original_context=int(parameters["original_max_position_embeddings"]),
        )
    except KeyError as error:
        raise ValueError(f"{source}: llama3 rope scaling lacks {error.args[0]}") from error
    return theta, scaling


def safetensors_files(directory: Path) -> list[Path]:
    """The safetensors files of a directory: the index's shards, or model.safetensors, or all.

    Raises:
        FileNotFoundError: a shard listed in the index is missing.
        ValueError: no safetensors at all, or an unreadable index.
    """
    index = directory / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as error:
            raise ValueError(f"{index}: not a valid safetensors index: {error!r}") from error
        files = [directory / name for name in names]
        for file in files:
            if not file.exists():
                raise FileNotFoundError(f"{file} is listed in {index} but does not exist")
        return files
    single = directory / "model.safetensors"
    if single.exists():
        return [single]
    files = sorted(directory.glob("*.safetensors"))
    if files:
        return files
    raise ValueError(f"{directory}: no *.safetensors files")


def refuse_pickled_only(directory: Path) -> None:
    """Refuse a directory whose only weights are pickled (`pytorch_model.bin`, ...).

    Raises:
        ValueError: there is no safetensors file but a pickled one; the
            message says to convert the checkpoint to safetensors.
    """
    if any(directory.glob("*.safetensors")):
        return
    pickled = sorted(p for p in directory.iterdir() if p.suffix.lower() in PICKLE_SUFFIXES)
    if pickled:
        raise ValueError(pickle_refusal(pickled[0]))


def read_safetensors(
    files: Iterable[Path], *, dtype: torch.dtype, progress: Callable[[str], None]
) -> dict[str, Tensor]:
    """Every tensor of the files, cast to `dtype`.

    Raises:
        ValueError: a file cannot be parsed (truncated, not safetensors), or a
            tensor name appears in two files.
    """
    files = list(files)
    tensors: dict[str, Tensor] = {}
    for number, file in enumerate(files, start=1):
        progress(f"reading {file.name} ({number}/{len(files)})")
        for name, tensor in read_safetensors_file(file, dtype=dtype).items():
            if name in tensors:
                raise ValueError(f"{file}: tensor {name} also appears in another file")
            tensors[name] = tensor
    return tensors


def read_safetensors_file(file: Path, *, dtype: torch.dtype) -> dict[str, Tensor]:
    """The tensors of one safetensors file (without RoPE buffers), cast to `dtype`.

    Raises:
        ValueError: the file cannot be parsed (truncated, not safetensors).
    """
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as reader:
            return {
                name: reader.get_tensor(name).to(dtype)
                for name in reader.keys()
                if not _HF_IGNORED.search(name)
            }
    except Exception as error:  # safetensors raises its own error types
        raise ValueError(f"{file}: not a readable safetensors file: {error}") from error
