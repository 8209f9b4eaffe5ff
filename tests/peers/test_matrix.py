"""`make peers` on this machine: the committed matrix is what a run gives.

A whole run takes minutes (every CPU peer's conformance suite, about 7 on 2
cores), so the suite checks it in parts that together leave nothing out:

- the matrix was written from the sources here now: every file a cell can
  depend on (the spec, the conformance suite and its harness, the adapters
  and their xfails, the hypothesis profiles) is hashed into it, and the
  peers' packages are the versions it names. The `ci` profile is
  derandomized, so the same sources against the same packages give the same
  cells;
- one column is run again here and equals its committed one, so a run does
  reproduce (the runner, the derandomized suite, the cell rules);
- the llama.cpp loop is run again on every committed prompt: its tokenizer
  still agrees with this engine's, prompt by prompt, as committed;
- the mask-order comparison is run again: its grammar states and constructed
  cases (which depend on no model arithmetic) are the committed ones.
"""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys

import pytest

from tests.peers import run
from tests.peers.child import PeerProcess

COMMITTED = json.loads(run.RESULTS.read_text())
CPU_PEERS = (
    "transformers",
    "transformers eager attention",
    "transformers SDPA attention",
    "PyTorch SDPA",
    "PyTorch FlexAttention",
    "llama.cpp",
    "xgrammar CPU",
    "xgrammar torch",
    "llguidance numpy",
    "llguidance torch",
)
RERUN = "PyTorch SDPA"  # the quickest column (attention only, torch only)
STALE = "the matrix's sources changed: run `make peers` and commit results/peers.json"


def test_the_committed_matrix_was_run_from_these_sources():
    committed, now = COMMITTED["sources"], run.sources()
    changed = sorted(p for p in committed.keys() & now.keys() if committed[p] != now[p])
    added, removed = sorted(now.keys() - committed.keys()), sorted(committed.keys() - now.keys())
    assert not (changed or added or removed), (
        f"{STALE}\nchanged: {changed}\nnew: {added}\nremoved: {removed}"
    )
    assert COMMITTED["hypothesis_profile"] == "ci", COMMITTED["hypothesis_profile"]


def test_the_hashed_sources_hold_what_a_cell_depends_on():
    hashed = run.sources()
    for path in [*run.ROOT.glob("tests/conformance/test_*.py"), *run.HERE.glob("*.xfails")]:
        assert path.relative_to(run.ROOT).as_posix() in hashed, path
    for name in ("spec/sampling.py", "tests/conftest.py", "tests/strategies.py"):
        assert name in hashed, name
    assert not any(p.startswith("tests/peers/test_") for p in hashed)


@pytest.mark.parametrize("name", CPU_PEERS)
def test_the_committed_matrix_ran_the_installed_peer(name):
    column = COMMITTED["peers"][name]
    assert column["ran"], f"{name}: {column['why']}"
    installed = importlib.metadata.version(column["package"])
    assert installed == column["version"], (
        f"{name}: {column['package']} {installed} is installed, the matrix ran "
        f"{column['version']}: run `make peers` and commit results/peers.json"
    )


def test_every_disagreement_is_recorded():
    fails = {
        name: [c for c, cell in column["clauses"].items() if cell["status"] == "fail"]
        for name, column in COMMITTED["peers"].items()
    }
    assert not any(fails.values()), fails


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("peers") / "peers.json"
    done = subprocess.run(
        [sys.executable, "-m", "tests.peers.run", "--out", str(out), "--only", RERUN],
        cwd=run.ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0 and out.exists(), done.stdout + done.stderr
    return json.loads(out.read_text())


def test_a_column_run_again_is_the_committed_one(fresh):
    now, committed = fresh["peers"][RERUN], COMMITTED["peers"][RERUN]
    assert now["ran"], now["why"]
    assert now["clauses"] == committed["clauses"], STALE
    assert fresh["sources"] == run.sources()


def test_llama_cpp_tokenizes_the_prompts_as_this_engine_does():
    committed = COMMITTED["peers"]["llama.cpp"]["loop"]["prompts"]
    with PeerProcess("tests.peers.llama_cpp_loop", peer="llama.cpp") as peer:
        loop = peer.compare_loop([row["prompt"] for row in committed], max_tokens=1)
    assert len(loop["prompts"]) == len(committed)
    for now, then in zip(loop["prompts"], committed, strict=True):
        assert now["tokenizer_equal"] == then["tokenizer_equal"], now


def test_the_mask_order_comparison_is_the_committed_one():
    from tests.peers.test_mask_order import compare_in_a_fresh_process

    now, committed = compare_in_a_fresh_process(), COMMITTED["mask_order"]
    for fresh, then in zip(now["grammars"], committed["grammars"], strict=True):
        assert fresh["constructed"] == then["constructed"], fresh["name"]
        keys = ("prefix", "llama_cpp_allowed", "xgrammar_allowed", "equal")
        for a, b in zip(fresh["steps"], then["steps"], strict=True):
            assert {k: a[k] for k in keys} == {k: b[k] for k in keys}


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
