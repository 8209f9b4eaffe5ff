"""The Determinism page's tables come from the committed `results/determinism*.json`."""

from __future__ import annotations

import json

from docs.tools import determinism

PAGE = (determinism.ROOT / "docs" / "determinism.md").read_text()


def run(server: str, bitwise: int) -> dict:
    phase = {"requests": 16, "same_tokens": 16, "bitwise": bitwise, "max_logprob_difference": 0}
    return {"server": server, "command": "cmd", "phases": {"together": phase}}


def test_the_page_has_both_markers_and_the_hook_fills_them():
    assert determinism.TABLE_MARKER in PAGE and determinism.COST_MARKER in PAGE
    assert determinism.MODE_COST_MARKER in PAGE
    filled = determinism.fill(PAGE)
    assert "{{" not in filled


def test_each_committed_run_is_a_row_per_phase(tmp_path):
    (tmp_path / determinism.FILES[0]).write_text(json.dumps(run("ours", 16)))
    (tmp_path / determinism.FILES[2]).write_text(json.dumps(run("llama-server", 3)))
    filled = determinism.fill(PAGE, tmp_path)
    assert "| `ours` | together | 16/16 | 16/16 | 0 |" in filled
    assert "| `llama-server` | together | 16/16 | 3/16 | 0 |" in filled
    assert filled.index("`ours`") < filled.index("`llama-server`")


def test_the_cost_table_has_before_and_after_per_format_and_measure(tmp_path):
    side = {"decode, 1 stream (tokens/s)": 80.0, "prefill, 500 tokens (s)": 1.0}
    cost = {
        "machine": "AMD EPYC",
        "rounds": 3,
        "before": "aaa",
        "after": "bbb",
        "formats": {
            "auto": {
                "before": side,
                "after": {"decode, 1 stream (tokens/s)": 76.0, "prefill, 500 tokens (s)": 1.25},
                "after_relative": {
                    "decode, 1 stream (tokens/s)": 0.95,
                    "prefill, 500 tokens (s)": 0.8,
                },
            }
        },
    }
    (tmp_path / determinism.COST_FILE).write_text(json.dumps(cost))
    filled = determinism.fill(PAGE, tmp_path)
    assert "| int4 (the file's) | decode, 1 stream (tokens/s) | 80.00 | 76.00 | 0.95x |" in filled
    assert "| int4 (the file's) | prefill, 500 tokens (s) | 1.00 | 1.25 | 0.80x |" in filled
    assert "*AMD EPYC; medians of 3 interleaved rounds" in filled


def test_the_mode_cost_table_has_off_and_on_per_configuration_and_measure(tmp_path):
    cost = {
        "machine": "AMD EPYC",
        "rounds": 3,
        "configurations": {
            "spec, auto": {
                "off": {"decode, 1 stream (tokens/s)": 2.0, "prefill, 500 tokens (s)": 4.0},
                "mode": {"decode, 1 stream (tokens/s)": 1.6, "prefill, 500 tokens (s)": 12.0},
                "mode_relative": {
                    "decode, 1 stream (tokens/s)": 0.8,
                    "prefill, 500 tokens (s)": 0.333,
                },
            }
        },
    }
    (tmp_path / determinism.MODE_COST_FILE).write_text(json.dumps(cost))
    filled = determinism.fill(PAGE, tmp_path)
    row = "| spec, int4 (the file's) | prefill, 500 tokens (s) | 4.00 | 12.00 | 0.33x |"
    assert row in filled


def test_without_results_the_page_says_how_to_measure(tmp_path):
    filled = determinism.fill(PAGE, tmp_path)
    assert "Not measured yet: run `make bench-determinism`" in filled
    assert filled.count("Not measured yet: run `make bench-invariance`") == 2


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
