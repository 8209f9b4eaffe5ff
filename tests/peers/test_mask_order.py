"""Mask first (the spec) against llama.cpp's chain first, on real grammars and the real
vocabulary (tests/peers/mask_order.py)."""

from __future__ import annotations

import pytest

from tests.peers.child import PeerProcess

CASES = {
    "top-k 5, the 5 largest allowed",
    "top-k 5, the 5 largest disallowed",
    "top-p 0.55, the nucleus allowed, disallowed mass below it",
    "top-p 0.7, a disallowed token inside the nucleus",
}


def compare_in_a_fresh_process() -> dict:
    """`mask_order.compare()` run as `make peers` runs it, in a process of its own
    (tests/peers/child.py: a crash of llama.cpp fails this test, naming it).

    In a long-lived test worker, after some hundreds of other tests (engines,
    servers, Triton kernels in the interpreter, other llama.cpp contexts),
    llama.cpp's logits for the bundled model came back NaN at most tokens; each
    file run alone before it did not do it, and the state responsible was not
    found. A fresh process is what the committed matrix was measured in.
    """
    with PeerProcess("tests.peers.mask_order", peer="llama.cpp") as mask_order:
        return mask_order.compare()


@pytest.fixture(scope="module")
def report() -> dict:
    return compare_in_a_fresh_process()


def _rows(report: dict):
    for grammar in report["grammars"]:
        for step in grammar["steps"]:
            yield grammar["name"], step["prefix"], step["model_logits"]
        for case in grammar["constructed"]:
            yield grammar["name"], case["case"], case


def test_llama_cpp_and_xgrammar_allow_the_same_tokens(report):
    """The same GBNF text in both libraries allows the same tokens at every state of the
    text, the finished grammar only the end-of-generation tokens."""
    for grammar in report["grammars"]:
        assert len(grammar["steps"]) == len(grammar["tokens"]) + 1
        for step in grammar["steps"]:
            assert step["equal"], (grammar["name"], step)
            assert 0 < step["xgrammar_allowed"] < report["vocab_size"], step
        assert grammar["steps"][-1]["xgrammar_allowed"] == len(report["end_of_generation"])


def test_both_orders_return_only_allowed_tokens_and_resampling_is_mask_first(report):
    """Whatever the order, only allowed tokens come out; and when llama.cpp's chain kept a
    token its grammar rejects, its second pass (grammar, then chain) reaches every token
    the spec's mask-first filters keep."""
    for name, where, row in _rows(report):
        mask_first, chain_first = set(row["mask_first"]), set(row["chain_first"])
        assert mask_first and chain_first, (name, where)
        assert row["chain_raw_allowed"] <= row["chain_raw_kept"]
        assert row["resamples"] == (row["chain_raw_allowed"] < row["chain_raw_kept"])
        if row["resamples"]:
            assert mask_first <= chain_first, (name, where)
        else:
            assert len(chain_first) == row["chain_raw_kept"], (name, where)


def test_the_orders_differ_only_where_top_p_sees_disallowed_mass(report):
    """Top-k with its k largest allowed keeps the same tokens either way, and with them
    all disallowed llama.cpp always resamples (mask first). Top-p differs: with the
    nucleus allowed and disallowed mass below it, llama.cpp keeps the raw nucleus, while
    the mask renormalizes the allowed mass and the spec's nucleus shrinks to one token."""
    for grammar in report["grammars"]:
        cases = {case["case"]: case for case in grammar["constructed"]}
        assert set(cases) == CASES
        allowed = cases["top-k 5, the 5 largest allowed"]
        assert allowed["same"] and not allowed["resamples"] and len(allowed["mask_first"]) == 5
        disallowed = cases["top-k 5, the 5 largest disallowed"]
        assert disallowed["same"] and disallowed["resamples"]
        assert disallowed["chain_raw_allowed"] == 0
        shrunk = cases["top-p 0.55, the nucleus allowed, disallowed mass below it"]
        assert not shrunk["same"] and not shrunk["resamples"]
        assert len(shrunk["mask_first"]) == 1 and len(shrunk["chain_first"]) == 2
        assert set(shrunk["mask_first"]) < set(shrunk["chain_first"])
        inside = cases["top-p 0.7, a disallowed token inside the nucleus"]
        assert inside["resamples"] and inside["same"]
