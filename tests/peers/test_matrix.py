"""`make peers` on this machine: the CPU peers run, and the committed matrix is what they give.

The run takes a few minutes (every CPU peer's conformance suite, and the
llama.cpp loop on the bundled model), so it runs once per session.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.peers import run

COMMITTED = json.loads(run.RESULTS.read_text())
CPU_PEERS = ("transformers", "PyTorch SDPA", "PyTorch FlexAttention", "llama.cpp")


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("peers") / "peers.json"
    done = subprocess.run(
        [sys.executable, "-m", "tests.peers.run", "--out", str(out)],
        cwd=run.ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert out.exists(), done.stdout + done.stderr
    return {
        "exit": done.returncode,
        "output": done.stdout + done.stderr,
        **json.loads(out.read_text()),
    }


def test_every_cpu_peer_runs_and_every_disagreement_is_recorded(fresh):
    for name in CPU_PEERS:
        assert fresh["peers"][name]["ran"], f"{name}: {fresh['peers'][name]['why']}"
    assert fresh["exit"] == 0, fresh["output"]


@pytest.mark.parametrize("name", [peer.name for peer in run.PEERS])
def test_the_committed_column_is_what_a_run_gives(fresh, name):
    now, committed = fresh["peers"][name], COMMITTED["peers"][name]
    assert now["ran"] == committed["ran"], (now.get("why"), committed.get("why"))
    status = {c: cell["status"] for c, cell in now["clauses"].items()}
    assert status == {c: cell["status"] for c, cell in committed["clauses"].items()}, (
        "the matrix changed: run `make peers` and commit results/peers.json"
    )


def test_llama_cpp_tokenizes_the_prompts_as_this_engine_does(fresh):
    loop = fresh["peers"]["llama.cpp"]["loop"]
    committed = COMMITTED["peers"]["llama.cpp"]["loop"]
    assert loop["prompts"] and len(loop["prompts"]) == len(committed["prompts"])
    for now, then in zip(loop["prompts"], committed["prompts"], strict=True):
        assert now["tokenizer_equal"] == then["tokenizer_equal"], now


def test_a_cell_says_why_it_is_not_a_pass():
    assert run.cell("C-1", [{"nodeid": "a::t", "outcome": "passed"}], "m", "M") == {
        "status": "pass"
    }
    failed = [{"nodeid": "a::t", "outcome": "failed", "message": "AssertionError: x"}]
    assert run.cell("C-1", failed, "m", "M") == {"status": "fail", "why": "t: AssertionError: x"}
    xfailed = [
        {"nodeid": "a::t", "outcome": "xfailed", "message": "SAMPLE-TOPK-2: keeps exactly k"},
        {"nodeid": "a::u", "outcome": "passed"},
    ]
    assert run.cell("SAMPLE-TOPK-2", xfailed, "m", "M") == {
        "status": "xfail",
        "why": "keeps exactly k",
    }
    assert run.cell("SAMPLE-TOPK-1", xfailed, "m", "M") == {"status": "pass"}
    skipped = [
        {"nodeid": "a::t", "outcome": "skipped", "message": "m does not provide operation f"}
    ]
    assert run.cell("C-1", skipped, "m", "M")["status"] == "skip"
