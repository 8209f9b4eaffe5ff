"""A native peer in a child process (tests/peers/child.py): its crash, hang or error is
one call's exception, named, and the next call gets a fresh child."""

from __future__ import annotations

import time

import pytest
import torch

from tests.peers.child import PeerCrashed, PeerProcess, PeerTimeout, death


@pytest.fixture(scope="module")
def peer():
    with PeerProcess("tests.peers.standin_peer", peer="stand-in", timeout_s=60) as process:
        yield process


def test_calls_and_values_cross_the_pipe(peer):
    out = peer.add(torch.tensor([1.0, 2.0]), torch.tensor([0.5, 0.25]))
    assert torch.equal(out, torch.tensor([1.5, 2.25]))
    assert peer.NAME == "stand-in"
    assert peer.pid() == peer.pid() != __import__("os").getpid()  # one child, not us


@pytest.mark.parametrize(
    ("signal_name", "words"), [("SIGILL", "illegal instruction"), ("SIGSEGV", "segmentation")]
)
def test_a_crash_is_an_exception_naming_the_peer_and_the_signal(peer, signal_name, words):
    first = peer.pid()
    start = time.monotonic()
    with pytest.raises(PeerCrashed) as caught:
        peer.die(signal_name)
    assert time.monotonic() - start < 30
    message = str(caught.value)
    assert message.startswith(f"stand-in died of {signal_name} ({words}")
    assert "tests.peers.standin_peer die()" in message
    # the next call runs in a fresh child
    assert peer.pid() != first
    assert torch.equal(peer.add(torch.ones(1), torch.ones(1)), torch.full((1,), 2.0))


def test_a_hang_is_killed_at_the_timeout():
    with PeerProcess("tests.peers.standin_peer", peer="stand-in", timeout_s=2) as peer:
        first = peer.pid()
        start = time.monotonic()
        with pytest.raises(PeerTimeout, match=r"stand-in: tests.peers.standin_peer hang\(\)"):
            peer.hang(600)
        assert time.monotonic() - start < 30
        assert peer.pid() != first


def test_an_error_in_the_peer_is_raised_as_it_was(peer):
    with pytest.raises(ValueError, match="no such token"):
        peer.refuse("no such token")
    assert peer.NAME == "stand-in"  # the child lives on


def test_a_module_that_does_not_import_is_an_import_error():
    """Each call says so again (a fresh child each time), not a broken pipe."""
    with PeerProcess("tests.peers.no_such_peer", peer="nothing") as peer:
        for _ in range(2):
            with pytest.raises(ModuleNotFoundError, match="no_such_peer"):
                peer.anything()


def test_death_names_signals_and_exit_statuses():
    assert death(-4) == "SIGILL (illegal instruction)"
    assert death(-11).startswith("SIGSEGV (segmentation fault")
    assert death(3) == "exit status 3"
