"""A stand-in for a native peer that can die: what tests/peers/test_child.py and
tests/test_crash_containment.py call to see a crash, a hang and an error contained,
on any CPU (a real llama.cpp dies of SIGILL only where it was built wrongly)."""

from __future__ import annotations

import os
import signal
import time

import torch

NAME = "stand-in"


def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a + b


def pid() -> int:
    return os.getpid()


def die(signal_name: str) -> None:
    """End this process by `signal_name` ("SIGILL", "SIGSEGV"), as a native fault does
    (faulthandler, where it is on, prints the Python stack first, as it would then)."""
    os.kill(os.getpid(), getattr(signal, signal_name))


def hang(seconds: float) -> None:
    time.sleep(seconds)


def refuse(message: str) -> None:
    raise ValueError(message)
