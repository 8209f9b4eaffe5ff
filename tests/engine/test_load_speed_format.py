"""The fast GGUF load and `--weights auto` (issue 41).

- `gguf_parse`, the loader's own GGUF header parser, reads what
  `gguf.GGUFReader` reads (every value type, both byte orders) and refuses
  corrupt files with a `ValueError` that names them;
- the vectorized decoders of `gguf_fast`, the int8 per-channel quantizer
  and the int4 code unpacking of `cpu_linear` are their definitions
  (`gguf.quants`, `spec.gguf_blocks`, `spec.quant`) bit for bit;
- `auto` resolves to the file's own format and the load summary says which
  and why; int4 does not dequantize the blocks it keeps.

No timing here: load times are measured by the benchmarks, never pass/fail.
"""

from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest
import torch

from decodespec.reference import gguf_file, loader
from decodespec.reference.cpu_linear import int4_codes, to_bfloat16
from decodespec.reference.gguf_fast import (
    FAST_DEQUANTIZE,
    _half_as_torch,
    dequantize_fast,
    groups_fast,
)
from decodespec.reference.gguf_file import open_gguf
from decodespec.reference.tokenizer_gguf import _byte_level_bytes
from decodespec.reference.tokenizer_parts import BYTE_TO_UNICODE, byte_level_bytes
from decodespec.reference.weight_formats import (
    WEIGHT_CHOICES,
    WEIGHT_FORMATS,
    LoadSummary,
    int8_per_channel,
    native_format,
)
from decodespec.spec.gguf_blocks import BLOCK_TYPES, dequantize_gguf, gguf_groups
from decodespec.spec.quant import QuantizedWeight, quantize_weight, unpack_codes
from tests.engine import checkpoints

# the float16 fields of each block type (byte offsets), given finite values below
HALF_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q6_K": (208,)}


def random_blocks(kind: str, rows: int, columns: int, seed: int) -> np.ndarray:
    """Random bytes of a `[rows, columns]` tensor of type `kind` whose float16 fields are
    finite (normal, subnormal, ±0); float tensors hold specials too (±inf, NaN)."""
    rng = np.random.default_rng(seed)
    size, nbytes = BLOCK_TYPES[kind]
    if kind in ("F32", "F16"):
        values = rng.standard_normal((rows, columns)) * 10.0 ** rng.integers(-6, 4)
        values.flat[:4] = [np.inf, -np.inf, np.nan, -0.0]
        dtype = np.float32 if kind == "F32" else np.float16
        return values.astype(dtype).view(np.uint8).reshape(rows, -1)
    data = rng.integers(0, 256, (rows, columns // size, nbytes), dtype=np.uint8)
    for byte in HALF_FIELDS.get(kind, ()):
        halves = (rng.standard_normal(data.shape[:2]) * 10.0 ** rng.integers(-7, 2)).astype(
            np.float16
        )
        halves.flat[:3] = [0.0, -0.0, 1e-7]  # ±0 and a subnormal
        data[:, :, byte : byte + 2] = halves.view(np.uint8).reshape(*data.shape[:2], 2)
    return data.reshape(rows, -1)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's raw bytes, so that equality is bit for bit (-0, NaN payloads)."""
    return tensor.contiguous().view(torch.uint8)


# ------------------------------------------------------------------ the fast decoders


@pytest.mark.clause("GGUF-BLOCK-1", "GGUF-FLOAT-1")
@pytest.mark.parametrize("kind", (*FAST_DEQUANTIZE, "Q6_K"))
@pytest.mark.parametrize("seed", range(3))
def test_the_loaders_dequantization_is_the_gguf_packages_bit_for_bit(kind, seed):
    """`gguf_fast` for its types, the spec's `dequantize_gguf` for Q6_K (the loader's
    `_dequantize`), against `gguf.quants.dequantize`, what the loader called before."""
    size = BLOCK_TYPES[kind][0]
    columns = 2 * max(size, 32)
    data = random_blocks(kind, 5, columns, seed)
    typed = {"F32": np.float32, "F16": np.float16}.get(kind)
    want = gguf.quants.dequantize(data if typed is None else data.view(typed), gguf_type(kind))
    decode = dequantize_fast if kind in FAST_DEQUANTIZE else dequantize_gguf
    got = decode(torch.from_numpy(data), kind, columns)
    assert got.dtype == torch.float32 and tuple(got.shape) == (5, columns)
    assert torch.equal(bits(got), bits(torch.from_numpy(np.ascontiguousarray(want))))


@pytest.mark.clause("GGUF-GROUPS-1")
@pytest.mark.parametrize("kind", ("Q4_0", "Q4_1", "Q4_K", "Q8_0"))
@pytest.mark.parametrize("seed", range(3))
def test_groups_fast_is_gguf_groups_bit_for_bit(kind, seed):
    columns = 2 * BLOCK_TYPES[kind][0] if kind == "Q4_K" else 96
    data = torch.from_numpy(random_blocks(kind, 6, columns, seed))
    want, got = gguf_groups(data, kind, columns), groups_fast(data, kind, columns)
    assert (got.bits, got.group_size, got.shape) == (want.bits, want.group_size, want.shape)
    for field in ("qweight", "scales", "offsets"):
        ours, theirs = getattr(got, field), getattr(want, field)
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, field
        assert torch.equal(bits(ours), bits(theirs)), field


def test_the_fast_decoders_keep_the_specs_argument_errors():
    data = torch.zeros(2, 20, dtype=torch.uint8)
    with pytest.raises(ValueError, match="row_bytes"):
        groups_fast(data, "Q4_1", 64)
    with pytest.raises(ValueError, match="row_bytes"):
        dequantize_fast(data, "Q4_1", 64)
    with pytest.raises(ValueError, match="not group-quantized"):
        groups_fast(torch.zeros(2, 8, dtype=torch.uint8), "F32", 2)


@pytest.mark.clause("QUANT-ROUND-1")
@pytest.mark.parametrize("seed", range(4))
def test_int8_per_channel_is_quantize_weight_bit_for_bit(seed):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(12, 48, generator=generator) * 10.0 ** (seed - 2)
    weight[0] = 0.0  # a zero row: scale 0
    weight[1] = -0.0
    weight[2, :4] = torch.tensor([127.0, 0.5, -0.5, 1.5])  # ties to even after / 1
    weight[3] = torch.arange(48) - 24.0
    ours = int8_per_channel(weight)
    theirs = quantize_weight(weight, bits=8, group_size=48)
    for field in ("qweight", "scales", "offsets"):
        assert torch.equal(bits(getattr(ours, field)), bits(getattr(theirs, field))), field
    assert (ours.bits, ours.group_size) == (8, 48)


@pytest.mark.parametrize("bad", (float("nan"), float("inf")))
def test_int8_per_channel_refuses_what_the_definition_refuses(bad):
    weight = torch.ones(3, 16)
    weight[1, 5] = bad
    with pytest.raises(ValueError, match="non-finite"):
        int8_per_channel(weight)
    with pytest.raises(ValueError, match="2-D"):
        int8_per_channel(torch.ones(16))


def test_int4_codes_are_unpack_codes():
    qweight = torch.randint(0, 256, (33, 40), dtype=torch.uint8)
    for q in (qweight, qweight[:, ::2], qweight[1:, 8:]):
        assert torch.equal(int4_codes(q), unpack_codes(q, 4))
        assert int4_codes(q).dtype == torch.int32


@pytest.mark.parametrize("rows", (48, 40))  # 40: padded to 48 rows
def test_cpu_packing_is_the_torch_packing_bit_for_bit(rows):
    """`CpuInt4Linear` / `CpuInt8Linear` (numpy beside PyTorch's conversion op) hold the
    bytes the plain torch packing gave: codes by `unpack_codes`, rows padded with
    zeros, scale and zero stacked and rounded to bfloat16."""
    from decodespec.reference.cpu_linear import CpuInt4Linear, CpuInt8Linear

    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(rows, 64, generator=generator)
    int4 = quantize_weight(weight, bits=4, group_size=32)
    packed = CpuInt4Linear(int4)
    pad = 48 - rows
    codes = torch.cat([unpack_codes(int4.qweight, 4), torch.zeros(pad, 64, dtype=torch.int32)])
    scales = torch.cat([int4.scales, torch.zeros(pad, 2)])
    zeros = torch.cat([int4.offsets + 8 * int4.scales, torch.zeros(pad, 2)])
    want = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    assert torch.equal(packed.packed, want)
    pairs = torch.stack([scales.T, zeros.T], dim=-1).to(torch.bfloat16).contiguous()
    assert torch.equal(bits(packed.scale_and_zero), bits(pairs))
    int8 = CpuInt8Linear(quantize_weight(weight, bits=8, group_size=64))
    want = quantize_weight(weight, bits=8, group_size=64).scales[:, 0].to(torch.bfloat16)
    assert torch.equal(bits(int8.scales), bits(want))


def test_float16_fields_convert_as_torch_converts_them():
    """Every float16 bit pattern (signalling NaNs: torch quiets them, numpy does not)."""
    patterns = np.arange(65536, dtype=np.uint16)
    ours = _half_as_torch(patterns.view(np.uint8).reshape(-1, 2), 0)
    theirs = torch.from_numpy(patterns.view(np.float16).copy()).to(torch.float32)
    assert torch.equal(bits(torch.from_numpy(ours)), bits(theirs))


def test_to_bfloat16_rounds_as_torch_does():
    rng = np.random.default_rng(0)
    values = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    special = [np.inf, -np.inf, 0.0, -0.0, 3.4028235e38, 1e-45, 1 + 2**-8, 1 + 3 * 2**-8]
    values = np.concatenate([values[~np.isnan(values)], np.array(special, np.float32)])
    for array in (values, values[:4000].reshape(40, 100).T, np.array([1.0, np.nan], np.float32)):
        ours = to_bfloat16(array)
        theirs = torch.from_numpy(np.ascontiguousarray(array)).to(torch.bfloat16)
        assert ours.is_contiguous() and torch.equal(bits(ours), bits(theirs))


def test_byte_level_bytes_by_translation_are_byte_level_bytes():
    rng = np.random.default_rng(0)
    alphabet = list(BYTE_TO_UNICODE.values())
    others = [" ", "\xad", "\xa0", "\x00", "€", "😀", "Ł", "ł"]  # outside it, and inside
    for _ in range(3000):
        pool = alphabet + others if rng.random() < 0.3 else alphabet
        token = "".join(rng.choice(pool, rng.integers(0, 8)))
        assert _byte_level_bytes(token) == byte_level_bytes(token), token


# ------------------------------------------------------------------ the header parser


def gguf_type(name: str) -> gguf.GGMLQuantizationType:
    return gguf.GGMLQuantizationType[name]


def write_all_value_types(path, endianess=gguf.GGUFEndian.LITTLE):
    """A GGUF file holding every value type, arrays of each, and two tensors."""
    writer = gguf.GGUFWriter(str(path), "llama", endianess=endianess)
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -100)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float32("t.f32", 1e-5)
    writer.add_float64("t.f64", 1 / 3)
    writer.add_bool("t.yes", True)
    writer.add_bool("t.no", False)
    writer.add_string("t.text", "héllo ⟨GGUF⟩")
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, -1.25])
    writer.add_array("t.bools", [True, False, True])
    writer.add_array("t.strings", ["a", "", "Ġb", "é😀"])
    writer.add_tensor("blk.0.attn_q.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.add_tensor("norm", np.linspace(-1, 1, 8).astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("endian", ("LITTLE", "BIG"))
def test_the_parser_reads_what_gguf_reader_reads(tmp_path, endian):
    path = write_all_value_types(tmp_path / "all.gguf", gguf.GGUFEndian[endian])
    reader = gguf.GGUFReader(path)
    for file in (open_gguf(path), open_gguf(reader)):
        fields = {k for k in reader.fields if not k.startswith("GGUF.")}
        assert set(file.header.fields) == fields
        for key in fields:
            assert file.value(key) == reader.fields[key].contents(), key
        assert file.array_length("t.strings") == 4
        for ours, theirs in zip(file.tensors, reader.tensors, strict=True):
            assert (ours.name, ours.ggml_type, ours.offset, ours.nbytes) == (
                theirs.name,
                theirs.tensor_type,
                theirs.data_offset,
                theirs.n_bytes,
            )
            assert ours.dims == tuple(theirs.shape.tolist())
        dense = gguf_file.dequantize_tensors(file, progress=lambda _m: None)
        for tensor in reader.tensors:
            want = torch.from_numpy(np.array(tensor.data, dtype=np.float32))
            assert torch.equal(dense[tensor.name], want.reshape(dense[tensor.name].shape))
    assert open_gguf(reader).source == "the GGUF file"


def _string(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


def _kv(key: bytes, kind: int, payload: bytes) -> bytes:
    return _string(key) + struct.pack("<I", kind) + payload


def _info(name: bytes, dims: tuple[int, ...], kind: int, offset: int = 0) -> bytes:
    count = len(dims)
    return _string(name) + struct.pack(f"<I{count}QIQ", count, *dims, kind, offset)


def _file(kvs=(), infos=(), data=b"", version=3, magic=b"GGUF") -> bytes:
    header = magic + struct.pack("<IQQ", version, len(infos), len(kvs))
    header += b"".join(kvs) + b"".join(infos)
    return header + b"\0" * (-len(header) % 32) + data


ARCH = _kv(b"general.architecture", 8, _string(b"llama"))
CORRUPT = {
    "magic": _file([ARCH], magic=b"GGUX"),
    "version 1": _file([ARCH], version=1),
    "version 4": _file([ARCH], version=4),
    "duplicate key": _file([ARCH, ARCH]),
    "unknown value type": _file([_kv(b"k", 13, b"\0" * 8)]),
    "key not UTF-8": _file([_kv(b"\xff\xfe", 4, b"\0" * 4)]),
    "array past the end": _file([_kv(b"k", 9, struct.pack("<IQ", 4, 2**40))]),
    "string past the end": _file([_kv(b"k", 8, struct.pack("<Q", 2**20))]),
    "alignment 3": _file([_kv(b"general.alignment", 4, struct.pack("<I", 3))]),
    "alignment uint64": _file([_kv(b"general.alignment", 10, struct.pack("<Q", 64))]),
    "duplicate tensor": _file([], [_info(b"w", (4,), 0)] * 2, b"\0" * 16),
    "unknown tensor type": _file([], [_info(b"w", (4,), 99)], b"\0" * 16),
    "row not whole blocks": _file([], [_info(b"w", (33, 1), 8)], b"\0" * 64),
    "data past the end": _file([], [_info(b"w", (8,), 0)], b"\0" * 16),
    "too many dimensions": _file([], [_info(b"w", (1,) * 9, 0)], b"\0" * 4),
    "empty": b"",
    "header only": b"GGUF\x03\x00",
}


@pytest.mark.parametrize("case", sorted(CORRUPT))
def test_a_corrupt_file_is_a_value_error_naming_it(tmp_path, case):
    path = tmp_path / "corrupt.gguf"
    path.write_bytes(CORRUPT[case])
    with pytest.raises(ValueError, match=r"corrupt\.gguf: not a readable GGUF file") as info:
        open_gguf(path)
    assert info.value.__cause__ is not None or case == "empty"
    with pytest.raises(ValueError, match=r"corrupt\.gguf"):
        loader.load_model(path)


def test_every_truncation_of_a_file_is_refused(tmp_path):
    whole = write_all_value_types(tmp_path / "whole.gguf").read_bytes()
    end = max(t.offset + t.nbytes for t in open_gguf(tmp_path / "whole.gguf").tensors)
    for cut in range(0, end, 7):
        path = tmp_path / "cut.gguf"
        path.write_bytes(whole[:cut])
        with pytest.raises(ValueError, match=r"cut\.gguf: not a readable GGUF file"):
            open_gguf(path)


def test_a_string_that_is_not_utf8_is_an_error_of_its_key(tmp_path):
    path = tmp_path / "latin1.gguf"
    path.write_bytes(_file([ARCH, _kv(b"general.name", 8, _string(b"caf\xe9"))]))
    file = open_gguf(path)  # the header is readable
    assert file.string("general.architecture") == "llama"
    with pytest.raises(ValueError, match=r"latin1\.gguf: GGUF metadata general\.name is unre"):
        file.string("general.name")


# ------------------------------------------------------------------ auto


@pytest.mark.parametrize(
    ("types", "weights", "phrase"),
    [
        ({"Q4_0": 1}, "int4", "the file's Q4_0 blocks"),
        ({"Q4_1": 1}, "int4", "the file's Q4_1 blocks"),
        ({"Q4_K": 9, "Q6_K": 1}, "int4", "the file's Q4_K blocks (90% of its projections'"),
        ({"Q8_0": 1}, "int8", "the file's Q8_0 blocks"),
        ({"F32": 1}, "float32", "the file's F32 weights"),
        ({"F16": 1}, "float32", "the file's F16 weights"),
        ({"BF16": 1}, "float32", "the file's BF16 weights"),
        ({"Q5_K": 1}, "int4", "Q5_K blocks, 5-bit: requantized to int4"),
        ({"Q5_1": 1}, "int4", "Q5_1 blocks, 5-bit: requantized to int4"),
        ({"Q2_K": 1}, "int4", "Q2_K blocks, 2-bit: requantized to int4"),
        ({"IQ4_NL": 1}, "int4", "IQ4_NL blocks, 4-bit: requantized to int4"),
        ({"Q6_K": 3, "Q4_K": 1}, "int8", "Q6_K blocks (75% of its projections' weights), 6-bit"),
        ({"Q8_K": 1}, "int8", "Q8_K blocks, 8-bit: requantized to int8 per channel"),
        ({"MXFP4": 1}, "int4", "MXFP4 blocks, 4-bit: requantized to int4"),
        ({}, "float32", "no quantized projections"),
    ],
)
def test_native_format(types, weights, phrase):
    chosen = native_format(types)
    assert chosen.weights == weights and phrase in chosen.reason
    assert chosen.weights in WEIGHT_FORMATS


def test_auto_is_a_choice_and_not_a_format():
    assert WEIGHT_CHOICES == ("auto", *WEIGHT_FORMATS)
    with pytest.raises(ValueError, match="choose one of auto, float32, bfloat16, int8, int4"):
        loader.resolve_format("anything", "int3")
    assert loader.resolve_format("anything", "int8") == "int8"  # no file read


@pytest.mark.parametrize(
    ("kind", "weights"),
    [
        ("Q4_0", "int4"),
        ("Q4_K", "int4"),
        ("Q8_0", "int8"),
        ("F16", "float32"),
        ("BF16", "float32"),
        ("Q6_K", "int8"),
        ("Q5_K", "int4"),
        ("Q2_K", "int4"),
    ],
)
def test_resolve_format_reads_the_projections_types(tmp_path, kind, weights):
    """Projections (2-D `blk.N.*`) in `kind`, the embedding and a norm in other types."""
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    block = gguf.GGML_QUANT_SIZES[gguf_type(kind)]
    for name in ("blk.0.attn_q.weight", "blk.0.ffn_down.weight"):
        raw = np.zeros((4, 512 // block[0] * block[1]), np.uint8)
        writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=gguf_type(kind))
    embedding = np.zeros((64, 34), np.uint8)  # Q8_0, bigger than the projections
    writer.add_tensor("token_embd.weight", embedding, raw_dtype=gguf_type("Q8_0"))
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(512, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert loader.resolve_format(tmp_path / "m.gguf") == weights
    assert loader.resolve_format(open_gguf(tmp_path / "m.gguf"), "auto") == weights


@pytest.fixture(scope="module")
def small_llama():
    return checkpoints.hf_model("llama", tie_word_embeddings=True)


def small_gguf(directory, model, projections: str):
    """The small model as a GGUF file laid out as the bundled one: projections in
    `projections`, the tied embedding Q8_0, the norms F32."""
    tensors = checkpoints.gguf_tensors(model, "llama")
    quantize = {n: projections for n in tensors if n.startswith("blk.") and "norm" not in n}
    quantize["token_embd.weight"] = "Q8_0"
    path = directory / f"{projections}.gguf"
    return checkpoints.write_gguf(path, "llama", model.config, tensors, quantize=quantize)


def load_auto(path):
    messages = []
    weights = loader.load_weights(path, weights="auto", progress=messages.append)
    summaries = [m for m in messages if isinstance(m, LoadSummary)]
    assert len(summaries) == 1
    return weights, summaries[0]


TIED = "(the output projection tied to the embedding)"


@pytest.mark.clause("GGUF-GROUPS-1")
def test_auto_loads_a_q4_1_file_as_int4_keeping_its_blocks(tmp_path, small_llama):
    path = small_gguf(tmp_path, small_llama, "Q4_1")
    weights, summary = load_auto(path)
    assert summary == (
        "int4 (auto: the file's Q4_1 blocks): 14 kept from Q4_1 blocks, "
        f"1 quantized at load from Q8_0 to int8 per channel {TIED}"
    )
    assert summary.weights == "int4" == loader.resolve_format(path)
    int4 = loader.load_weights(path, weights="int4")
    for ours, theirs in zip(weights.layers, int4.layers, strict=True):
        assert torch.equal(ours.q_proj.qweight, theirs.q_proj.qweight)
        assert torch.equal(ours.down_proj.scales, theirs.down_proj.scales)


@pytest.mark.parametrize(
    ("kind", "summary"),
    [
        ("Q8_0", "int8 (auto: the file's Q8_0 blocks): 15 quantized at load from Q8_0 to int8"),
        ("F16", "float32 (auto: the file's F16 weights): every tensor float32"),
        ("Q5_0", "int4 (auto: the file's Q5_0 blocks, 5-bit: requantized to int4, the nearest)"),
    ],
)
def test_auto_on_other_files_says_what_it_chose_and_why(tmp_path, small_llama, kind, summary):
    path = small_gguf(tmp_path, small_llama, kind)
    weights, said = load_auto(path)
    assert said.startswith(summary)
    assert said.weights == loader.resolve_format(path)
    if kind == "Q5_0":
        assert ": 14 quantized at load from Q5_0, 1 quantized at load from Q8_0" in said
    if kind == "F16":
        assert torch.equal(weights.layers[0].q_proj, loader.load_weights(path).layers[0].q_proj)


def test_auto_loads_a_hugging_face_directory_as_float32(tmp_path, small_llama):
    directory = checkpoints.save_hf(small_llama, tmp_path / "hf")
    weights, summary = load_auto(directory)
    assert summary == "float32 (auto: a Hugging Face checkpoint): every tensor float32"
    assert summary.weights == "float32" == loader.resolve_format(directory)
    assert weights.dtype == torch.float32


def test_int4_does_not_dequantize_the_blocks_it_keeps(tmp_path, small_llama, monkeypatch):
    """The kept Q4_1 projections are never dequantized (most of the bundled model's load
    time, before); the Q8_0 embedding and the norms are. int8 dequantizes them all."""
    path = small_gguf(tmp_path, small_llama, "Q4_1")
    decoded = []

    def recording(data, type_name, columns):
        decoded.append(type_name)
        return dequantize_fast(data, type_name, columns)

    monkeypatch.setattr(gguf_file, "dequantize_fast", recording)
    weights = loader.load_weights(path, weights="int4")
    assert sorted(set(decoded)) == ["F32", "Q8_0"]
    assert all(
        isinstance(getattr(layer, name), QuantizedWeight) and getattr(layer, name).bits == 4
        for layer in weights.layers
        for name in ("q_proj", "down_proj")
    )
    decoded.clear()
    loader.load_weights(path, weights="int8")
    assert decoded.count("Q4_1") == 14
