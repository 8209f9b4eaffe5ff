"""Model loading: Hugging Face safetensors directories and GGUF files → `ModelWeights`.

`load_weights(path)` reads a Llama-family checkpoint into the decoder's
weights (`decodespec.spec.forward.ModelWeights`), in the layout the spec defines:
projections `[out_features, in_features]`, RoPE in the half-split layout.
This module picks the format and assembles the weights, checking every
shape; `hf_checkpoint` reads Hugging Face directories and `gguf_checkpoint`
GGUF files, through `gguf_file`, the one module that opens them.

Supported inputs:

- a Hugging Face style directory: `config.json` and `model.safetensors`, or
  shards listed by `model.safetensors.index.json`, or (without an index) every
  `*.safetensors` file of the directory. `model_type` must be `llama`,
  `mistral` or `qwen2`. A path to a `.safetensors` file or to `config.json`
  stands for its directory.
- a GGUF file (llama.cpp's format, any quantization the `gguf` package can
  dequantize: F32, F16, BF16, Q4_0, Q4_1, Q8_0, K-quants, ...) with
  `general.architecture` `llama` or `qwen2`. Every tensor is dequantized to
  float32, then cast to the requested dtype, or converted to a weight format
  (`weights=`, `weight_formats.py`: int4 keeps the file's own 4-bit blocks,
  without dequantizing them, int8 quantizes their dequantized weights per
  channel; `auto` picks the file's own format, `resolve_format`).
  llama.cpp's converter permutes the rows of the `llama` Q and K projections
  into its interleaved RoPE layout;
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

import os
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path

import torch
from torch import Tensor

from decodespec.spec.forward import LayerWeights, ModelConfig, ModelWeights

from .gguf_checkpoint import read_gguf_checkpoint
from .gguf_file import GGUFFile, looks_like_gguf, open_gguf
from .hf_checkpoint import (
    EMBEDDING,
    FINAL_NORM,
    OUTPUT,
    PICKLE_SUFFIXES,
    config_from_hf,
    layer_tensor_name,
    pickle_refusal,
    read_hf_config,
    read_safetensors,
    refuse_pickled_only,
    safetensors_files,
)
from .tokenizer import Tokenizer
from .weight_formats import (
    AUTO,
    FOUR_BIT_GGUF_TYPES,
    NativeFormat,
    check_choice,
    convert_weights,
    keeps_blocks,
    native_format,
)

Progress = Callable[[str], None]


def load_weights(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    weights: str | None = None,
    progress: Progress | None = None,
) -> ModelWeights:
    """Load a Llama-family checkpoint as the decoder's weights.

    Args:
        path: a Hugging Face style directory (config.json + safetensors), a
            `.safetensors` file or `config.json` inside one, or a GGUF file.
        dtype: floating-point dtype of the returned tensors (on the CPU).
        weights: a weight format of `weight_formats.WEIGHT_FORMATS`
            (`float32`, `bfloat16`, `int8`, `int4`) instead of `dtype`; int4
            keeps a GGUF file's own 4-bit blocks. Or `auto`: the file's own
            format (`resolve_format`). Its summary (a `LoadSummary`, whose
            `weights` is the format loaded) goes to `progress`.
        progress: called with a short message every few tensors (reading
            and dequantizing a large GGUF file takes seconds); `None` for silence.

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
    if weights is not None:
        check_choice(weights)
        if dtype != torch.float32:
            raise ValueError(f"give dtype or weights, not both (dtype={dtype}, weights={weights})")
    report = progress or (lambda _message: None)
    if path.is_dir() or path.suffix == ".safetensors" or path.name == "config.json":
        directory = path if path.is_dir() else path.parent
        model = load_hf_directory(directory, dtype=dtype, progress=report)
        if weights is None:
            return model
        chosen, reason = _resolved(weights, HF_NATIVE)
        return convert_weights(model, chosen, source=directory, report=report, reason=reason)
    if looks_like_gguf(path):
        return load_gguf(path, dtype=dtype, weights=weights, progress=report)
    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise ValueError(pickle_refusal(path))
    raise ValueError(
        f"{path}: not a model: expected a directory with config.json and *.safetensors, "
        f"or a .gguf file"
    )


def load_model(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    weights: str | None = None,
    progress: Progress | None = None,
) -> tuple[ModelWeights, Tokenizer]:
    """Weights and tokenizer of a GGUF file or a Hugging Face directory.

    A GGUF file is opened once for both. `weights` as for `load_weights`
    (`auto`: the file's own format, which the `LoadSummary` sent to `progress`
    names). Raises as `load_weights` and `Tokenizer.from_file` /
    `Tokenizer.from_gguf` do.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model path {path} does not exist")
    if path.is_file() and looks_like_gguf(path):
        (progress or (lambda _message: None))(f"reading GGUF metadata of {path.name}")
        file = open_gguf(path)
        model = load_gguf(path, dtype=dtype, weights=weights, progress=progress, file=file)
        return model, Tokenizer.from_gguf(file)
    model = load_weights(path, dtype=dtype, weights=weights, progress=progress)
    return model, _directory_tokenizer(path)


def _directory_tokenizer(path: Path) -> Tokenizer:
    """The tokenizer beside a Hugging Face checkpoint (`path`: its directory or a file in it)."""
    return Tokenizer.from_file(path if path.is_dir() else path.parent)


def load_formats(
    path: str | Path, formats: Sequence[str], *, progress: Progress | None = None
) -> tuple[dict[str, ModelWeights], Tokenizer]:
    """The model in each weight format of `formats` (by the names given, `auto`
    included), and its tokenizer, opening a GGUF file once. Raises as `load_model`."""
    path = Path(path)
    if not (path.is_file() and looks_like_gguf(path)):
        models = {name: load_weights(path, weights=name, progress=progress) for name in formats}
        return models, _directory_tokenizer(path)
    file = open_gguf(path)
    models = {name: load_gguf(path, weights=name, progress=progress, file=file) for name in formats}
    return models, Tokenizer.from_gguf(file)


HF_NATIVE = NativeFormat("float32", "a Hugging Face checkpoint")


def resolve_format(path: GGUFFile | str | os.PathLike[str], weights: str = AUTO) -> str:
    """The format `weights` loads `path` as: itself if it names one, else (`auto`) the
    file's own format (`weight_formats.native_format`): a GGUF file's, from the types
    of its layers' projections (reading its header only), float32 for a Hugging Face
    directory. `native_gguf_format` gives the reason too.

    Raises:
        ValueError: an unknown format, or a GGUF file that cannot be read.
        FileNotFoundError: no such path.
    """
    check_choice(weights)
    if weights != AUTO:
        return weights
    if isinstance(path, GGUFFile):
        return native_gguf_format(path).weights
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model path {path} does not exist")
    if path.is_file() and looks_like_gguf(path):
        return native_gguf_format(open_gguf(path)).weights
    return HF_NATIVE.weights


def native_gguf_format(file: GGUFFile) -> NativeFormat:
    """`auto`'s format for an open GGUF file, and why: `native_format` of the types of
    its layers' projections (the 2-D tensors `blk.N.*`), weighed by their sizes."""
    elements: Counter[str] = Counter()
    for tensor in file.tensors:
        if tensor.name.startswith("blk.") and len(tensor.dims) == 2:
            elements[tensor.type_name] += tensor.dims[0] * tensor.dims[1]
    return native_format(elements)


def _resolved(
    weights: str, native: NativeFormat | Callable[[], NativeFormat]
) -> tuple[str, str | None]:
    """`weights` and no reason, or for `auto` the native format and why (`native` is
    called if it is a function: reading a file's types is only needed for `auto`)."""
    if weights != AUTO:
        return weights, None
    return native() if callable(native) else native


# ---------------------------------------------------------------------------
# Assembly: tensors by Hugging Face name (`hf_checkpoint.tensor_names`) -> ModelWeights.
# ---------------------------------------------------------------------------


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
    """Tensors by name, handed out once each, with shape checks and clear errors.

    Tensors are named as Hugging Face names them; `spelling` maps a name to
    the one the checkpoint file uses (a GGUF file's `blk.0.attn_q.weight`),
    so that every message names the tensor as the file does.
    """

    def __init__(
        self, tensors: dict[str, Tensor], source: Path, spelling: Mapping[str, str]
    ) -> None:
        self.tensors = tensors
        self.source = source
        self.spelling = spelling

    def spelled(self, name: str) -> str:
        """`name` as the checkpoint file spells it."""
        return self.spelling.get(name, name)

    def take(self, name: str, shape: tuple[int, ...]) -> Tensor:
        """Remove and return tensor `name`, checking its shape against the config."""
        if name not in self.tensors:
            raise ValueError(f"{self.source}: tensor {self.spelled(name)} is missing")
        tensor = self.tensors.pop(name)
        if tuple(tensor.shape) != shape:
            raise ValueError(
                f"{self.source}: tensor {self.spelled(name)} has shape {list(tensor.shape)}, "
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
            names = sorted(self.spelled(name) for name in self.tensors)
            shown = ", ".join(names[:5]) + (
                f", ... ({len(names)} in all)" if len(names) > 5 else ""
            )
            raise ValueError(
                f"{self.source}: unexpected tensors {shown}: the Llama-family decoder has no "
                f"place for them (a different architecture?)"
            )


def _assemble(
    config: ModelConfig,
    tensors: dict[str, Tensor],
    source: Path,
    spelling: Mapping[str, str] | None = None,
) -> ModelWeights:
    """Build `ModelWeights` from tensors by Hugging Face name, checking every shape.

    Args:
        config: the checkpoint's configuration, which implies every shape.
        tensors: the tensors by Hugging Face name; consumed.
        source: the checkpoint, for error messages.
        spelling: the file's own name of each Hugging Face name, for error
            messages (GGUF); names not in it are spelled as they are.
    """
    table = _TensorTable(tensors, source, spelling or {})
    shapes = expected_shapes(config)
    embedding = table.take(EMBEDDING, (config.vocab_size, config.hidden_size))
    layers = []
    for index in range(config.num_layers):
        fields = {
            field: table.take(layer_tensor_name(index, field), shapes[field])
            for field in _WEIGHT_FIELDS
        }
        for field in _BIAS_FIELDS:
            name = layer_tensor_name(index, field)
            if config.attention_bias:
                fields[field] = table.take(name, shapes[field])
            elif name in table.tensors:
                raise ValueError(
                    f"{source}: tensor {table.spelled(name)} is present but the config has no "
                    f"attention bias"
                )
        o_bias_name = layer_tensor_name(index, "o_bias")
        o_bias = table.take_optional(o_bias_name, shapes["o_bias"])
        if o_bias is not None and bool(o_bias.count_nonzero()):
            raise ValueError(
                f"{source}: tensor {table.spelled(o_bias_name)} is a nonzero attention "
                f"output bias, which the decoder of spec.forward does not have"
            )
        layers.append(LayerWeights(**fields))
    final_norm = table.take(FINAL_NORM, (config.hidden_size,))
    if config.tie_word_embeddings:
        table.discard(OUTPUT)  # tied: the output projection is the embedding
        output = embedding
    else:
        output = table.take(OUTPUT, (config.vocab_size, config.hidden_size))
    table.check_empty()
    return ModelWeights(
        config=config, embedding=embedding, layers=layers, final_norm=final_norm, output=output
    )


# ---------------------------------------------------------------------------
# Hugging Face directories: config.json + safetensors (read by hf_checkpoint).
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
    return _assemble(config, tensors, directory)


# ---------------------------------------------------------------------------
# GGUF files (read by gguf_checkpoint, through gguf_file).
# ---------------------------------------------------------------------------


def load_gguf(
    path: Path,
    *,
    dtype: torch.dtype = torch.float32,
    weights: str | None = None,
    progress: Progress | None = None,
    file: GGUFFile | None = None,
) -> ModelWeights:
    """Load a GGUF file (see `load_weights`).

    `gguf_checkpoint.read_gguf_checkpoint` reads the config and the tensors
    (dequantized to float32, under Hugging Face's names; int4 keeps the 4-bit
    blocks of the layers' projections, which are then not dequantized);
    messages still name them as the file does.

    Args:
        path: the .gguf file.
        dtype: dtype of the returned tensors (dequantized through float32).
        weights: a weight format instead of `dtype`, or `auto` (see `load_weights`).
        progress: called with a message every few tensors.
        file: the file already opened with `open_gguf` (opened here otherwise).

    Returns:
        The weights and their config.

    Raises:
        ValueError: refused or corrupt file (see `load_weights`).
    """
    report = progress or (lambda _message: None)
    if weights is not None:
        check_choice(weights)
    if file is None:
        report(f"reading GGUF metadata of {path.name}")
        file = open_gguf(path)
    chosen, reason = (
        (None, None) if weights is None else _resolved(weights, partial(native_gguf_format, file))
    )
    keep = FOUR_BIT_GGUF_TYPES if chosen == "int4" else ()
    config, tensors, spelling, blocks, types = read_gguf_checkpoint(
        file,
        progress=report,
        keep_types=keep,
        blocks_only=partial(keeps_blocks, chosen) if keep else None,
    )
    tensors = {name: tensor.to(dtype) for name, tensor in tensors.items()}
    model = _assemble(config, tensors, path, spelling)
    if chosen is None:
        return model
    return convert_weights(
        model,
        chosen,
        reason=reason,
        gguf_blocks=blocks,
        gguf_types=types,
        spelling=spelling,
        source=path,
        report=report,
    )
