"""GGUF files (llama.cpp's format): opening one, its typed metadata, tensor names, vocabulary.

The one module that opens GGUF files. The weights (`gguf_checkpoint.py`) and
the tokenizer (`tokenizer_gguf.py`) are read through it, so that one opened
file serves both (`loader.load_model`: opening maps the file and parses its
header, which takes seconds) and every error names the file and the key.

What it reads, and what it leaves to the `gguf` package:

- `open_gguf`: a `GGUFFile`, the package's `gguf.GGUFReader` with the name
  errors give the file; an unreadable file is a `ValueError` chained to the
  parser's own error.
- `GGUFFile.integer / number / string / ...`: metadata values checked for
  their type, with defaults; a per-layer integer list must hold one value.
- `dequantize_tensors`: every tensor as float32, in torch's dimension order.
- `gguf_tensor_names`: the GGUF name of each Hugging Face tensor name, from
  `gguf.TensorNameMap` (the table llama.cpp's own converter uses), so the
  loader assembles both formats under one naming.
- `read_vocabulary`: the `tokenizer.ggml.*` keys as a `GGUFVocabulary`
  (tokens, `gguf.TokenType`s, merge pairs, special ids, BOS/EOS flags, chat
  template), checked for consistency; building a tokenizer from it is
  `tokenizer_gguf.py`'s job.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from torch import Tensor

GGUF_MAGIC = b"GGUF"
PROGRESS_EVERY = 16  # tensors between two progress messages of `dequantize_tensors`


def looks_like_gguf(path: Path) -> bool:
    """Whether a file is GGUF by its name (`.gguf`) or, failing that, its first bytes."""
    if path.suffix.lower() == ".gguf":
        return True
    with path.open("rb") as file:
        return file.read(len(GGUF_MAGIC)) == GGUF_MAGIC


@dataclass(frozen=True)
class GGUFFile:
    """An open GGUF file and how error messages name it.

    Args:
        reader: the `gguf.GGUFReader` over the file's memory map.
        source: the file's path, or "the GGUF file" for a reader opened by
            someone else (it does not know its path).
    """

    reader: gguf.GGUFReader
    source: Path | str

    @property
    def tensor_names(self) -> set[str]:
        """The names of the file's tensors (GGUF spelling: `blk.0.attn_q.weight`)."""
        return {tensor.name for tensor in self.reader.tensors}

    def has(self, key: str) -> bool:
        """Whether metadata `key` is present."""
        return key in self.reader.fields

    def array_length(self, key: str) -> int | None:
        """The number of elements of array metadata `key` (without decoding them), or None."""
        field = self.reader.fields.get(key)
        return None if field is None else len(field.data)

    def value(self, key: str) -> object:
        """The value of metadata `key` (a scalar, a string or a list), None if absent.

        Raises:
            ValueError: the value cannot be decoded.
        """
        field = self.reader.fields.get(key)
        if field is None:
            return None
        try:
            return field.contents()
        except Exception as error:  # gguf raises many types on bad input
            raise ValueError(
                f"{self.source}: GGUF metadata {key} is unreadable: {error}"
            ) from error

    def integer(self, key: str, default: int | None = None) -> int:
        """Integer metadata `key` (a per-layer list must hold one value), else `default`.

        Raises:
            ValueError: absent without a default, not an integer, or varying by layer.
        """
        value = self.value(key)
        if value is None and default is not None:
            return default
        if isinstance(value, list):
            if not value or len(set(value)) != 1:
                raise ValueError(f"{self.source}: GGUF metadata {key} varies by layer: unsupported")
            value = value[0]
        if value is None:
            raise ValueError(f"{self.source}: GGUF metadata {key} is missing")
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise ValueError(
                f"{self.source}: GGUF metadata {key} must be an integer, got {value!r}"
            )
        return int(value)

    def number(self, key: str, default: float) -> float:
        """Float metadata `key`, else `default`.

        Raises:
            ValueError: not a number.
        """
        value = self.value(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
            raise ValueError(f"{self.source}: GGUF metadata {key} must be a number, got {value!r}")
        return float(value)

    def string(self, key: str, default: str | None = None) -> str:
        """String metadata `key`, else `default`.

        Raises:
            ValueError: absent without a default, or not a string.
        """
        value = self.value(key)
        if value is None and default is not None:
            return default
        if not isinstance(value, str):
            what = "is missing" if value is None else f"must be a string, got {value!r}"
            raise ValueError(f"{self.source}: GGUF metadata {key} {what}")
        return value

    def optional_string(self, key: str) -> str | None:
        """String metadata `key`, or None if absent.

        Raises:
            ValueError: present but not a string.
        """
        return self.string(key) if self.has(key) else None

    def flag(self, key: str) -> bool | None:
        """Metadata `key` read as a truth value (llama.cpp's booleans), or None if absent."""
        value = self.value(key)
        return None if value is None else bool(value)

    def array(self, key: str, element: type) -> list | None:
        """Array metadata `key` whose elements are all of type `element`, or None if absent.

        Raises:
            ValueError: present but not such an array.
        """
        value = self.value(key)
        if value is None:
            return None
        kinds = (int, np.integer) if element is int else (element,)
        if not isinstance(value, list) or not all(
            isinstance(v, kinds) and not isinstance(v, bool) for v in value
        ):
            raise ValueError(
                f"{self.source}: GGUF metadata {key} must be an array of {element.__name__}"
            )
        return value


def open_gguf(file: GGUFFile | gguf.GGUFReader | str | os.PathLike[str]) -> GGUFFile:
    """Open a GGUF file (or wrap a reader already open, or pass a `GGUFFile` through).

    Raises:
        FileNotFoundError: no file at the path.
        ValueError: not a path or reader, or not a readable GGUF file (bad
            magic, truncated); chained to the parser's error.
    """
    if isinstance(file, GGUFFile):
        return file
    if isinstance(file, gguf.GGUFReader):
        return GGUFFile(file, "the GGUF file")
    if not isinstance(file, (str, os.PathLike)):
        raise ValueError(f"expected a gguf.GGUFReader or a path, got {type(file).__name__}")
    path = Path(file)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    try:
        return GGUFFile(gguf.GGUFReader(path, "r"), path)
    except Exception as error:  # gguf/numpy raise many types on bad input
        raise ValueError(f"{path}: not a readable GGUF file: {error}") from error


# --------------------------------------------------------------------------------------
# Tensors.


def dequantize_tensors(file: GGUFFile, *, progress: Callable[[str], None]) -> dict[str, Tensor]:
    """Every tensor of the file by its GGUF name, dequantized to float32, in torch order.

    GGUF lists dimensions innermost first, so a `[out, in]` matrix is stored
    with shape `(in, out)`; the result has the reversed shape. Any type the
    `gguf` package can dequantize is read (F32, F16, BF16, Q4_0, Q8_0,
    K-quants, ...).

    Args:
        file: the open file.
        progress: called with a short message every few tensors.

    Raises:
        ValueError: a tensor whose type cannot be dequantized, or whose data
            does not match its declared shape (a truncated file).
    """
    from gguf.quants import dequantize

    tensors: dict[str, Tensor] = {}
    count = len(file.reader.tensors)
    for number, tensor in enumerate(file.reader.tensors, start=1):
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
                f"{file.source}: tensor {tensor.name} ({type_name}, shape {list(shape)}) "
                f"cannot be dequantized: {error}"
            ) from error
        tensors[tensor.name] = torch.from_numpy(values)
    return tensors


def gguf_tensor_names(
    architecture: str, block_count: int, hf_names: Iterable[str]
) -> dict[str, str]:
    """The GGUF name of each Hugging Face tensor name, from `gguf.TensorNameMap`.

    For example `model.layers.0.self_attn.q_proj.weight` is
    `blk.0.attn_q.weight`. Names the map does not know for `architecture`
    are left out.

    Raises:
        ValueError: an architecture the `gguf` package does not know.
    """
    arch = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}.get(architecture)
    if arch is None:
        raise ValueError(f"the gguf package has no tensor names for architecture {architecture!r}")
    name_map = gguf.get_tensor_name_map(arch, block_count)
    names = {}
    for hf_name in hf_names:
        gguf_name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is not None:
            names[hf_name] = gguf_name
    return names


# --------------------------------------------------------------------------------------
# Vocabulary.


@dataclass(frozen=True)
class GGUFVocabulary:
    """A GGUF file's tokenizer, as its `tokenizer.ggml.*` metadata states it.

    Args:
        model: `tokenizer.ggml.model`: "gpt2" (byte-level BPE), "llama"
            (SentencePiece), "bert", "t5", ...
        pre: `tokenizer.ggml.pre`, the pre-tokenizer's name, or None.
        tokens: every token as the vocabulary spells it, by id.
        token_types: the `gguf.TokenType` of every token (NORMAL where the
            file has no `tokenizer.ggml.token_type`).
        merges: the BPE merges as pairs, in rank order; None if absent.
        bos_token_id: the beginning-of-sequence id, or None.
        eos_token_ids: the ids that end a generation: eos, then eot and eom
            (the ids the file itself names as ends of a turn), where present.
        unknown_token_id, padding_token_id: those ids, or None.
        add_bos, add_eos: `tokenizer.ggml.add_bos_token` / `add_eos_token`,
            None where the file does not say.
        chat_template: `tokenizer.chat_template`, or None.
    """

    model: str
    pre: str | None
    tokens: list[str]
    token_types: list[gguf.TokenType]
    merges: list[tuple[str, str]] | None
    bos_token_id: int | None
    eos_token_ids: list[int]
    unknown_token_id: int | None
    padding_token_id: int | None
    add_bos: bool | None
    add_eos: bool | None
    chat_template: str | None


def read_vocabulary(file: GGUFFile) -> GGUFVocabulary:
    """The `tokenizer.ggml.*` metadata of a GGUF file, checked for consistency.

    Token types outside `gguf.TokenType` (llama.cpp's 0, "undefined") are
    read as NORMAL.

    Raises:
        ValueError: no tokenizer in the file (no `tokenizer.ggml.model`), as
            many token types as tokens, a malformed merge ("left right"), a
            special id outside the vocabulary, or a value of the wrong type.
    """
    where = file.source
    model = file.optional_string("tokenizer.ggml.model")
    if model is None:
        raise ValueError(f"{where} has no tokenizer (no tokenizer.ggml.model key)")
    tokens = file.array("tokenizer.ggml.tokens", str) or []
    n = len(tokens)
    types = file.array("tokenizer.ggml.token_type", int) or [gguf.TokenType.NORMAL] * n
    if len(types) != n:
        raise ValueError(f"{where}: {len(types)} token types for {n} tokens")
    known = set(gguf.TokenType)
    token_types = [gguf.TokenType(t) if t in known else gguf.TokenType.NORMAL for t in types]

    merges = file.array("tokenizer.ggml.merges", str)
    pairs = None if merges is None else [_merge_pair(merge, where) for merge in merges]

    def token_id(key: str) -> int | None:
        key = f"tokenizer.ggml.{key}"
        if not file.has(key):
            return None
        value = file.integer(key)
        if not 0 <= value < n:
            raise ValueError(f"{where}: {key} = {value} is not a token id")
        return value

    ends = (token_id(key) for key in ("eos_token_id", "eot_token_id", "eom_token_id"))
    return GGUFVocabulary(
        model=model,
        pre=file.optional_string("tokenizer.ggml.pre"),
        tokens=tokens,
        token_types=token_types,
        merges=pairs,
        bos_token_id=token_id("bos_token_id"),
        eos_token_ids=[i for i in ends if i is not None],
        unknown_token_id=token_id("unknown_token_id"),
        padding_token_id=token_id("padding_token_id"),
        add_bos=file.flag("tokenizer.ggml.add_bos_token"),
        add_eos=file.flag("tokenizer.ggml.add_eos_token"),
        chat_template=file.optional_string("tokenizer.chat_template"),
    )


def _merge_pair(merge: str, where: Path | str) -> tuple[str, str]:
    left, sep, right = merge.partition(" ")
    if not sep or not left or not right:
        raise ValueError(f"{where}: malformed merge {merge!r}")
    return left, right
