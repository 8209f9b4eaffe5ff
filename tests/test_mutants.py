"""The conformance tests can fail: each broken implementation is caught."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# mutant module -> the conformance tests that must catch it
CAUGHT_BY = {
    "top_k_exactly_k": "test_sampling.py::test_top_k_keeps_every_token_tied_at_the_boundary",
    "top_p_drops_crossing": "test_sampling.py::test_top_p_keeps_the_crossing_token",
    "greedy_last_index": "test_sampling.py::test_greedy_ties_go_to_the_smallest_index",
    "min_p_absolute": "test_sampling.py::test_min_p_matches_definition",
    "softmax_unshifted": "test_softmax_logits.py::test_softmax_never_overflows",
    "uniform_torch_rng": "test_sampling.py::test_uniform_is_bit_identical",
    "penalties_sign_blind": (
        "test_softmax_logits.py::test_repetition_penalty_discourages_whatever_the_sign"
    ),
}


@pytest.mark.parametrize("mutant", sorted(CAUGHT_BY))
def test_conformance_suite_catches(mutant):
    test = f"tests/conformance/{CAUGHT_BY[mutant]}"
    env = {**os.environ, "HYPOTHESIS_PROFILE": "ci"}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            test,
            "-q",
            "-p",
            "no:cacheprovider",
            f"--impl=tests.mutants.{mutant}",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    # exit code 1: tests ran and some failed (not a usage error, not "no tests")
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    assert "failed" in run.stdout
    # and the failure report carries a copy-paste reproduction
    assert f"from tests.mutants.{mutant} import" in run.stdout
