"""The Determinism page's tables come from the committed `results/determinism*.json`."""

from __future__ import annotations

import json

from docs.tools import determinism

PAGE = (determinism.ROOT / "docs" / "determinism.md").read_text()


def run(server: str, bitwise: int, cost: dict | None = None) -> dict:
    phase = {"requests": 16, "same_tokens": 16, "bitwise": bitwise, "max_logprob_difference": 0}
    return {"server": server, "command": "cmd", "phases": {"together": phase}, "cost": cost}


def test_the_page_has_both_markers_and_the_hook_fills_them():
    assert determinism.TABLE_MARKER in PAGE and determinism.COST_MARKER in PAGE
    filled = determinism.fill(PAGE)
    assert "{{" not in filled


def test_each_committed_run_is_a_row_per_phase(tmp_path):
    cost = {
        "weights": "float32",
        "tokens_per_s": {
            "1 streams": 10.0,
            "1 streams, batch-invariant": 5.0,
            "16 streams": 60.0,
            "16 streams, batch-invariant": 45.0,
        },
    }
    (tmp_path / determinism.FILES[0]).write_text(json.dumps(run("ours", 3, cost)))
    (tmp_path / determinism.FILES[1]).write_text(json.dumps(run("ours, invariant", 16)))
    filled = determinism.fill(PAGE, tmp_path)
    assert "| `ours` | together | 16/16 | 3/16 | 0 |" in filled
    assert "| `ours, invariant` | together | 16/16 | 16/16 | 0 |" in filled
    assert "| float32 | 1 | 10.0 | 5.0 | 0.50x |" in filled
    assert "| float32 | 16 | 60.0 | 45.0 | 0.75x |" in filled


def test_without_results_the_page_says_how_to_measure(tmp_path):
    filled = determinism.fill(PAGE, tmp_path)
    assert "Not measured yet: run `make bench-determinism`" in filled


def test_the_invariance_matrix_has_ours_first_and_each_peer_that_ran(tmp_path):
    assert determinism.MATRIX_MARKER in PAGE
    matrix = {
        "ours": {
            "decodespec kernels": {
                "ran": True,
                "clauses": {
                    "ATTN-INVARIANT-1": {"status": "pass"},
                    "SAMPLE-INVARIANT-1": {"status": "fail", "why": "row 0 differs"},
                },
            }
        },
        "peers": {
            "flex": {
                "ran": True,
                "clauses": {
                    "ATTN-INVARIANT-1": {"status": "xfail", "why": "pads the batch"},
                    "SAMPLE-INVARIANT-1": {"status": "skip", "why": "no operation sample"},
                },
            },
            "gpu only": {"ran": False, "clauses": {}},
            "grammar only": {"ran": True, "clauses": {"SAMPLE-INVARIANT-1": {"status": "skip"}}},
        },
    }
    (tmp_path / "peers.json").write_text(json.dumps(matrix))
    filled = determinism.fill(PAGE, tmp_path)
    assert "| decodespec kernels | ✅ pass | ❌ fail: row 0 differs | not run |" in filled
    assert "| flex | ❌ differs: pads the batch | — | not run |" in filled
    assert filled.index("decodespec kernels") < filled.index("| flex |")
    assert "| gpu only |" not in filled and "| grammar only |" not in filled


def test_without_a_matrix_the_page_says_how_to_make_it(tmp_path):
    assert "Not run yet: `make peers`." in determinism.fill(PAGE, tmp_path)
