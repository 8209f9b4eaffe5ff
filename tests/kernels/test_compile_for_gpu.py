"""The kernels compile for an H100 (sm_90) and fit its shared memory, without a GPU.

Runs tests/kernels/compile_for_gpu.py in a fresh process (the kernels must be
JIT functions there, not the interpreter's), which compiles every launch the
wrappers make for a set of configurations covering each dtype, the split-KV
merge, prefill tiles and head dims 64 to 256, and the sampling kernels with
every processor and filter on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_launch_compiles_for_sm90_and_fits_shared_memory():
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
    launches = [json.loads(line) for line in run.stdout.splitlines()]
    kernels = {launch["kernel"] for launch in launches}
    assert kernels == {
        "_paged_attention_kernel",
        "_merge_splits_kernel",
        "_append_kv_kernel",
        "_sample_kernel",
        "_logprobs_kernel",
        "_uniform_kernel",
        "_verify_kernel",
    }
    assert all(launch["fits"] for launch in launches)
    computes = {launch["constexprs"].get("COMPUTE") for launch in launches}
    assert {"fp32", "fp64"} <= computes
