"""GGUF files (llama.cpp's format): opening one, its typed metadata, tensor names, vocabulary.

The one module that opens GGUF files. The weights (`gguf_checkpoint.py`) and
the tokenizer (`tokenizer_gguf.py`) are read through it, so that one opened
file serves both (`loader.load_model`) and every error names the file and the key.

What it reads, and what it leaves to others:

- `open_gguf`: a `GGUFFile`, the file memory-mapped and its header parsed
  by `gguf_parse.parse_header` (tens of milliseconds; the `gguf` package's
  `GGUFReader` took seconds, and one already open is still accepted); an
  unreadable file is a `ValueError` naming it, chained to the parser's error.
- `GGUFFile.integer / number / string / ...`: metadata values checked for
  their type, with defaults; a per-layer integer list must hold one value.
- `GGUFFile.tensor_data`: a tensor's raw bytes, `[rows, row_bytes]` uint8,
  without a copy.
- `dequantize_tensors`: tensors as float32, in torch's dimension order: the
  types `decodespec.spec.gguf_blocks` defines (F32, F16, BF16, Q8_0, Q4_0,
  Q4_1, Q4_K, Q6_K) by vectorized code (`gguf_fast`, the spec's own for
  Q6_K), any other by the `gguf` package's numpy code; bit for bit what the
  package computes.
- `gguf_tensor_names`: the GGUF name of each Hugging Face tensor name, from
  `gguf.TensorNameMap` (the table llama.cpp's own converter uses), so the
  loader assembles both formats under one naming.
- `read_vocabulary`: the `tokenizer.ggml.*` keys as a `GGUFVocabulary`
  (tokens, `gguf.TokenType`s, merge pairs, special ids, BOS/EOS flags, chat
  template), checked for consistency; building a tokenizer from it is
  `tokenizer_gguf.py`'s job.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from torch import Tensor

from decodespec.spec.gguf_blocks import BLOCK_TYPES, dequantize_gguf

from .gguf_fast import FAST_DEQUANTIZE, dequantize_fast
from .gguf_parse import STRING, GGUFHeader, TensorInfo, decode_value, parse_header

GGUF_MAGIC = b"GGUF"
PROGRESS_EVERY = 16  # tensors between two progress messages of `dequantize_tensors`
# the GGUF value types (gguf.GGUFValueType) whose elements are read as these Python types
_ELEMENT_TYPES = {int: (0, 1, 2, 3, 4, 5, 10, 11), str: (STRING,)}
# numpy's dtype of the tensor types GGUFReader reads as typed arrays, not bytes
_TYPED = {"F16": "f2", "F32": "f4", "F64": "f8", "I8": "i1", "I16": "i2", "I32": "i4", "I64": "i8"}


def looks_like_gguf(path: Path) -> bool:
    """Whether a file is GGUF by its name (`.gguf`) or, failing that, its first bytes."""
    if path.suffix.lower() == ".gguf":
        return True
    with path.open("rb") as file:
        return file.read(len(GGUF_MAGIC)) == GGUF_MAGIC


@dataclass(frozen=True, eq=False)
class GGUFFile:
    """An open GGUF file and how error messages name it.

    Args:
        header: its parsed header (metadata, tensor infos).
        buffer: the file's bytes (a memory map).
        source: the file's path, or "the GGUF file" for a `gguf.GGUFReader`
            opened by someone else (it does not know its path).
    """

    header: GGUFHeader
    buffer: memoryview
    source: Path | str

    @property
    def tensors(self) -> list[TensorInfo]:
        """The file's tensors, in the file's order."""
        return self.header.tensors

    @property
    def tensor_names(self) -> set[str]:
        """The names of the file's tensors (GGUF spelling: `blk.0.attn_q.weight`)."""
        return {tensor.name for tensor in self.header.tensors}

    def tensor_data(self, tensor: TensorInfo) -> Tensor:
        """The raw bytes of `tensor`, uint8 `[rows, row_bytes]` (rows: every dimension but
        the innermost), a view of the file where it is writable (a private memory map),
        else a copy (a `gguf.GGUFReader`'s read-only map)."""
        rows = 1
        for dim in tensor.dims[1:]:
            rows *= dim
        shape = (rows, tensor.nbytes // rows if rows else 0)
        if self.buffer.readonly:
            view = np.frombuffer(self.buffer, np.uint8, tensor.nbytes, tensor.offset)
            return torch.from_numpy(view.copy()).reshape(shape)
        if tensor.nbytes == 0:
            return torch.empty(shape, dtype=torch.uint8)
        data = torch.frombuffer(
            self.buffer, dtype=torch.uint8, count=tensor.nbytes, offset=tensor.offset
        )
        return data.reshape(shape)

    def has(self, key: str) -> bool:
        """Whether metadata `key` is present."""
        return key in self.header.fields

    def array_length(self, key: str) -> int | None:
        """The number of elements of array metadata `key` (without decoding them), or None."""
        field = self.header.fields.get(key)
        if field is None:
            return None
        items = getattr(field[1], "items", None)
        return 1 if items is None else len(items)

    def value(self, key: str) -> object:
        """The value of metadata `key` (a scalar, a string or a list), None if absent.

        Raises:
            ValueError: the value cannot be decoded (a string that is not UTF-8).
        """
        field = self.header.fields.get(key)
        if field is None:
            return None
        try:
            return decode_value(*field)
        except UnicodeDecodeError as error:
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
        field = self.header.fields[key][1]
        if getattr(field, "element_type", None) in _ELEMENT_TYPES.get(element, ()):
            return value  # every element read as `element` (a vocabulary: no need to look)
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

    The file is memory-mapped (privately: tensors are views of it, and
    nothing is ever written to it) and its header parsed
    (`gguf_parse.parse_header`); a `gguf.GGUFReader`'s bytes are parsed the
    same way.

    Raises:
        FileNotFoundError: no file at the path.
        ValueError: not a path or reader, or not a readable GGUF file (bad
            magic, truncated); chained to the parser's error.
    """
    if isinstance(file, GGUFFile):
        return file
    if isinstance(file, gguf.GGUFReader):
        return _parsed(memoryview(file.data).cast("B"), "the GGUF file")
    if not isinstance(file, (str, os.PathLike)):
        raise ValueError(f"expected a gguf.GGUFReader or a path, got {type(file).__name__}")
    path = Path(file)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    try:
        with path.open("rb") as handle:
            mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
    except (OSError, ValueError) as error:  # an empty file cannot be mapped
        raise ValueError(f"{path}: not a readable GGUF file: {error}") from error
    return _parsed(memoryview(mapped), path)


def _parsed(buffer: memoryview, source: Path | str) -> GGUFFile:
    try:
        return GGUFFile(parse_header(buffer), buffer, source)
    except (ValueError, UnicodeDecodeError) as error:
        raise ValueError(f"{source}: not a readable GGUF file: {error}") from error


# --------------------------------------------------------------------------------------
# Tensors.


def dequantize_tensors(
    file: GGUFFile, *, progress: Callable[[str], None], skip: Collection[str] = ()
) -> dict[str, Tensor]:
    """The tensors of the file by GGUF name, dequantized to float32, in torch order.

    GGUF lists dimensions innermost first, so a `[out, in]` matrix is stored
    with shape `(in, out)`; the result has the reversed shape. F32, F16, BF16,
    Q8_0, Q4_0, Q4_1 and Q4_K are dequantized by `gguf_fast` (vectorized
    numpy, the package's formulas), Q6_K by `spec.gguf_blocks`
    (GGUF-BLOCK-1), any other type the `gguf` package can dequantize (Q5_K,
    Q2_K, IQ4_NL, ...) by the package itself, as are a big-endian file's
    tensors: every value bit for bit the package's
    (tests/engine/test_load_speed_format.py). Every tensor owns its memory
    (none is a view of the file).

    Args:
        file: the open file.
        progress: called with a short message every few tensors.
        skip: names of tensors not to dequantize (left out of the result).

    Raises:
        ValueError: a tensor whose type cannot be dequantized.
    """
    tensors: dict[str, Tensor] = {}
    wanted = [tensor for tensor in file.tensors if tensor.name not in skip]
    count = len(wanted)
    for number, tensor in enumerate(wanted, start=1):
        if number == 1 or number % PROGRESS_EVERY == 0 or number == count:
            progress(f"dequantizing GGUF tensors {number}/{count}")
        try:
            values = _dequantize(file, tensor)
        except Exception as error:  # gguf/numpy raise many types on bad input
            raise ValueError(
                f"{file.source}: tensor {tensor.name} ({tensor.type_name}, shape "
                f"{list(tensor.shape)}) cannot be dequantized: {error}"
            ) from error
        tensors[tensor.name] = values
    return tensors


def _dequantize(file: GGUFFile, tensor: TensorInfo) -> Tensor:
    """`tensor` as float32 in torch order, its own memory (see `dequantize_tensors`)."""
    columns = tensor.dims[0] if tensor.dims else 1
    if file.header.byte_order == "<":
        if tensor.type_name in FAST_DEQUANTIZE:
            return dequantize_fast(file.tensor_data(tensor), tensor.type_name, columns).reshape(
                tensor.shape
            )
        if tensor.type_name in BLOCK_TYPES:  # Q6_K
            data = file.tensor_data(tensor)
            return dequantize_gguf(data, tensor.type_name, columns).reshape(tensor.shape)
    # the bytes as GGUFReader gave them to the package: typed (a big-endian file's floats
    # read in its byte order, then made native, which the package's `view` would not do)
    # or as bytes
    from gguf.quants import dequantize, quant_shape_to_byte_shape

    typed = _TYPED.get(tensor.type_name)
    raw = np.frombuffer(file.buffer, np.uint8, tensor.nbytes, tensor.offset)
    if typed is None:
        raw = raw.reshape(quant_shape_to_byte_shape(tensor.shape, tensor.ggml_type))
    else:
        raw = raw.view(np.dtype(typed).newbyteorder(file.header.byte_order)).astype(typed)
    values = dequantize(raw, tensor.ggml_type)
    values = np.require(values, dtype=np.float32, requirements=["C", "W", "O"])
    return torch.from_numpy(values.reshape(tensor.shape))


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
    known = {int(kind): kind for kind in gguf.TokenType}
    token_types = [known.get(t, gguf.TokenType.NORMAL) for t in types]

    merges = file.array("tokenizer.ggml.merges", str)
    pairs = None if merges is None else _merge_pairs(merges, where)

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


def _merge_pairs(merges: list[str], where: Path | str) -> list[tuple[str, str]]:
    """Each merge "left right" as a pair (ValueError naming the first malformed one)."""
    parts = [merge.partition(" ") for merge in merges]
    for merge, (left, sep, right) in zip(merges, parts, strict=True):
        if not sep or not left or not right:
            raise ValueError(f"{where}: malformed merge {merge!r}")
    return [(left, right) for left, _sep, right in parts]
