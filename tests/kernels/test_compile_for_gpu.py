"""The kernels compile for an H100 (sm_90) and fit its shared memory, without a GPU.

Runs tests/kernels/compile_for_gpu.py in a fresh process (the kernels must be
JIT functions there, not the interpreter's), which compiles every launch the
wrappers make for a set of configurations covering each dtype, split-KV and
split-K (merged in the launch), prefill tiles and head dims 64 to 256, and the
sampling kernels with every processor and filter on, and reports each launch's registers and spills.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@functools.cache
def compile_every_launch() -> list[dict]:
    """The script's report, one dict per launch (compiled once per test process)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # the default; set to silence Triton 3.9's notice
    run = subprocess.run(
        [sys.executable, "-m", "tests.kernels.compile_for_gpu"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return [json.loads(line) for line in run.stdout.splitlines()]


def test_every_launch_compiles_for_sm90_and_fits_shared_memory():
    launches = compile_every_launch()
    kernels = {launch["kernel"] for launch in launches}
    assert kernels == {
        "_paged_attention_kernel",
        "_append_kv_kernel",
        "_sample_kernel",
        "_logprobs_kernel",
        "_uniform_kernel",
        "_verify_kernel",
        "_quantized_gemv_kernel",
        "_quantized_gemm_kernel",
    }
    splits = {
        (launch["kernel"], launch["constexprs"]["SPLIT"])
        for launch in launches
        if launch["kernel"].startswith("_quantized")
    }
    assert len(splits) == 4  # both kernels, split and not
    assert all(launch["fits"] for launch in launches)
    computes = {launch["constexprs"].get("COMPUTE") for launch in launches}
    assert {"fp32", "fp64"} <= computes


def spills(launch: dict) -> str:
    return f"{launch['kernel']} {launch['constexprs']}: {launch['spill_bytes']} bytes"


def test_the_hot_paths_do_not_spill_registers():
    """ptxas's own report (`ptxas -v`) for sm_90: the decode step's launches (attention
    tiles of 16 rows over a bfloat16 or float16 cache, head_dim up to 128; the sampling,
    logprobs, verification and append kernels) keep everything in registers.
    Prefill tiles, head_dim 256, float32 and float64 caches still spill (the compile
    script prints how much)."""
    launches = compile_every_launch()
    hot = [
        launch
        for launch in launches
        if launch["kernel"] != "_paged_attention_kernel"
        or (
            launch["constexprs"]["ONE_TILE"] == "True"
            and launch["first_pointer"] in ("*bf16", "*fp16")
            and int(launch["constexprs"]["BLOCK_D"]) <= 128
        )
    ]
    assert len(hot) >= 13
    assert [spills(launch) for launch in hot if launch["spill_bytes"]] == []
