"""The browser the tests drive: the system's Chromium through Playwright's sync API.

Shared by the documentation's browser test (`tests/docs/test_browser.py`) and
the viewer's (`tests/serve/test_viewer.py`, `tests/serve/viewer_screenshot.py`).
The browser is Debian's Chromium (`apt-get install -y chromium`; `make test`
installs it), never one Playwright downloads; DECODESPEC_CHROMIUM names another
executable. Without it a test fails, it is never skipped.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from playwright.sync_api import Browser

CHROMIUM = Path(os.environ.get("DECODESPEC_CHROMIUM", "/usr/bin/chromium"))

# Headless (Playwright adds --headless) and quiet: on a closed network Chromium's
# background services would try connections and fail. Playwright's launch gives
# every browser a fresh temporary --user-data-dir of its own.
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

# A rendered page with text has antialiased glyphs, so many colours; a blank or
# flat page has one or two.
MIN_DISTINCT_COLOURS = 16


def missing_chromium_message(executable: Path) -> str:
    """Why a browser test cannot run, and how to fix it."""
    return (
        f"Chromium not found at {executable}. The browser tests need Debian's Chromium:\n"
        "    sudo apt-get install -y chromium\n"
        "(`make test` installs it; DECODESPEC_CHROMIUM names another executable.)"
    )


@contextlib.contextmanager
def chromium() -> Iterator[Browser]:
    """Headless Chromium from the system's executable (RuntimeError if there is none).

    While it is open, Playwright's sync API runs an asyncio loop in this thread:
    keep it no longer than the tests that need it (a module, not a session), or
    every later `asyncio.run` in the process fails.
    """
    if not CHROMIUM.is_file():
        raise RuntimeError(missing_chromium_message(CHROMIUM))
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_FLAGS
        )
        try:
            yield browser
        finally:
            browser.close()


@contextlib.contextmanager
def browser_for_test() -> Iterator[Browser]:
    """`chromium()` for a fixture: a missing Chromium or Playwright fails the test."""
    if not CHROMIUM.is_file():
        pytest.fail(missing_chromium_message(CHROMIUM), pytrace=False)
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        pytest.fail("The browser tests need Playwright: pip install -e '.[docs]'", pytrace=False)
    with chromium() as browser:
        yield browser


def distinct_colours(png: bytes, limit: int) -> int:
    """How many colours the PNG image has, counting up to `limit`."""
    from PIL import Image

    with Image.open(io.BytesIO(png)) as image:
        colours = image.convert("RGB").getcolors(maxcolors=limit)
    return limit if colours is None else len(colours)
