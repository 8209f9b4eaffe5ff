"""The conformance tests can fail: each broken implementation is caught."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BOUNDARIES = "test_sampling_boundaries.py"

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
    "token_mask_bits_reversed": "test_token_mask.py::test_each_bit_allows_its_own_token",
    "token_mask_padding_columns_kept": (
        "test_token_mask.py::test_columns_past_the_bitmask_are_disallowed"
    ),
    "sample_masks_after_the_filters": (
        "test_masked_sampling.py::test_a_single_allowed_token_is_chosen_whatever_the_filters"
    ),
    "quant_linear_nibbles_swapped": "test_quantized_linear.py::test_low_nibble_is_the_even_element",
    "quant_linear_offsets_ignored": (
        "test_quantized_linear.py::test_matches_the_definition_in_float64"
    ),
}
# Mutants only the boundary families (tests/strategies.py) catch: every other
# conformance test of their operations passes them.
BOUNDARY_MUTANTS = {
    "greedy_chunks_last_tie": BOUNDARIES
    + "::test_greedy_ties_across_chunks_go_to_the_smallest_index",
    "top_k_ties_in_first_chunk": BOUNDARIES
    + "::test_top_k_keeps_ties_at_the_boundary_in_every_chunk",
    "top_p_ties_in_first_chunk": BOUNDARIES
    + "::test_top_p_keeps_the_tied_crossing_tokens_in_every_chunk",
    "min_p_chunk_maximum": BOUNDARIES
    + "::test_min_p_measures_every_chunk_against_the_rows_maximum",
    "logprobs_chunks_later_tie": BOUNDARIES + "::test_top_logprobs_order_ties_across_chunks_by_id",
    "top_p_at_most": BOUNDARIES + "::test_top_p_drops_a_token_whose_mass_above_equals_p",
    "min_p_strict": BOUNDARIES + "::test_min_p_keeps_a_token_exactly_at_the_threshold",
    "attention_tiles_unscaled": "test_attention.py::test_rows_over_many_kv_tiles_match_spec",
    "attention_splits_averaged": "test_attention.py::test_rows_over_split_keys_match_spec",
}
CAUGHT_BY.update(BOUNDARY_MUTANTS)
# Mutants whose every failure must be an assertion (the clean-failures family): a
# stray write or a missing token is reported, not met with a crash deep in a test.
CLEAN_FAILURE_MUTANTS = {
    "append_writes_padding": "test_append_kv.py",
    # a store outside the cache: caught by the guard blocks around each cache
    "append_kernel_writes_padding": "test_append_kv.py::test_append_writes_exactly_the_named_slots",
    "verify_drops_the_bonus": "test_speculative.py",
}


def run_conformance(mutant: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HYPOTHESIS_PROFILE": "mutants"}
    return subprocess.run(
        [sys.executable, "-m", "pytest", *args, "-q", "-p", "no:cacheprovider",
         f"--impl=tests.mutants.{mutant}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


@pytest.mark.parametrize("mutant", sorted(CAUGHT_BY))
def test_conformance_suite_catches(mutant):
    run = run_conformance(mutant, f"tests/conformance/{CAUGHT_BY[mutant]}")
    # exit code 1: tests ran and some failed (not a usage error, not "no tests")
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    assert "failed" in run.stdout
    # and the failure report carries a copy-paste reproduction
    assert f"from tests.mutants.{mutant} import" in run.stdout


@pytest.mark.parametrize("mutant", sorted(BOUNDARY_MUTANTS))
def test_only_the_boundary_strategies_catch(mutant):
    """The suite without the tests marked `boundary` accepts the mutant."""
    run = run_conformance(mutant, "tests/conformance", "-m", "not boundary")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    passed = int(re.search(r"(\d+) passed", run.stdout).group(1))
    assert passed >= 2, run.stdout[-2000:]  # the operation's own tests ran, and passed


@pytest.mark.parametrize("mutant", sorted(CLEAN_FAILURE_MUTANTS))
def test_failures_are_assertions_not_crashes(mutant):
    run = run_conformance(mutant, f"tests/conformance/{CLEAN_FAILURE_MUTANTS[mutant]}")
    assert run.returncode == 1 and "failed" in run.stdout, run.stdout[-3000:]
    # pytest shows a failed assert as "E   assert ..." or "E   AssertionError: ...";
    # anything else raised (IndexError, RuntimeError, ...) is a crash.
    raised = re.findall(r"^E +(\w+(?:Error|Exception))\b", run.stdout, flags=re.MULTILINE)
    assert set(raised) <= {"AssertionError"}, sorted(set(raised))
