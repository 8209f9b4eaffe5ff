"""The stage pages' "Differs from" notes against the committed peer matrix.

A note the runs contradict (its engine's runs check its clauses and pass
them) or do not support (its engine ran, but nothing checks its clauses),
or a disagreement a run found (an xfail or fail cell) that no note of that
engine and clause mentions, fails here: the hand-written differences and the
measured ones cannot drift apart. Notes on engines that need a GPU stay
unchecked on a CPU machine, and the stage pages say so.
"""

from __future__ import annotations

import pytest

from docs.hooks import spec_pages
from docs.tools import peers

MATRIX = peers.load()
CPU_PEERS = (
    "transformers",
    "PyTorch SDPA",
    "PyTorch FlexAttention",
    "llama.cpp",
    "xgrammar CPU",
    "llguidance numpy",
)


@pytest.mark.parametrize("note", spec_pages.peer_notes(), ids=lambda n: f"{n.engine}-{n.clauses}")
def test_every_note_is_confirmed_by_a_run_or_waits_for_its_engine(note):
    assert note.clauses, f"the note names no clause: {note.text}"
    verdict, runs = peers.note_check(note, MATRIX)
    assert verdict in ("confirmed", "unchecked"), f"{note.engine}: {note.text}\n{verdict}: {runs}"


def test_every_disagreement_a_run_found_has_a_note():
    missing = peers.unexplained(MATRIX, spec_pages.peer_notes())
    assert not missing, "no stage page mentions:\n" + "\n".join(missing)


def test_the_committed_matrix_has_the_cpu_peers_and_no_unrecorded_failure():
    columns = MATRIX["peers"]
    for name in CPU_PEERS:
        assert columns[name]["ran"], f"{name} did not run: {columns[name].get('why')}"
    for name, column in columns.items():
        for clause_id, cell in column["clauses"].items():
            assert cell["status"] in ("pass", "xfail", "skip"), (name, clause_id, cell)
            assert cell["status"] == "pass" or cell.get("why"), (name, clause_id, cell)
        if not column["ran"]:
            assert column["why"], name


def test_a_contradicted_note_and_an_unnoted_disagreement_are_caught():
    matrix = {
        "peers": {
            "x": {
                "engine": "llama.cpp",
                "ran": True,
                "clauses": {"SAMPLE-TOPK-2": {"status": "pass"}},
            },
            "y": {
                "engine": "vLLM",
                "ran": True,
                "clauses": {"SAMPLE-TOPP-2": {"status": "xfail", "why": "cuts ties"}},
            },
        }
    }
    note = peers.Note("llama.cpp", ("SAMPLE-TOPK-2",), "keeps exactly k")
    assert peers.note_check(note, matrix)[0] == "contradicted"
    elsewhere = peers.Note("vLLM", ("SAMPLE-TOPK-2",), "a clause its run does not check")
    assert peers.note_check(elsewhere, matrix)[0] == "unsupported"
    matrix["peers"]["z"] = {"engine": "FlashInfer", "ran": False, "why": "needs CUDA"}
    matrix["peers"]["z"]["clauses"] = {}
    gpu_only = peers.Note("FlashInfer", ("SAMPLE-TOPK-2",), "t")
    assert peers.note_check(gpu_only, matrix) == ("unchecked", "z: needs CUDA")
    assert peers.unexplained(matrix, [note]) == ["y xfails SAMPLE-TOPP-2: cuts ties"]


def test_the_peers_page_shows_the_matrix(built_site):
    page = (built_site / "peers" / "index.html").read_text()
    for name in CPU_PEERS:
        assert name in page
    assert "peer-note-1" in page and 'href="../stages/sampling/#sample-topp-2"' in page
    loop = MATRIX["peers"]["llama.cpp"]["loop"]
    assert f"llama.cpp {loop['tokens_per_s']['llama_cpp']:.1f} tokens/s" in page
    assert f"this engine {loop['tokens_per_s']['ours']:.1f} tokens/s" in page
    for grammar in MATRIX["mask_order"]["grammars"]:
        assert grammar["constructed"][0]["case"] in page
