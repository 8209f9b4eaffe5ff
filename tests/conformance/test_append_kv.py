"""Conformance: appending new tokens' keys and values to a paged KV cache.

The caches are filled with poison (random values, NaN and ±inf: what earlier
steps left behind) and set between guard blocks, so that a write to a slot not
named, to the slot of a padding row (−1), or just outside either cache shows as
a failed assertion. Every write is compared bit for bit with the spec's
`append_kv` on a copy. The guard blocks and the sizes are shared with the
attention tests (tests/conformance/test_attention.py), whose decode loop
appends then attends.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from decodespec.spec import registry
from tests.conformance.test_attention import (
    BLOCK_SIZES,
    CACHES,
    HEAD_DIMS,
    INDEX_DTYPES,
    MAX_KV_HEADS,
    MAX_Q_LEN,
    OTHER_DEVICE,
    _set,
    _with,
    assert_guards_untouched,
    bits,
    guard_bits,
    poison,
    require_dtype,
    with_guard_blocks,
)
from tests.strategies import DEVICE, FLOAT_DTYPES, LARGE

APPEND = registry.OPERATIONS["append_kv"]


def poisoned_cache(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A poisoned cache with guard blocks around it (`with_guard_blocks`)."""
    return with_guard_blocks(poison(shape, dtype, seed), seed + 10**6)


@st.composite
def append_cases(draw: st.DrawFn, dtype: torch.dtype) -> dict:
    num_blocks = draw(st.integers(1, 64 if LARGE else 8))
    block_size = draw(st.sampled_from(BLOCK_SIZES))
    num_kv_heads = draw(st.integers(1, MAX_KV_HEADS))
    head_dim = draw(st.sampled_from(HEAD_DIMS))
    num_slots = num_blocks * block_size
    num_tokens = draw(st.integers(0, min(num_slots, 2 * MAX_Q_LEN) + 3))
    seed = draw(st.integers(0, 2**32 - 1))
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_slots, generator=g)[:num_tokens]
    slots = torch.cat([slots, torch.full((max(0, num_tokens - num_slots),), -1)])
    skip = torch.rand(num_tokens, generator=g) < draw(st.sampled_from((0.0, 0.3, 1.0)))
    slots = slots.masked_fill(skip, -1)
    key_dtype = draw(st.sampled_from((dtype, torch.float32)))
    shape = (num_tokens, num_kv_heads, head_dim)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    index_dtype = draw(st.sampled_from(INDEX_DTYPES))
    return {
        "key": torch.randn(shape, generator=g).to(key_dtype).to(DEVICE),
        "value": torch.randn(shape, generator=g).to(key_dtype).to(DEVICE),
        "k_cache": poisoned_cache(cache_shape, dtype, seed + 1),
        "v_cache": poisoned_cache(cache_shape, dtype, seed + 2),
        "slot_mapping": slots.to(index_dtype).to(DEVICE),
    }


def clone_args(args: dict) -> dict:
    return {k: v.clone() for k, v in args.items()}


@pytest.mark.clause("APPEND-SLOT-1", "APPEND-SKIP-1", "APPEND-STATE-1")
@pytest.mark.boundary("clean-failures")
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@given(data=st.data())
def test_append_writes_exactly_the_named_slots(impl, dtype, data):
    require_dtype(impl, dtype)
    args = data.draw(append_cases(dtype))
    before = clone_args(args)
    guards = guard_bits(args)
    expected = clone_args(args)
    APPEND.reference(**expected)  # the spec on a copy
    assert impl.op("append_kv")(**args) is None
    assert_guards_untouched(args, guards)
    block_size = args["k_cache"].shape[1]
    slots = args["slot_mapping"].long()
    targets = torch.zeros(args["k_cache"].shape[:2], dtype=torch.bool, device=DEVICE)
    kept = slots >= 0
    targets[slots[kept] // block_size, slots[kept] % block_size] = True
    for cache, rows in (("k_cache", "key"), ("v_cache", "value")):
        got = args[cache]
        # every slot not named keeps its bits, NaN and inf included
        assert torch.equal(bits(got[~targets]), bits(before[cache][~targets])), cache
        # every named slot holds its row, cast to the cache's dtype
        written = got[slots[kept] // block_size, slots[kept] % block_size]
        assert torch.equal(bits(written), bits(before[rows][kept].to(dtype))), cache
        assert torch.equal(bits(got), bits(expected[cache])), f"{cache} differs from the spec"
    for name in ("key", "value", "slot_mapping"):
        assert torch.equal(args[name], before[name]), f"{name} was modified"


@pytest.mark.clause("APPEND-STATE-1")
def test_append_works_in_place(impl):
    k_cache = poisoned_cache((3, 4, 2, 64), torch.float32, 0)
    v_cache = poisoned_cache((3, 4, 2, 64), torch.float32, 1)
    pointers = (k_cache.data_ptr(), v_cache.data_ptr())
    guards = guard_bits({"k_cache": k_cache, "v_cache": v_cache})
    key = torch.randn(2, 2, 64, device=DEVICE)
    result = impl.op("append_kv")(key, -key, k_cache, v_cache, torch.tensor([6, 11], device=DEVICE))
    assert result is None
    assert_guards_untouched({"k_cache": k_cache, "v_cache": v_cache}, guards)
    assert (k_cache.data_ptr(), v_cache.data_ptr()) == pointers
    assert torch.equal(k_cache[1, 2], key[0]) and torch.equal(k_cache[2, 3], key[1])
    assert torch.equal(v_cache[1, 2], -key[0]) and torch.equal(v_cache[2, 3], -key[1])


@pytest.mark.clause("APPEND-SKIP-1")
@pytest.mark.boundary("clean-failures")
@pytest.mark.parametrize("num_tokens", [0, 1, 5])
def test_append_of_padding_only_changes_nothing(impl, num_tokens):
    k_cache = poisoned_cache((2, 4, 1, 64), torch.float16, 2)
    v_cache = poisoned_cache((2, 4, 1, 64), torch.float16, 3)
    before = (k_cache.clone(), v_cache.clone())
    guards = guard_bits({"k_cache": k_cache, "v_cache": v_cache})
    key = torch.randn(num_tokens, 1, 64, device=DEVICE)
    slots = torch.full((num_tokens,), -1, dtype=torch.int32, device=DEVICE)
    impl.op("append_kv")(key, key, k_cache, v_cache, slots)
    assert_guards_untouched({"k_cache": k_cache, "v_cache": v_cache}, guards)
    assert torch.equal(bits(k_cache), bits(before[0]))
    assert torch.equal(bits(v_cache), bits(before[1]))


@pytest.mark.clause("APPEND-SLOT-1")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_append_rounds_to_nearest_even(impl, dtype):
    """float32 rows halfway between two cache values: ties go to the even one."""
    require_dtype(impl, dtype)
    ulp = torch.finfo(dtype).eps  # the spacing of the dtype's values in [1, 2)
    # 1 + ulp/2 rounds down to 1, 1 + 3 ulp/2 rounds up to 1 + 2 ulp; truncation
    # gives 1 and 1 + ulp. Random values fill the rest of the row.
    key = torch.randn(2, 1, 64)
    key[0, 0, :2] = torch.tensor([1 + ulp / 2, 1 + 3 * ulp / 2])
    key[1, 0, :2] = torch.tensor([-(1 + 3 * ulp / 2), 3.0 + 1e-4])
    key = key.to(DEVICE)
    k_cache = poisoned_cache((1, 2, 1, 64), dtype, 4)
    v_cache = poisoned_cache((1, 2, 1, 64), dtype, 5)
    guards = guard_bits({"k_cache": k_cache, "v_cache": v_cache})
    impl.op("append_kv")(key, key, k_cache, v_cache, torch.tensor([1, 0], device=DEVICE))
    assert_guards_untouched({"k_cache": k_cache, "v_cache": v_cache}, guards)
    assert torch.equal(bits(k_cache[0, 1]), bits(key[0].to(dtype)))
    assert torch.equal(bits(v_cache[0, 0]), bits(key[1].to(dtype)))
    assert k_cache[0, 1, 0, 1].item() == 1 + 2 * ulp


def valid_append_args() -> dict:
    return {
        "key": torch.randn(3, 2, 16, device=DEVICE),
        "value": torch.randn(3, 2, 16, device=DEVICE),
        "k_cache": poisoned_cache((4, 2, 2, 16), torch.float32, 6),
        "v_cache": poisoned_cache((4, 2, 2, 16), torch.float32, 7),
        "slot_mapping": torch.tensor([5, -1, 0], device=DEVICE),
    }


APPEND_ERRORS = {
    "slot past the end": (r"\bslot_mapping\b", _set("slot_mapping", 0, 8)),
    "slot below -1": (r"\bslot_mapping\b", _set("slot_mapping", 1, -2)),
    "duplicate slot": (r"\bslot_mapping\b", _set("slot_mapping", 2, 5)),
    "slot_mapping float": (
        r"\bslot_mapping\b",
        _with(slot_mapping=lambda a: a["slot_mapping"].float()),
    ),
    "slot_mapping length": (
        r"\bslot_mapping\b",
        _with(slot_mapping=lambda a: a["slot_mapping"][:2]),
    ),
    "key 2-D": (r"\bkey\b", _with(key=lambda a: a["key"][:, 0])),
    "key heads": (r"\bkey\b", _with(key=lambda a: a["key"][:, :1])),
    "key integer": (r"\bkey\b", _with(key=lambda a: a["key"].to(torch.int32))),
    "value tokens": (r"\bvalue\b", _with(value=lambda a: a["value"][:2])),
    "v_cache shape": (r"\bv_cache\b", _with(v_cache=lambda a: a["v_cache"][:, :1])),
    "v_cache dtype": (r"\bv_cache\b", _with(v_cache=lambda a: a["v_cache"].half())),
    "k_cache integer": (r"\bk_cache\b", _with(k_cache=lambda a: a["k_cache"].to(torch.int32))),
}


@pytest.mark.clause("APPEND-VALID-1")
@pytest.mark.parametrize("mistake", sorted(APPEND_ERRORS))
def test_append_rejects_invalid_arguments_and_writes_nothing(impl, mistake):
    pattern, change = APPEND_ERRORS[mistake]
    args = change(valid_append_args())
    before = clone_args(args)
    with pytest.raises(ValueError, match=pattern):
        impl.op("append_kv")(**args)
    for cache in ("k_cache", "v_cache"):
        if args[cache].dtype.is_floating_point:
            assert torch.equal(bits(args[cache]), bits(before[cache])), f"{cache} was written"


@pytest.mark.clause("APPEND-VALID-1", "APPEND-SKIP-1")
def test_append_accepts_repeated_skips(impl):
    args = valid_append_args()
    args["slot_mapping"] = torch.tensor([-1, -1, 7], device=DEVICE)
    guards = guard_bits(args)
    impl.op("append_kv")(**args)
    assert_guards_untouched(args, guards)
    assert torch.equal(args["k_cache"][3, 1], args["key"][2])


@pytest.mark.clause("APPEND-VALID-1")
@pytest.mark.parametrize("name", ["key", "value", "slot_mapping"])
def test_append_rejects_tensors_on_another_device(impl, name):
    args = valid_append_args()
    args[name] = args[name].to(OTHER_DEVICE)
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        impl.op("append_kv")(**args)


@pytest.mark.clause("APPEND-VALID-1")
@pytest.mark.parametrize("kind", ["float", "list"])
@pytest.mark.parametrize("name", ["key", "value", "k_cache", "v_cache", "slot_mapping"])
def test_append_names_an_argument_that_is_not_a_tensor(impl, name, kind):
    args = valid_append_args()
    before = clone_args(args)
    args[name] = 1.5 if kind == "float" else args[name].tolist()
    with pytest.raises(TypeError, match=rf"\b{name}\b"):
        impl.op("append_kv")(**args)
    for cache in CACHES:
        if cache != name:
            assert torch.equal(bits(args[cache]), bits(before[cache])), f"{cache} was written"
