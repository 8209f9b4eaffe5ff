"""Compile the kernels for a Hopper GPU (sm_90) on a machine without one.

The Triton interpreter runs kernels as NumPy: it accepts code that the GPU
compiler rejects (a plain Python global read inside a kernel, say) and never
shows shared-memory or register limits. This script runs the public wrappers
on CPU tensors with every launch intercepted: instead of running, each
launch is compiled ahead of time, with the exact arguments, constexprs and
launch options the wrapper chose, for `GPUTarget("cuda", 90, 32)` (ptxas
ships with the triton wheel). It prints one JSON line per launch, with the
shared memory, and the registers per thread and spilled bytes that ptxas
reports for the PTX (`ptxas -v`).

    python -m tests.kernels.compile_for_gpu

Must run without TRITON_INTERPRET (the kernels must be JIT functions).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time

import torch

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("compile_for_gpu: unset TRITON_INTERPRET (the kernels must be JIT functions)")

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from decodespec import kernels
from tests.conformance.test_attention import build_case

TARGET = GPUTarget("cuda", 90, 32)
SHARED_MEMORY_LIMIT = 232_448  # bytes per block on an H100 (227 KiB, opt-in)
POINTER_TYPES = {
    torch.float16: "*fp16",
    torch.bfloat16: "*bf16",
    torch.float32: "*fp32",
    torch.float64: "*fp64",
    torch.int32: "*i32",
    torch.int64: "*i64",
    torch.int8: "*i8",
    torch.uint8: "*u8",
    torch.bool: "*i1",
}
LAUNCH_OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion")


def scalar_type(value: object) -> str:
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__}")


def register_report(ptx: str) -> dict:
    """Registers per thread and spilled bytes of a kernel's PTX, as ptxas reports them."""
    with tempfile.TemporaryDirectory() as folder:
        source = os.path.join(folder, "kernel.ptx")
        with open(source, "w") as file:
            file.write(ptx)
        arch = f"sm_{TARGET.arch}a"
        run = subprocess.run(
            [get_ptxas(TARGET.arch).path, "-v", "--gpu-name", arch, source, "-o", os.devnull],
            capture_output=True,
            text=True,
            check=True,
        )
    report = run.stdout + run.stderr
    registers = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    return {
        "registers": int(registers.group(1)),
        "spill_bytes": int(spills.group(1)) + int(spills.group(2)),
    }


def compile_launch(function: JITFunction, args: tuple, kwargs: dict) -> dict:
    """Compile one launch for TARGET; its name, constexprs and resource use."""
    options = {k: kwargs[k] for k in LAUNCH_OPTIONS if k in kwargs}
    constexprs = {k: v for k, v in kwargs.items() if k not in LAUNCH_OPTIONS}
    signature = {}
    for name, value in zip(function.arg_names, args, strict=False):
        if isinstance(value, torch.Tensor):
            signature[name] = POINTER_TYPES[value.dtype]
        else:
            signature[name] = scalar_type(value)
    for name in constexprs:
        signature[name] = "constexpr"
    keys = {(function.arg_names.index(name),): value for name, value in constexprs.items()}
    start = time.perf_counter()
    compiled = triton.compile(
        ASTSource(function, signature, constexprs=keys), target=TARGET, options=options
    )
    return {
        "kernel": function.__name__,
        "first_pointer": next(t for t in signature.values() if t.startswith("*")),
        "constexprs": {k: str(v) for k, v in constexprs.items()},
        "shared_bytes": compiled.metadata.shared,
        "fits": compiled.metadata.shared <= SHARED_MEMORY_LIMIT,
        **register_report(compiled.asm["ptx"]),
        "compile_s": round(time.perf_counter() - start, 2),
    }


def intercept_launches() -> list[dict]:
    """Make every `kernel[grid](...)` compile for TARGET instead of running."""
    compiled: list[dict] = []

    def getitem(self: JITFunction, grid: object):
        def launch(*args: object, **kwargs: object) -> None:
            compiled.append(compile_launch(self, args, kwargs))
            print(json.dumps(compiled[-1]), flush=True)

        return launch

    JITFunction.__getitem__ = getitem
    kernels.checks.INTERPRET = True  # CPU tensors stand in for GPU ones
    return compiled


def attention_calls() -> None:
    """The configurations the attention wrapper can choose (a batch with a prefill chunk
    launches both tile shapes: 16-row tiles for short sequences, 64-row for the others)."""
    cases = [
        # (shapes, kv heads, group, head dim, block size, dtype, index dtype, splits)
        ([(40, 1), (9, 1)], 8, 4, 128, 16, torch.bfloat16, torch.int32, None),  # decode
        ([(40, 1), (9, 1)], 8, 4, 128, 16, torch.bfloat16, torch.int32, 4),  # split-KV
        ([(30, 20), (9, 1)], 3, 3, 64, 16, torch.bfloat16, torch.int64, None),  # SmolLM2 prefill
        ([(300, 200), (9, 1)], 8, 4, 128, 16, torch.bfloat16, torch.int32, None),  # 8B prefill
        ([(30, 1)], 2, 8, 256, 1, torch.float16, torch.int32, None),
        ([(30, 20)], 2, 8, 256, 3, torch.float16, torch.int32, 2),
        ([(30, 20)], 1, 1, 80, 16, torch.float32, torch.int32, None),
        ([(30, 20)], 2, 2, 96, 16, torch.float64, torch.int64, 3),
    ]
    for shapes, kv_heads, group, head_dim, block_size, dtype, index, splits in cases:
        case = build_case(
            shapes,
            num_kv_heads=kv_heads,
            group=group,
            head_dim=head_dim,
            block_size=block_size,
            dtype=dtype,
            seed=0,
            index_dtype=index,
        )
        kernels.paged_attention(*case.args, return_lse=True, num_splits=splits)


def append_calls() -> None:
    for dtype in (torch.bfloat16, torch.float64):
        k_cache = torch.zeros(4, 16, 8, 128, dtype=dtype)
        key = torch.randn(3, 8, 128)
        slots = torch.tensor([0, -1, 17])
        kernels.append_kv(key, key, k_cache, k_cache.clone(), slots)


def sampling_calls() -> None:
    """Every stage of the sampling kernel, its process_logits mode, and logprobs."""
    batch, vocab = 2, 3000  # more than one chunk of the vocabulary
    logits = torch.randn(batch, vocab, dtype=torch.bfloat16)
    full = {
        "temperature": torch.tensor([0.0, 0.8]),
        "top_k": torch.tensor([0, 50]),
        "top_p": torch.tensor([1.0, 0.9]),
        "min_p": torch.tensor([0.0, 0.05]),
        "step": torch.tensor([0, 3]),
        "logit_bias": torch.zeros(batch, vocab),
        "stop_token_mask": torch.zeros(batch, vocab, dtype=torch.bool),
        "min_tokens": torch.tensor([0, 2]),
        "prompt_mask": torch.zeros(batch, vocab, dtype=torch.bool),
        "output_counts": torch.zeros(batch, vocab, dtype=torch.int32),
        "repetition_penalty": torch.ones(batch),
        "frequency_penalty": torch.zeros(batch),
        "presence_penalty": torch.zeros(batch),
        # A grammar's mask, wider than ceil(vocab / 32) words and strided: the launch
        # with the bitmask on, at its own row stride.
        "token_bitmask": torch.full((batch, 2 * vocab // 32 + 2), -1, dtype=torch.int32)[
            :, : vocab // 32 + 2
        ],
    }
    # The launch is intercepted: the token and scratch buffers are never written, so
    # the wrappers' invalid-row checks read garbage. Only the launches matter here.
    for call in (
        lambda: kernels.sample(logits, seed=torch.tensor([1, 2]), **full),
        lambda: kernels.sample(logits.float(), temperature=full["temperature"], seed=full["step"]),
        lambda: kernels.process_logits(logits, **full),
        lambda: kernels.compute_logprobs(logits, torch.tensor([0, 1]), 5),
        lambda: kernels.top_p_mask(logits, full["top_p"]),
        lambda: kernels.uniform(torch.tensor([1, 2]), full["step"], vocab, stream=2**31 + 5),
    ):
        try:
            call()
        except ValueError:
            pass


def verification_calls() -> None:
    """The verification of speculative drafts, sampled and greedy rows together."""
    batch, k, vocab = 2, 3, 3000
    probs = torch.softmax(torch.randn(batch, k + 1, vocab), dim=-1)
    kernels.verify_drafts(
        torch.zeros(batch, k, dtype=torch.int64),
        probs[:, :k],
        probs,
        torch.tensor([3, 1]),
        temperature=torch.tensor([1.0, 0.0]),
        seed=torch.tensor([1, 2]),
        step=torch.tensor([0, 5]),
    )


def quantized_linear_calls() -> None:
    """The quantized linear's GEMV (decode) and GEMM (prefill), each unsplit and split
    (CPU tensors take the interpreter's policy, which splits small grids)."""
    for m, n, k in ((1, 4096, 1024), (1, 64, 4096), (64, 4096, 1024), (16, 64, 4096)):
        x = torch.randn(m, k, dtype=torch.bfloat16)
        q = torch.zeros(n, k // 2, dtype=torch.uint8)
        s = torch.ones(n, k // 32, dtype=torch.float16)
        kernels.quantized_linear(x, q, s, s, group_size=32, bits=4)


def main() -> int:
    compiled = intercept_launches()
    attention_calls()
    append_calls()
    sampling_calls()
    verification_calls()
    quantized_linear_calls()
    too_large = [c for c in compiled if not c["fits"]]
    if too_large:
        print(f"shared memory over {SHARED_MEMORY_LIMIT} bytes: {too_large}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
