"""GGUF's header, parsed with `struct` over the file's bytes: metadata and tensor infos.

`gguf_file.open_gguf` reads a file's header through `parse_header`. The
`gguf` package's `GGUFReader` parses the same header into numpy views, one
per value (about 250,000 for a 49,152-token vocabulary), which takes seconds;
this parser reads it in tens of milliseconds and leaves the values' bytes
undecoded until they are asked for (`decode_value`), so that an unreadable
string is an error of its key, not of the whole file, as it was with the
package.

The format (llama.cpp's `docs/gguf.md`, versions 2 and 3), every integer
little-endian (or big-endian throughout: the version then reads as a
multiple of 65,536, as `GGUFReader` detects it):

- magic `GGUF`, uint32 version, uint64 tensor count, uint64 key/value count;
- each key/value: a string key, a uint32 value type, the value. A string is
  a uint64 length and that many UTF-8 bytes; an array is a uint32 element
  type, a uint64 count and the elements; scalars are their fixed-size type
  (`VALUE_FORMATS`);
- each tensor info: a string name, a uint32 dimension count, that many
  uint64 dimensions (innermost first), a uint32 `GGMLQuantizationType`, a
  uint64 offset into the data section;
- the data section, at the header's end rounded up to `general.alignment`
  (a uint32 power of two, 32 by default).

Whatever `GGUFReader` refuses is refused, with a `ValueError`: another magic
or version, a truncated header, a value type it does not know, a duplicate
key or tensor name, an unknown tensor type, a row that is not whole blocks,
a bad alignment, and tensor data past the end of the file; and, which it
reads, a tensor of more than 8 dimensions (ggml has 4: a count that large
is noise, and each would be read before the file's end stopped it).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import gguf

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)  # GGUFReader's
DEFAULT_ALIGNMENT = 32
STRING, ARRAY, UINT32 = 8, 9, 4  # gguf.GGUFValueType
# struct format of each fixed-size value type (gguf.GGUFValueType)
VALUE_FORMATS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}

Raw = object  # a value as read: a number, bytes (a string), or an `ArrayValue`


@dataclass(frozen=True)
class ArrayValue:
    """An array as read: its element type and its elements (raw, see `Raw`)."""

    element_type: int
    items: list[Raw]


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file: where its bytes are and what they hold.

    Args:
        name: the file's name of it (`blk.0.attn_q.weight`).
        ggml_type: its `gguf.GGMLQuantizationType`.
        dims: its dimensions as GGUF lists them, innermost first.
        offset: the absolute byte offset of its data in the file.
        nbytes: its data's length in bytes.
    """

    name: str
    ggml_type: gguf.GGMLQuantizationType
    dims: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def type_name(self) -> str:
        """The type's name, `"Q4_1"`, `"F32"`, ..."""
        return self.ggml_type.name

    @property
    def shape(self) -> tuple[int, ...]:
        """Torch's order of the dimensions (outermost first): `[out, in]` for a matrix."""
        return tuple(reversed(self.dims))


@dataclass(frozen=True)
class GGUFHeader:
    """A parsed header: `fields` maps each key to its value type and raw value."""

    version: int
    byte_order: str  # struct's "<" or ">"
    fields: dict[str, tuple[int, Raw]]
    tensors: list[TensorInfo]
    alignment: int
    data_offset: int


class _Cursor:
    """Reads values one after another from a buffer, in one byte order."""

    def __init__(self, buffer: memoryview, order: str) -> None:
        self.buffer = buffer
        self.size = len(buffer)
        self.order = order
        self.offset = 0
        self.u32 = struct.Struct(order + "I")
        self.u64 = struct.Struct(order + "Q")

    def unpack(self, fmt: struct.Struct) -> int:
        if self.offset + fmt.size > self.size:
            raise ValueError(f"truncated at byte {self.offset} (the file has {self.size})")
        (value,) = fmt.unpack_from(self.buffer, self.offset)
        self.offset += fmt.size
        return value

    def take(self, count: int) -> bytes:
        end = self.offset + count
        if end > self.size:
            raise ValueError(f"truncated at byte {self.offset} (the file has {self.size})")
        data = bytes(self.buffer[self.offset : end])
        self.offset = end
        return data

    def string(self) -> bytes:
        return self.take(self.unpack(self.u64))

    def strings(self, count: int) -> list[bytes]:
        """`count` strings: the loop of a vocabulary (tens of thousands), kept tight."""
        buffer, size, offset = self.buffer, self.size, self.offset
        unpack = self.u64.unpack_from
        items = []
        append = items.append
        for _ in range(count):
            if offset + 8 > size:
                raise ValueError(f"truncated at byte {offset} (the file has {size})")
            (length,) = unpack(buffer, offset)
            offset += 8
            end = offset + length
            if end > size:
                raise ValueError(f"truncated at byte {offset} (the file has {size})")
            append(bytes(buffer[offset:end]))
            offset = end
        self.offset = offset
        return items

    def value(self, value_type: int) -> Raw:
        """One value of `value_type` (a string as bytes, an array as an `ArrayValue`)."""
        if value_type == STRING:
            return self.string()
        if value_type == ARRAY:
            element_type = self.unpack(self.u32)
            count = self.unpack(self.u64)
            if count > self.size - self.offset:  # every element takes at least a byte
                raise ValueError(f"an array of {count} elements at byte {self.offset}: truncated")
            return ArrayValue(element_type, self.array(element_type, count))
        fmt = VALUE_FORMATS.get(value_type)
        if fmt is None:
            raise ValueError(f"unknown value type {value_type} at byte {self.offset}")
        return self.unpack(struct.Struct(self.order + fmt))

    def array(self, element_type: int, count: int) -> list[Raw]:
        if element_type == STRING:
            return self.strings(count)
        fmt = VALUE_FORMATS.get(element_type)
        if fmt is None:  # arrays of arrays (llama.cpp writes none), or an unknown type
            return [self.value(element_type) for _ in range(count)]
        many = struct.Struct(f"{self.order}{count}{fmt}")
        if self.offset + many.size > self.size:
            raise ValueError(f"truncated at byte {self.offset} (the file has {self.size})")
        values = list(many.unpack_from(self.buffer, self.offset))
        self.offset += many.size
        return values


def parse_header(buffer: memoryview) -> GGUFHeader:
    """The header of the GGUF file whose bytes are `buffer` (see the module docstring).

    Raises:
        ValueError: not a GGUF file, or a header `GGUFReader` refuses, saying
            what and at which byte.
    """
    if bytes(buffer[:4]) != GGUF_MAGIC:
        raise ValueError("GGUF magic invalid")
    if len(buffer) < 8:
        raise ValueError(f"truncated at byte 4 (the file has {len(buffer)})")
    order = "<"
    (version,) = struct.unpack_from("<I", buffer, 4)
    if version & 0xFFFF == 0:
        order = ">"  # written on a big-endian machine
        (version,) = struct.unpack_from(">I", buffer, 4)
    if version not in SUPPORTED_VERSIONS:
        raise ValueError(f"GGUF version {version} is not supported ({SUPPORTED_VERSIONS})")
    cursor = _Cursor(buffer, order)
    cursor.offset = 8
    tensor_count, kv_count = cursor.unpack(cursor.u64), cursor.unpack(cursor.u64)
    fields: dict[str, tuple[int, Raw]] = {}
    for _ in range(kv_count):
        key = cursor.string().decode("utf-8")
        value_type = cursor.unpack(cursor.u32)
        if key in fields:
            raise ValueError(f"duplicate key {key}")
        fields[key] = (value_type, cursor.value(value_type))
    infos = [_tensor_info(cursor) for _ in range(tensor_count)]
    alignment = _alignment(fields)
    data_offset = -(-cursor.offset // alignment) * alignment
    tensors = _tensors(infos, data_offset, len(buffer))
    return GGUFHeader(version, order, fields, tensors, alignment, data_offset)


def _tensor_info(cursor: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    name = cursor.string().decode("utf-8")
    n_dims = cursor.unpack(cursor.u32)
    if n_dims > 8:  # GGML_MAX_DIMS is 4; anything this large is noise
        raise ValueError(f"tensor {name} has {n_dims} dimensions")
    dims = tuple(cursor.unpack(cursor.u64) for _ in range(n_dims))
    return name, dims, cursor.unpack(cursor.u32), cursor.unpack(cursor.u64)


def _alignment(fields: dict[str, tuple[int, Raw]]) -> int:
    if "general.alignment" not in fields:
        return DEFAULT_ALIGNMENT
    value_type, alignment = fields["general.alignment"]
    if value_type != UINT32:
        raise ValueError("Bad type for general.alignment field")
    if not isinstance(alignment, int) or alignment == 0 or alignment & (alignment - 1):
        raise ValueError("Invalid alignment: must be a non-zero power of two")
    return alignment


def _tensors(
    infos: list[tuple[str, tuple[int, ...], int, int]], data_offset: int, size: int
) -> list[TensorInfo]:
    tensors = []
    names: set[str] = set()
    for name, dims, raw_type, relative in infos:
        if name in names:
            raise ValueError(f"Found duplicated tensor with name {name}")
        names.add(name)
        ggml_type = gguf.GGMLQuantizationType(raw_type)  # ValueError if unknown
        block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
        elements = 1
        for dim in dims:
            elements *= dim
        if dims and dims[0] % block_size:
            raise ValueError(
                f"tensor {name}: rows of {dims[0]} elements are not whole "
                f"{ggml_type.name} blocks of {block_size}"
            )
        offset = data_offset + relative
        nbytes = elements * type_size // block_size
        if offset + nbytes > size:
            raise ValueError(
                f"tensor {name}: {nbytes} bytes at byte {offset} run past the end of the "
                f"file ({size} bytes): truncated"
            )
        tensors.append(TensorInfo(name, ggml_type, dims, offset, nbytes))
    return tensors


def decode_value(value_type: int, raw: Raw) -> object:
    """A value as `GGUFReader`'s `contents()` gives it: bytes decoded as UTF-8, arrays
    as lists, numbers as Python numbers.

    Raises:
        UnicodeDecodeError: a string that is not UTF-8.
    """
    if value_type == STRING:
        return raw.decode("utf-8")
    if isinstance(raw, ArrayValue):
        if raw.element_type == STRING:
            return [item.decode("utf-8") for item in raw.items]
        if raw.element_type == ARRAY:
            return [decode_value(ARRAY, item) for item in raw.items]
        return raw.items
    return raw
