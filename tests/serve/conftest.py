"""The live server the serve tests share (one model load per session)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.serve.live import LiveServer


@pytest.fixture(scope="session")
def live_server() -> Iterator[LiveServer]:
    with LiveServer() as server:
        yield server
