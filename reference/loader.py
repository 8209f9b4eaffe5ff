"""Model loading: Hugging Face safetensors directories and GGUF files → `ModelWeights`.

`load_weights(path)` reads a Llama-family checkpoint into the decoder's
weights (`decodespec.spec.forward.ModelWeights`), in the layout the spec defines:
projections `[out_features, in_features]`, RoPE in the half-split layout.

Supported inputs:

- a Hugging Face style directory: `config.json` and `model.safetensors`, or
  shards listed by `model.safetensors.index.json`, or (without an index) every
  `*.safetensors` file of the directory. `model_type` must be `llama`,
  `mistral` or `qwen2`. A path to a `.safetensors` file or to `config.json`
  stands for its directory.
- a GGUF file (llama.cpp's format, any quantization the `gguf` package can
  dequantize: F32, F16, BF16, Q4_0, Q4_1, Q8_0, K-quants, ...) with
  `general.architecture` `llama` or `qwen2`. Every tensor is dequantized to
  float32, then cast to the requested dtype. llama.cpp's converter permutes
  the rows of the `llama` Q and K projections into its interleaved RoPE layout;
  the loader undoes that permutation (FWD-ROPE-1). `qwen2` files use the
  half-split layout already and are not permuted.

What is refused, always with an exception that names the file:

- pickled checkpoints (`pytorch_model.bin`, `*.pt`, `*.pth`, or a directory
  whose only weights are such files): never unpickled — convert them to
  safetensors first (`ValueError`);
- other architectures, activations other than SiLU, MLP biases, RoPE types
  other than the default and Llama 3's `llama3`, partial rotary embeddings,
  llama.cpp's `rope_freqs` tensor (Llama 3.1+ GGUF files) and a nonzero
  attention output bias (`ValueError`: the decoder of `decodespec.spec.forward` has no
  place for them; a Llama `attention_bias` checkpoint whose o_proj bias is all
  zero loads, the zero bias dropped);
- tensors that are missing, unexpected, or whose shape disagrees with the
  config (`ValueError`);
- files that cannot be parsed (random bytes, truncated files): `ValueError`
  chained (`from`) to the parser's own error.

Sliding-window attention (Mistral's `sliding_window`, Qwen2's
`use_sliding_window`): the decoder attends to the whole context, which equals
sliding-window attention as long as a sequence is no longer than the window.
The loader therefore caps `ModelConfig.max_context` at the window, so the
engine never runs a sequence where the two would differ.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from decodespec.spec.forward import LayerWeights, ModelConfig, ModelWeights, RopeScaling

from .tokenizer import Tokenizer

if TYPE_CHECKING:
    from gguf import GGUFReader

Progress = Callable[[str], None]

HF_ARCHITECTURES = ("llama", "mistral", "qwen2")
GGUF_ARCHITECTURES = ("llama", "qwen2")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
GGUF_MAGIC = b"GGUF"
PROGRESS_EVERY = 16  # tensors between two progress messages


def load_weights(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    progress: Progress | None = None,
) -> ModelWeights:
    """Load a Llama-family checkpoint as the decoder's weights.

    Args:
        path: a Hugging Face style directory (config.json + safetensors), a
            `.safetensors` file or `config.json` inside one, or a GGUF file.
        dtype: floating-point dtype of the returned tensors (on the CPU).
        progress: called with a short message every few tensors (reading
            and dequantizing a GGUF file takes seconds); `None` for silence.

    Returns:
        The weights, with the `ModelConfig` read from the checkpoint.

    Raises:
        FileNotFoundError: `path` (or a file the checkpoint refers to) does
            not exist.
        ValueError: the checkpoint is refused (pickled, unsupported
            architecture or option) or corrupt (unparsable, missing or
            unexpected tensors, shapes that disagree with the config); the
            message names the file and what is wrong.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model path {path} does not exist")
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point dtype, got {dtype}")
    report = progress or (lambda _message: None)
    if path.is_dir():
        return load_hf_directory(path, dtype=dtype, progress=report)
    if path.suffix == ".safetensors" or path.name == "config.json":
        return load_hf_directory(path.parent, dtype=dtype, progress=report)
    if path.suffix.lower() == ".gguf" or _starts_with(path, GGUF_MAGIC):
        return load_gguf(path, dtype=dtype, progress=report)
    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise ValueError(_pickle_refusal(path))
    raise ValueError(
        f"{path}: not a model: expected a directory with config.json and *.safetensors, "
        f"or a .gguf file"
    )


def _starts_with(path: Path, magic: bytes) -> bool:
    with path.open("rb") as file:
        return file.read(len(magic)) == magic


def _pickle_refusal(path: Path) -> str:
    return (
        f"{path}: pickled PyTorch checkpoints are refused (unpickling can run arbitrary "
        f"code); convert the checkpoint to safetensors first, e.g. "
        f"`AutoModelForCausalLM.from_pretrained(dir).save_pretrained(out, "
        f"safe_serialization=True)` in a trusted environment"
    )


# ---------------------------------------------------------------------------
# Tensor names: one table for both formats.
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Naming:
    """Where each weight of the decoder lives in one checkpoint format."""

    embedding: str
    final_norm: str
    output: str
    layer: Callable[[int, str], str]  # (layer index, LayerWeights field) -> name


_HF_LAYER = {
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
_GGUF_LAYER = {
    "attn_norm": "attn_norm.weight",
    "q_proj": "attn_q.weight",
    "k_proj": "attn_k.weight",
    "v_proj": "attn_v.weight",
    "o_proj": "attn_output.weight",
    "mlp_norm": "ffn_norm.weight",
    "gate_proj": "ffn_gate.weight",
    "up_proj": "ffn_up.weight",
    "down_proj": "ffn_down.weight",
    "q_bias": "attn_q.bias",
    "k_bias": "attn_k.bias",
    "v_bias": "attn_v.bias",
    "o_bias": "attn_output.bias",
}
HF_NAMING = _Naming(
    embedding="model.embed_tokens.weight",
    final_norm="model.norm.weight",
    output="lm_head.weight",
    layer=lambda index, field: f"model.layers.{index}.{_HF_LAYER[field]}",
)
GGUF_NAMING = _Naming(
    embedding="token_embd.weight",
    final_norm="output_norm.weight",
    output="output.weight",
    layer=lambda index, field: f"blk.{index}.{_GGUF_LAYER[field]}",
)
# Buffers some Hugging Face checkpoints carry that the decoder recomputes.
_HF_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The shape of each `LayerWeights` field (and of `o_bias`) under `config`."""
    hidden, d = config.hidden_size, config.head_dim
    q_rows, kv_rows = config.num_heads * d, config.num_kv_heads * d
    inter = config.intermediate_size
    return {
        "attn_norm": (hidden,),
        "q_proj": (q_rows, hidden),
        "k_proj": (kv_rows, hidden),
        "v_proj": (kv_rows, hidden),
        "o_proj": (hidden, q_rows),
        "mlp_norm": (hidden,),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
        "q_bias": (q_rows,),
        "k_bias": (kv_rows,),
        "v_bias": (kv_rows,),
        "o_bias": (hidden,),
    }


_WEIGHT_FIELDS = (
    "attn_norm",
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "mlp_norm",
    "gate_proj",
    "up_proj",
    "down_proj",
)
_BIAS_FIELDS = ("q_bias", "k_bias", "v_bias")


class _TensorTable:
    """Tensors by name, handed out once each, with shape checks and clear errors."""

    def __init__(self, tensors: dict[str, Tensor], source: Path) -> None:
        self.tensors = tensors
        self.source = source

    def take(self, name: str, shape: tuple[int, ...]) -> Tensor:
        """Remove and return tensor `name`, checking its shape against the config."""
        if name not in self.tensors:
            raise ValueError(f"{self.source}: tensor {name} is missing")
        tensor = self.tensors.pop(name)
        if tuple(tensor.shape) != shape:
            raise ValueError(
                f"{self.source}: tensor {name} has shape {list(tensor.shape)}, "
                f"the config implies {list(shape)}"
            )
        return tensor

    def take_optional(self, name: str, shape: tuple[int, ...]) -> Tensor | None:
        return self.take(name, shape) if name in self.tensors else None

    def discard(self, name: str) -> None:
        self.tensors.pop(name, None)

    def check_empty(self) -> None:
        """Refuse tensors the decoder has no place for (they would be silently ignored)."""
        if self.tensors:
            names = sorted(self.tensors)
            shown = ", ".join(names[:5]) + (
                f", ... ({len(names)} in all)" if len(names) > 5 else ""
            )
            raise ValueError(
                f"{self.source}: unexpected tensors {shown}: the Llama-family decoder has no "
                f"place for them (a different architecture?)"
            )


def _assemble(
    config: ModelConfig, tensors: dict[str, Tensor], naming: _Naming, source: Path
) -> ModelWeights:
    """Build `ModelWeights` from named tensors, checking every shape against `config`."""
    table = _TensorTable(tensors, source)
    shapes = expected_shapes(config)
    embedding = table.take(naming.embedding, (config.vocab_size, config.hidden_size))
    layers = []
    for index in range(config.num_layers):
        fields = {
            field: table.take(naming.layer(index, field), shapes[field]) for field in _WEIGHT_FIELDS
        }
        for field in _BIAS_FIELDS:
            name = naming.layer(index, field)
            if config.attention_bias:
                fields[field] = table.take(name, shapes[field])
            elif name in table.tensors:
                raise ValueError(
                    f"{source}: tensor {name} is present but the config has no attention bias"
                )
        o_bias = table.take_optional(naming.layer(index, "o_bias"), shapes["o_bias"])
        if o_bias is not None and bool(o_bias.count_nonzero()):
            raise ValueError(
                f"{source}: tensor {naming.layer(index, 'o_bias')} is a nonzero attention "
                f"output bias, which the decoder of spec.forward does not have"
            )
        layers.append(LayerWeights(**fields))
    final_norm = table.take(naming.final_norm, (config.hidden_size,))
    if config.tie_word_embeddings:
        table.discard(naming.output)  # tied: the output projection is the embedding
        output = embedding
    else:
        output = table.take(naming.output, (config.vocab_size, config.hidden_size))
    table.check_empty()
    return ModelWeights(
        config=config, embedding=embedding, layers=layers, final_norm=final_norm, output=output
    )


def _make_config(source: Path, **fields: object) -> ModelConfig:
    try:
        return ModelConfig(**fields)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{source}: invalid model configuration: {error}") from error


# ---------------------------------------------------------------------------
# Hugging Face directories: config.json + safetensors.
# ---------------------------------------------------------------------------


def load_hf_directory(
    directory: Path, *, dtype: torch.dtype = torch.float32, progress: Progress | None = None
) -> ModelWeights:
    """Load a Hugging Face style directory (see `load_weights`).

    Args:
        directory: holds config.json and the safetensors file(s).
        dtype: dtype of the returned tensors.
        progress: called with a message per safetensors file read.

    Returns:
        The weights and their config.

    Raises:
        FileNotFoundError: config.json or a listed shard is missing.
        ValueError: refused or corrupt checkpoint (see `load_weights`).
    """
    report = progress or (lambda _message: None)
    refuse_pickled_only(directory)
    config = config_from_hf(read_hf_config(directory / "config.json"), directory / "config.json")
    files = safetensors_files(directory)
    tensors = read_safetensors(files, dtype=dtype, progress=report)
    return _assemble(config, tensors, HF_NAMING, directory)


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
    capped at the sliding window where one applies (see the module doc).

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
    return _make_config(
        source,
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
        raise ValueError(_pickle_refusal(pickled[0]))


def read_safetensors(
    files: Iterable[Path], *, dtype: torch.dtype, progress: Progress
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


# ---------------------------------------------------------------------------
# GGUF files.
# ---------------------------------------------------------------------------


def load_gguf(
    path: Path,
    *,
    dtype: torch.dtype = torch.float32,
    progress: Progress | None = None,
    reader: GGUFReader | None = None,
) -> ModelWeights:
    """Load a GGUF file (see `load_weights`).

    Args:
        path: the .gguf file.
        dtype: dtype of the returned tensors (dequantized through float32).
        progress: called with a message every few tensors.
        reader: the file already opened with `open_gguf` (opening takes seconds).

    Returns:
        The weights and their config.

    Raises:
        ValueError: refused or corrupt file (see `load_weights`).
    """
    report = progress or (lambda _message: None)
    if reader is None:
        report(f"reading GGUF metadata of {path.name}")
        reader = open_gguf(path)
    architecture = gguf_str(reader, "general.architecture", path)
    if architecture not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"{path}: unsupported architecture {architecture!r} "
            f"(supported: {', '.join(GGUF_ARCHITECTURES)})"
        )
    if any(tensor.name == "rope_freqs.weight" for tensor in reader.tensors):
        raise ValueError(
            f"{path}: tensor rope_freqs.weight (llama.cpp's per-frequency RoPE factors, "
            f"Llama 3.1+ scaling) is not supported; load the Hugging Face checkpoint instead, "
            f"whose config.json carries the llama3 rope scaling"
        )
    config = config_from_gguf(reader, architecture, path)
    tensors = dequantize_gguf_tensors(reader, path, dtype=torch.float32, progress=report)
    if architecture == "llama":
        unpermute_llama_qk(tensors, config)
    tensors = {name: tensor.to(dtype) for name, tensor in tensors.items()}
    return _assemble(config, tensors, GGUF_NAMING, path)


def open_gguf(path: Path) -> GGUFReader:
    """A `gguf.GGUFReader` over the file.

    Raises:
        ValueError: the file is not a readable GGUF file (bad magic, truncated).
    """
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except Exception as error:  # gguf/numpy raise many types on bad input
        raise ValueError(f"{path}: not a readable GGUF file: {error}") from error


def gguf_value(reader: GGUFReader, key: str, source: Path) -> object:
    """The value of metadata `key` (a scalar, a string or a list), None if absent.

    Raises:
        ValueError: the value cannot be decoded.
    """
    field = reader.fields.get(key)
    if field is None:
        return None
    try:
        return field.contents()
    except Exception as error:  # gguf raises many types on bad input
        raise ValueError(f"{source}: GGUF metadata {key} is unreadable: {error}") from error


def gguf_int(reader: GGUFReader, key: str, source: Path, default: int | None = None) -> int:
    """Integer metadata `key` (a per-layer list must hold one value), else `default`.

    Raises:
        ValueError: absent without a default, not an integer, or varying by layer.
    """
    value = gguf_value(reader, key, source)
    if value is None and default is not None:
        return default
    if isinstance(value, list):
        if not value or len(set(value)) != 1:
            raise ValueError(f"{source}: GGUF metadata {key} varies by layer: unsupported")
        value = value[0]
    if value is None:
        raise ValueError(f"{source}: GGUF metadata {key} is missing")
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{source}: GGUF metadata {key} must be an integer, got {value!r}")
    return int(value)


def gguf_float(reader: GGUFReader, key: str, source: Path, default: float) -> float:
    """Float metadata `key`, else `default`.

    Raises:
        ValueError: not a number.
    """
    value = gguf_value(reader, key, source)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
        raise ValueError(f"{source}: GGUF metadata {key} must be a number, got {value!r}")
    return float(value)


def gguf_str(reader: GGUFReader, key: str, source: Path, default: str | None = None) -> str:
    """String metadata `key`, else `default`.

    Raises:
        ValueError: absent without a default, or not a string.
    """
    value = gguf_value(reader, key, source)
    if value is None and default is not None:
        return default
    if not isinstance(value, str):
        what = "is missing" if value is None else f"must be a string, got {value!r}"
        raise ValueError(f"{source}: GGUF metadata {key} {what}")
    return value


def config_from_gguf(reader: GGUFReader, architecture: str, source: Path) -> ModelConfig:
    """Translate GGUF metadata (`{arch}.block_count`, ...) into a `ModelConfig`.

    The head dimension is `{arch}.attention.key_length` if present, else
    embedding_length / head_count; `{arch}.rope.dimension_count` must equal it.
    The vocabulary size is `{arch}.vocab_size`, else the length of
    `tokenizer.ggml.tokens`, else the embedding's row count. Attention biases
    are on when layer 0 has an `attn_q.bias` tensor; embeddings are tied when
    there is no `output.weight` tensor.

    Raises:
        ValueError: a missing or invalid key, partial rotary embeddings, or a
            RoPE scaling type the decoder does not have.
    """
    prefix = architecture + "."
    hidden = gguf_int(reader, prefix + "embedding_length", source)
    heads = gguf_int(reader, prefix + "attention.head_count", source)
    kv_heads = gguf_int(reader, prefix + "attention.head_count_kv", source, heads)
    head_dim = gguf_int(
        reader, prefix + "attention.key_length", source, hidden // heads if heads else 0
    )
    value_dim = gguf_int(reader, prefix + "attention.value_length", source, head_dim)
    rope_dim = gguf_int(reader, prefix + "rope.dimension_count", source, head_dim)
    if value_dim != head_dim:
        raise ValueError(f"{source}: key length {head_dim} != value length {value_dim}")
    if rope_dim != head_dim:
        raise ValueError(
            f"{source}: partial rotary embeddings (rope.dimension_count {rope_dim}, "
            f"head_dim {head_dim}) are not supported"
        )
    scaling_type = gguf_str(reader, prefix + "rope.scaling.type", source, "none")
    if scaling_type != "none":
        raise ValueError(f"{source}: unsupported rope scaling type {scaling_type!r}")
    names = {tensor.name for tensor in reader.tensors}
    return _make_config(
        source,
        vocab_size=_gguf_vocab_size(reader, prefix, source),
        hidden_size=hidden,
        intermediate_size=gguf_int(reader, prefix + "feed_forward_length", source),
        num_layers=gguf_int(reader, prefix + "block_count", source),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        max_context=gguf_int(reader, prefix + "context_length", source),
        rms_norm_eps=gguf_float(reader, prefix + "attention.layer_norm_rms_epsilon", source, 1e-5),
        rope_theta=gguf_float(reader, prefix + "rope.freq_base", source, 10_000.0),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
    )


def _gguf_vocab_size(reader: GGUFReader, prefix: str, source: Path) -> int:
    if prefix + "vocab_size" in reader.fields:
        return gguf_int(reader, prefix + "vocab_size", source)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None:
        return len(tokens.data)
    for tensor in reader.tensors:
        if tensor.name == "token_embd.weight":
            return int(tensor.shape[-1])  # GGUF lists dimensions innermost first
    raise ValueError(f"{source}: cannot tell the vocabulary size (no {prefix}vocab_size)")


def dequantize_gguf_tensors(
    reader: GGUFReader, source: Path, *, dtype: torch.dtype, progress: Progress
) -> dict[str, Tensor]:
    """Every tensor of the file, dequantized and reshaped to torch order.

    GGUF lists dimensions innermost first, so a `[out, in]` matrix is stored
    with shape `(in, out)`; the result has the reversed shape.

    Raises:
        ValueError: a tensor whose type cannot be dequantized, or whose data
            does not match its declared shape (a truncated file).
    """
    from gguf.quants import dequantize

    tensors: dict[str, Tensor] = {}
    count = len(reader.tensors)
    for number, tensor in enumerate(reader.tensors, start=1):
        if number == 1 or number % PROGRESS_EVERY == 0 or number == count:
            progress(f"dequantizing GGUF tensors {number}/{count}")
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        try:
            values = dequantize(tensor.data, tensor.tensor_type)
            # writeable and owning its memory: F32 data is a view of the memory map
            values = np.require(values, dtype=np.float32, requirements=["C", "W", "O"])
            values = values.reshape(shape)
        except Exception as error:  # gguf/numpy raise many types on bad input
            type_name = getattr(tensor.tensor_type, "name", tensor.tensor_type)
            raise ValueError(
                f"{source}: tensor {tensor.name} ({type_name}, shape {list(shape)}) "
                f"cannot be dequantized: {error}"
            ) from error
        tensors[tensor.name] = torch.from_numpy(values).to(dtype)
    return tensors


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
    return weight.reshape(num_heads, half, 2, *rest).transpose(1, 2).reshape(weight.shape)


def unpermute_llama_qk(tensors: dict[str, Tensor], config: ModelConfig) -> None:
    """Un-permute the Q and K projections (and biases) of every layer, in place."""
    pattern = re.compile(r"^blk\.\d+\.attn_([qk])\.(weight|bias)$")
    for name, tensor in tensors.items():
        match = pattern.match(name)
        if match:
            heads = config.num_heads if match.group(1) == "q" else config.num_kv_heads
            if tensor.shape[0] % (2 * heads) == 0:  # else _assemble reports the bad shape
                tensors[name] = unpermute_rope_rows(tensor, heads)


def load_model(
    path: str | Path, *, dtype: torch.dtype = torch.float32, progress: Progress | None = None
) -> tuple[ModelWeights, Tokenizer]:
    """Weights and tokenizer of a GGUF file or a Hugging Face directory.

    A GGUF file is opened once for both. Raises as `load_weights` and
    `Tokenizer.from_file` / `Tokenizer.from_gguf` do.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model path {path} does not exist")
    if path.is_file() and (path.suffix.lower() == ".gguf" or _starts_with(path, GGUF_MAGIC)):
        (progress or (lambda _message: None))(f"reading GGUF metadata of {path.name}")
        reader = open_gguf(path)
        weights = load_gguf(path, dtype=dtype, progress=progress, reader=reader)
        return weights, Tokenizer.from_gguf(reader)
    weights = load_weights(path, dtype=dtype, progress=progress)
    directory = path if path.is_dir() else path.parent
    return weights, Tokenizer.from_file(directory)
