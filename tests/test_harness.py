"""The conformance harness itself: --impl, missing operations, unsupported features,
known failures and the clause report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.strategies import BOUNDARY_FAMILIES

ROOT = Path(__file__).resolve().parent.parent
SOFTMAX_TESTS = "tests/conformance/test_softmax_logits.py"


def run_suite(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HYPOTHESIS_PROFILE": "ci"}
    env.pop("DECODESPEC_IMPL", None)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rs", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_explicit_impl_skips_missing_operations_and_unsupported_features(tmp_path):
    report = tmp_path / "report.json"
    run = run_suite(
        SOFTMAX_TESTS,
        "--impl=tests.mutants.partial_bfloat16_unsupported",
        f"--report={report}",
    )
    assert run.returncode == 0, run.stdout[-3000:]
    assert "missing operations (skipped): log_softmax" in run.stdout
    assert "does not provide operation apply_temperature" in run.stdout
    assert "does not support bfloat16: this implementation has no bfloat16 path" in run.stdout
    data = json.loads(report.read_text())
    assert data["implementation"]["name"] == "tests.mutants.partial_bfloat16_unsupported"
    assert "softmax" not in data["missing_operations"]
    assert data["self_checked_operations"] == []
    outcomes = {t["nodeid"]: t["outcome"] for t in data["clauses"]["SOFTMAX-STABLE-1"]["tests"]}
    assert outcomes[f"{SOFTMAX_TESTS}::test_softmax_matches_reference"] == "passed"
    temperature = data["clauses"]["SOFTMAX-TEMP-1"]["tests"]
    assert {t["outcome"] for t in temperature} == {"skipped"}
    assert data["clauses"]["STOP-ID-1"]["tests"] == []  # not collected in this run


def test_default_impl_self_checks_and_reports_missing_kernels():
    run = run_suite(SOFTMAX_TESTS, "-k", "softmax_matches_reference")
    assert run.returncode == 0, run.stdout[-3000:]
    assert "decodespec implementation under test: decodespec.kernels" in run.stdout
    assert "missing operations (run as a self-check of the spec): softmax" in run.stdout


def test_xfails_file_marks_known_failures(tmp_path):
    failing = (
        "tests/conformance/test_sampling.py::test_top_k_keeps_every_token_tied_at_the_boundary"
    )
    xfails = tmp_path / "xfails.txt"
    xfails.write_text(f"{failing}  # keeps exactly k, on purpose\n")
    report = tmp_path / "report.json"
    run = run_suite(
        failing,
        "--impl=tests.mutants.top_k_exactly_k",
        f"--xfails={xfails}",
        f"--report={report}",
    )
    assert run.returncode == 0, run.stdout[-3000:]
    assert "1 xfailed" in run.stdout
    tests = json.loads(report.read_text())["clauses"]["SAMPLE-TOPK-2"]["tests"]
    assert {t["nodeid"]: t["outcome"] for t in tests}[failing] == "xfailed"


def test_unknown_impl_is_a_usage_error():
    run = run_suite(SOFTMAX_TESTS, "--impl=no_such_module_here")
    assert run.returncode == 4
    assert "cannot import" in run.stderr


def test_report_lists_the_boundary_families_each_clause_draws(tmp_path):
    report = tmp_path / "report.json"
    run = run_suite(
        "tests/conformance/test_sampling_boundaries.py",
        "tests/conformance/test_sampling.py",
        "-k",
        "greedy",
        f"--report={report}",
    )
    assert run.returncode == 0, run.stdout[-3000:]
    data = json.loads(report.read_text())
    assert data["boundary_families"] == BOUNDARY_FAMILIES
    greedy = data["clauses"]["SAMPLE-GREEDY-1"]
    assert greedy["boundaries"] == ["ties-across-chunks"]
    marked = {t["nodeid"]: t.get("boundaries", []) for t in greedy["tests"]}
    assert any(f == ["ties-across-chunks"] for f in marked.values())
    assert any(f == [] for f in marked.values())  # the plain random tests draw none
    assert data["clauses"]["SAMPLE-TOPK-1"]["boundaries"] == []
