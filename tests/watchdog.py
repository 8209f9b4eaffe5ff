"""The last guard against a hung test: a watchdog that ends the process.

pytest-timeout (pyproject.toml: `timeout`, the signal method) fails a test that
runs too long by raising in it, which needs the test to come back to Python: a
test stuck inside C code (a native peer, a deadlocked thread pool) never does.
So each test also arms faulthandler's watchdog, a C thread: a little after the
test's timeout it prints every thread's stack to the real stderr and exits the
process. Under pytest-xdist that is a crashed worker, and the run ends at once
with its summary (`--max-worker-restart=0`): a hang is never a suite that waits.
"""

from __future__ import annotations

import faulthandler
import os
from collections.abc import Iterator

import pytest

_STDERR: list[int] = []  # a copy of the process's stderr, taken in pytest_configure


def pytest_configure(config: pytest.Config) -> None:
    """Keep a copy of file descriptor 2 while it is the terminal's (pytest captures it
    during each test; its faulthandler plugin does the same for a crash's report)."""
    _STDERR.append(os.dup(2))


def pytest_unconfigure(config: pytest.Config) -> None:
    while _STDERR:
        os.close(_STDERR.pop())


def watchdog_s(timeout_s: float) -> float:
    """When the watchdog fires, for a test whose timeout is `timeout_s`: late enough
    that pytest-timeout fails a test that can be failed, and reports it."""
    return timeout_s * 1.1 + 5.0


def test_timeout_s(item: pytest.Item) -> float | None:
    """The test's timeout as pytest-timeout reads it: its marker, else the ini value."""
    marker = item.get_closest_marker("timeout")
    if marker is not None and marker.args:
        return float(marker.args[0]) or None
    try:
        value = item.config.getini("timeout")
    except ValueError:  # pytest-timeout is not installed
        return None
    return float(value) if value else None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    timeout_s = test_timeout_s(item)
    if timeout_s and _STDERR:
        faulthandler.dump_traceback_later(watchdog_s(timeout_s), exit=True, file=_STDERR[0])
    try:
        yield
    finally:
        if timeout_s and _STDERR:
            faulthandler.cancel_dump_traceback_later()
