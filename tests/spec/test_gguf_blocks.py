"""GGUF's block formats (spec/gguf_blocks.py) against gguf-py, llama.cpp's own Python
reader: random blocks of every type, the bundled model's tensors, and the mapping of
the group-quantized types onto QUANT-GROUP-1."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import Q4_K, dequantize
from hypothesis import given
from hypothesis import strategies as st

from decodespec.reference.model_files import bundled_model_path
from decodespec.spec.gguf_blocks import BLOCK_TYPES, dequantize_gguf, gguf_groups
from decodespec.spec.quant import unpack_codes
from decodespec.spec.softmax import ArgumentTypeError

# Byte offsets of each quantized type's float16 fields (d, m, dmin): the tests set
# them to finite values, so that no scale is NaN or infinite.
F16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q6_K": (208,)}
GROUP_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K")
NOT_GROUPS = ("F32", "F16", "BF16", "Q6_K")


def random_blocks(type_name: str, rows: int, blocks: int, seed: int, zeros: float) -> np.ndarray:
    """uint8 `[rows, blocks · B]`: random code bytes, finite random float16 fields
    (any sign, subnormal to 65504; a fraction `zeros` of them ±0)."""
    rng = np.random.default_rng(seed)
    _, block_bytes = BLOCK_TYPES[type_name]
    raw = rng.integers(0, 256, size=(rows, blocks, block_bytes), dtype=np.uint8)
    for offset in F16_FIELDS.get(type_name, ()):
        bits = rng.integers(0, 1 << 16, size=(rows, blocks), dtype=np.uint16)
        bits = np.where((bits & 0x7C00) == 0x7C00, bits ^ 0x4000, bits)  # inf/NaN -> finite
        bits = np.where(rng.random((rows, blocks)) < zeros, bits & 0x8000, bits)  # ±0
        raw[..., offset : offset + 2] = bits[..., None].view(np.uint8)
    return raw.reshape(rows, blocks * block_bytes)


def peer(raw: np.ndarray, type_name: str) -> np.ndarray:
    """gguf-py's dequantization of the same bytes, float32 `[rows, columns]`."""
    if type_name in ("F32", "F16"):  # gguf-py takes these typed, not as bytes
        raw = raw.view(np.float32 if type_name == "F32" else np.float16)
    out = dequantize(raw, gguf.GGMLQuantizationType[type_name])
    return np.ascontiguousarray(out, dtype=np.float32).reshape(raw.shape[0], -1)


def bits(x: torch.Tensor | np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).view(np.int32)


def columns_of(type_name: str, blocks: int) -> int:
    return BLOCK_TYPES[type_name][0] * blocks


blocks_of = st.fixed_dictionaries(
    {
        "rows": st.integers(1, 4),
        "blocks": st.integers(1, 3),
        "seed": st.integers(0, 2**32 - 1),
        "zeros": st.sampled_from([0.0, 0.3]),
    }
)


# ------------------------------------------------------------------ the block layouts


@pytest.mark.clause("GGUF-BLOCK-1")
@pytest.mark.parametrize(
    "type_name",
    [  # each quantized type with the clause of its layout
        pytest.param("Q8_0", marks=pytest.mark.clause("GGUF-Q80-1")),
        pytest.param("Q4_0", marks=pytest.mark.clause("GGUF-Q40-1")),
        pytest.param("Q4_1", marks=pytest.mark.clause("GGUF-Q41-1")),
        pytest.param("Q4_K", marks=pytest.mark.clause("GGUF-Q4K-1")),
        pytest.param("Q6_K", marks=pytest.mark.clause("GGUF-Q6K-1")),
    ],
)
@given(drawn=blocks_of)
def test_blocks_dequantize_as_gguf_py_does_bit_for_bit(type_name, drawn):
    raw = random_blocks(type_name, **drawn)
    columns = columns_of(type_name, drawn["blocks"])
    out = dequantize_gguf(torch.from_numpy(raw), type_name, columns)
    assert out.dtype == torch.float32 and out.shape == (drawn["rows"], columns)
    np.testing.assert_array_equal(bits(out), bits(peer(raw, type_name)))


@pytest.mark.clause("GGUF-FLOAT-1", "GGUF-BLOCK-1")
@pytest.mark.parametrize("type_name", ["F32", "F16", "BF16"])
@given(drawn=blocks_of)
def test_float_types_dequantize_as_gguf_py_does(type_name, drawn):
    """Random bytes: every float16 / bfloat16 / float32 value, NaN and ±inf included.
    A NaN stays a NaN (its payload is not specified)."""
    raw = random_blocks(type_name, **drawn)
    columns = drawn["blocks"]
    out = dequantize_gguf(torch.from_numpy(raw), type_name, columns).numpy()
    ref = peer(raw, type_name)
    assert out.shape == ref.shape
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
    finite = ~np.isnan(ref)
    np.testing.assert_array_equal(bits(out)[finite], bits(ref)[finite])


@pytest.mark.clause("GGUF-Q40-1", "GGUF-Q41-1")
def test_nibble_order_and_offsets_by_hand():
    """One Q4_0 and one Q4_1 block written out: byte j holds elements j and j + 16."""
    codes = bytes(j | (15 - j) << 4 for j in range(16))  # element j: j, element j + 16: 15 − j
    one, half = np.float16(1.0).tobytes(), np.float16(0.5).tobytes()
    q4_0 = torch.tensor([list(one + codes)], dtype=torch.uint8)
    q4_1 = torch.tensor([list(one + half + codes)], dtype=torch.uint8)
    low, high = torch.arange(16.0), 15 - torch.arange(16.0)
    assert torch.equal(dequantize_gguf(q4_0, "Q4_0", 32)[0], torch.cat([low, high]) - 8)
    assert torch.equal(dequantize_gguf(q4_1, "Q4_1", 32)[0], torch.cat([low, high]) + 0.5)


# ------------------------------------------------------------------ the bundled model


@pytest.fixture(scope="module")
def bundled_tensors() -> dict[str, object]:
    try:
        path = bundled_model_path()
    except FileNotFoundError as error:
        pytest.skip(str(error))
    reader = gguf.GGUFReader(path, "r")
    return {tensor.name: tensor for tensor in reader.tensors}


@pytest.mark.clause("GGUF-BLOCK-1", "GGUF-Q41-1", "GGUF-Q80-1", "GGUF-GROUPS-1")
@pytest.mark.parametrize("name", ["blk.0.ffn_down.weight", "token_embd.weight"])
def test_bundled_model_tensors_dequantize_as_gguf_py_does(bundled_tensors, name):
    tensor = bundled_tensors[name]
    raw = np.asarray(tensor.data)[:512]  # all of token_embd takes seconds
    type_name, columns = tensor.tensor_type.name, int(tensor.shape[0])
    assert type_name == ("Q8_0" if name == "token_embd.weight" else "Q4_1")
    data = torch.from_numpy(raw.copy())
    out = dequantize_gguf(data, type_name, columns)
    ref = dequantize(raw, tensor.tensor_type).reshape(raw.shape[0], columns)
    np.testing.assert_array_equal(bits(out), bits(ref))
    assert torch.equal(gguf_groups(data, type_name, columns).dequantize(), out)


# ------------------------------------------------------------------ the mapping onto QUANT-GROUP-1


@pytest.mark.clause("GGUF-GROUPS-1")
@pytest.mark.parametrize("type_name", GROUP_TYPES)
@given(drawn=blocks_of)
def test_groups_dequantize_to_the_blocks(type_name, drawn):
    """Equal as numbers always; bit for bit but for the sign of a zero (Q8_0, Q4_0),
    and bit for bit everywhere for Q4_1 and Q4_K."""
    raw = random_blocks(type_name, **drawn)
    columns = columns_of(type_name, drawn["blocks"])
    data = torch.from_numpy(raw)
    weight = gguf_groups(data, type_name, columns)
    assert weight.shape == (drawn["rows"], columns) and weight.group_size == 32
    assert weight.bits == (8 if type_name == "Q8_0" else 4)
    assert weight.scales.dtype == weight.offsets.dtype == torch.float32
    out, blocks = weight.dequantize(), dequantize_gguf(data, type_name, columns)
    assert torch.equal(out, blocks)
    exact = bits(out) == bits(blocks)
    if type_name in ("Q4_1", "Q4_K"):
        assert exact.all()
    else:
        assert (exact | (blocks.numpy() == 0)).all()


@pytest.mark.clause("GGUF-GROUPS-1")
@pytest.mark.parametrize("type_name", GROUP_TYPES)
@given(drawn=blocks_of)
def test_groups_scales_offsets_and_codes_are_the_blocks_fields(type_name, drawn):
    """The scales and offsets are the fields of GGUF-GROUPS-1 (read here with gguf-py's
    Q4_K scale unpacking), and the codes are in QUANT-CODES-1's order."""
    raw = random_blocks(type_name, **drawn)
    rows, blocks = drawn["rows"], drawn["blocks"]
    weight = gguf_groups(torch.from_numpy(raw), type_name, columns_of(type_name, blocks))
    fields = raw.reshape(rows, blocks, -1)
    d = fields[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    second = fields[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    if type_name == "Q4_K":
        sc, m = Q4_K.get_scale_min(fields[..., 4:16].reshape(-1, 12))
        scales = (d.reshape(-1, 1) * sc.astype(np.float32)).reshape(rows, -1)
        offsets = -(second.reshape(-1, 1) * m.astype(np.float32)).reshape(rows, -1)
    else:
        scales = d
        offsets = {"Q8_0": np.zeros_like(d), "Q4_0": -8 * d, "Q4_1": second}[type_name]
    np.testing.assert_array_equal(bits(weight.scales), bits(scales))
    np.testing.assert_array_equal(bits(weight.offsets), bits(offsets))
    # gguf-py's dequantization of the blocks with unit scales gives the codes.
    codes = peer(unit_scales(raw, type_name), type_name) + (8 if type_name == "Q4_0" else 0)
    np.testing.assert_array_equal(unpack_codes(weight.qweight, weight.bits).numpy(), codes)


def unit_scales(raw: np.ndarray, type_name: str) -> np.ndarray:
    """The same blocks with d = 1 and m = dmin = 0 (Q4_K: every sc_j = 1, m_j = 0),
    so that dequantizing them gives the codes (minus 8 for Q4_0)."""
    out = raw.reshape(raw.shape[0], -1, BLOCK_TYPES[type_name][1]).copy()
    out[..., 0:2] = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)
    if type_name in ("Q4_1", "Q4_K"):
        out[..., 2:4] = 0
    if type_name == "Q4_K":
        out[..., 4:8], out[..., 8:12], out[..., 12:16] = 1, 0, 1
    return out.reshape(raw.shape)


@pytest.mark.clause("GGUF-GROUPS-1")
def test_a_q4_0_zero_of_a_negative_scale_is_minus_zero_in_the_block_plus_zero_as_a_group():
    codes = bytes([0x88] * 16)  # every code 8: d · (8 − 8)
    data = torch.tensor([list(np.float16(-2.0).tobytes() + codes)], dtype=torch.uint8)
    blocks = dequantize_gguf(data, "Q4_0", 32)
    groups = gguf_groups(data, "Q4_0", 32).dequantize()
    assert torch.equal(blocks, groups)
    assert torch.signbit(blocks).all() and not torch.signbit(groups).any()


@pytest.mark.clause("GGUF-GROUPS-1", "GGUF-Q6K-1", "GGUF-FLOAT-1")
@pytest.mark.parametrize("type_name", NOT_GROUPS)
def test_types_that_are_not_groups_raise_naming_the_type(type_name):
    raw = random_blocks(type_name, rows=2, blocks=1, seed=0, zeros=0.0)
    with pytest.raises(ValueError, match=type_name):
        gguf_groups(torch.from_numpy(raw), type_name, columns_of(type_name, 1))


# ------------------------------------------------------------------ validation

Q8_ROW = torch.zeros(2, 34, dtype=torch.uint8)  # two rows of one Q8_0 block
BAD_ARGUMENTS = [
    pytest.param(dict(data=Q8_ROW.numpy()), "data", ArgumentTypeError, id="numpy"),
    pytest.param(dict(data=Q8_ROW.tolist()), "data", ArgumentTypeError, id="list"),
    pytest.param(dict(data=Q8_ROW.to(torch.int8)), "data", ValueError, id="int8"),
    pytest.param(dict(data=Q8_ROW.to(torch.float32)), "data", ValueError, id="float32"),
    pytest.param(dict(data=Q8_ROW[0]), "data", ValueError, id="1-D"),
    pytest.param(dict(data=Q8_ROW[None]), "data", ValueError, id="3-D"),
    pytest.param(dict(type_name="Q5_0"), "type_name", ValueError, id="unsupported-type"),
    pytest.param(dict(type_name="q8_0"), "type_name", ValueError, id="lower-case"),
    pytest.param(dict(type_name=8), "type_name", ValueError, id="type-not-str"),
    pytest.param(dict(columns=33), "columns", ValueError, id="not-a-multiple"),
    pytest.param(dict(columns=0), "columns", ValueError, id="zero"),
    pytest.param(dict(columns=-32), "columns", ValueError, id="negative"),
    pytest.param(dict(columns=32.0), "columns", ValueError, id="float"),
    pytest.param(dict(columns=True), "columns", ValueError, id="bool"),
    pytest.param(
        dict(data=torch.zeros(2, 4, dtype=torch.uint8), type_name="F32", columns=True),
        "columns",
        ValueError,
        id="bool-F32",
    ),
    pytest.param(dict(columns=64), "row_bytes", ValueError, id="row-too-short"),
    pytest.param(dict(data=Q8_ROW[:, :33]), "row_bytes", ValueError, id="row-bytes-off"),
]


@pytest.mark.clause("GGUF-VALID-1")
@pytest.mark.parametrize("function", [dequantize_gguf, gguf_groups])
@pytest.mark.parametrize(("change", "name", "error"), BAD_ARGUMENTS)
def test_bad_arguments_raise_naming_the_argument(function, change, name, error):
    arguments = {"data": Q8_ROW, "type_name": "Q8_0", "columns": 32, **change}
    with pytest.raises(error, match=name) as raised:
        function(**arguments)
    if error is ValueError:
        assert not isinstance(raised.value, TypeError)


@pytest.mark.clause("GGUF-VALID-1")
def test_row_bytes_are_checked_against_each_types_block_size():
    for type_name, (block_size, block_bytes) in BLOCK_TYPES.items():
        good = torch.zeros(1, 2 * block_bytes, dtype=torch.uint8)
        assert dequantize_gguf(good, type_name, 2 * block_size).shape == (1, 2 * block_size)
        with pytest.raises(ValueError, match="row_bytes"):
            dequantize_gguf(good[:, 1:], type_name, 2 * block_size)
        if block_size > 1:
            with pytest.raises(ValueError, match="columns"):
                dequantize_gguf(good, type_name, block_size + 1)
