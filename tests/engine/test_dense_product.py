"""The float32 projections of the torch backend (`cpu_linear.DenseLinear`, `native_dense.c`):
the matmul within float32's rounding, and each row of the result in one order fixed by
the weight's shape, so a row has the same bits alone, among any rows and on any number
of threads, with the AVX2 loops or the scalar ones (LOOP-INVARIANT-1 by construction,
issue 60). No premise about a BLAS: nothing here goes through one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from decodespec.reference import cpu_linear, native_library
from decodespec.reference.backend import prepare_for_torch
from decodespec.reference.engine import Engine
from decodespec.reference.weight_formats import describe
from tests.engine.toy import ByteTokenizer, random_weights, small_config

ROOT = Path(__file__).resolve().parents[2]


def dense(weight: torch.Tensor) -> cpu_linear.DenseLinear:
    return cpu_linear.DenseLinear(weight, native_library.library())


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 40),
    k=st.integers(1, 300),
    m=st.integers(1, 20),
    seed=st.integers(0, 2**16),
)
def test_the_dense_product_is_the_matmul(n, k, m, seed):
    """`linear(x)` is `x Wᵀ` within float32's rounding of a K-term sum (against float64),
    at every shape: K not a multiple of the 8 lanes, N not one of the 4-row tiles, M not
    one of the 3-row tiles."""
    g = torch.Generator().manual_seed(seed)
    weight, x = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g)
    actual = dense(weight).linear(x)
    expected = x.double() @ weight.double().T
    bound = 2 * k * torch.finfo(torch.float32).eps * (x.abs().double() @ weight.abs().double().T)
    reproduce = f"n={n} k={k} m={m} seed={seed}"
    assert actual.dtype == torch.float32 and actual.shape == (m, n), reproduce
    assert bool(((actual.double() - expected).abs() <= bound + 1e-30).all()), reproduce


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(1, 70),
    k=st.integers(1, 200),
    m=st.integers(2, 20),
    threads=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_a_rows_bits_are_its_own_at_any_row_count_and_thread_count(n, k, m, threads, seed):
    """Every row of a product of M rows has the bits it has alone, and in every slice of
    the rows, on 1, 2 or 3 threads (the tiles and the threads' shares of the weight rows
    change; the sums' order does not)."""
    g = torch.Generator().manual_seed(seed)
    weight, x = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g) * 5
    linear = dense(weight)
    before = torch.get_num_threads()
    try:
        whole = linear.linear(x)
        torch.set_num_threads(threads)
        reproduce = f"n={n} k={k} m={m} threads={threads} seed={seed}"
        for start, stop in [(0, 1), (m - 1, m), (1, m), (0, m // 2 + 1)]:
            assert torch.equal(linear.linear(x[start:stop]), whole[start:stop]), reproduce
        assert torch.equal(linear.linear(x), whole), reproduce
    finally:
        torch.set_num_threads(before)


def test_the_scalar_loops_give_the_avx2_loops_bits():
    """`DECODESPEC_NATIVE_ISA=scalar` (what a CPU without AVX2 and FMA runs) computes each
    lane with `fmaf`, which rounds once as the instruction does: the same bits as the AVX2
    loops, so a row's bits do not even depend on the instruction set."""
    code = (
        "import torch, hashlib\n"
        "from decodespec.reference import cpu_linear, native_library as n\n"
        "g = torch.Generator().manual_seed(0)\n"
        "w, x = torch.randn(37, 203, generator=g), torch.randn(11, 203, generator=g)\n"
        "y = cpu_linear.DenseLinear(w, n.library()).linear(x)\n"
        "print(n.library().dense_isa().decode(), hashlib.sha256(y.numpy().tobytes()).hexdigest())\n"
    )
    runs = {}
    for isa in ("scalar", None):
        env = {k: v for k, v in os.environ.items() if k != "DECODESPEC_NATIVE_ISA"}
        if isa:
            env["DECODESPEC_NATIVE_ISA"] = isa
        out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                             text=True, check=True, timeout=600).stdout.split()  # fmt: skip
        runs[out[0]] = out[1]
    assert "scalar" in runs
    if len(runs) == 1:  # this CPU has no AVX2: both runs took the scalar loops
        pytest.skip("this CPU runs the scalar loops only: nothing to compare them with")
    assert runs["scalar"] == runs["avx2"]


def test_a_float32_model_is_packed_on_the_dense_product_sharing_its_tensors():
    """`prepare_for_torch` puts a float32 model's projections on `DenseLinear` (Q/K/V and
    gate/up stacked, one call each), the tied output on the embedding itself (no copy);
    the model's description and size are unchanged."""
    weights = random_weights(small_config(), seed=1)
    packed = prepare_for_torch(weights)
    layer = packed.layers[0]
    assert isinstance(layer.q_proj.shared.kernel, cpu_linear.DenseLinear)
    assert layer.k_proj.shared is layer.q_proj.shared
    assert isinstance(layer.o_proj, cpu_linear.DenseLinear)
    assert isinstance(packed.output, cpu_linear.DenseLinear)
    if weights.output is weights.embedding:
        assert packed.output.unwrapped.data_ptr() == packed.embedding.data_ptr()
    assert describe(packed) == describe(weights)
    o_proj = weights.layers[0].o_proj
    x = torch.randn(3, o_proj.shape[1])
    assert torch.allclose(layer.o_proj.linear(x), x @ o_proj.T, atol=1e-5)


def test_the_default_engine_runs_float32_weights_on_its_native_step():
    """A float32 model on the default backend: every pass on the native step (a prompt
    longer than the step's pass in chunks), the path line saying so."""
    engine = Engine(random_weights(small_config()), ByteTokenizer(), backend="torch",
                    token_budget=None)  # fmt: skip
    assert engine.runner.native is not None and engine.batch_invariant
    assert engine.token_budget == engine.runner.native.max_tokens
    assert "float32 (C, one order a row" in engine.path and "native step (C" in engine.path
    assert "batch-invariant by construction" in engine.path
