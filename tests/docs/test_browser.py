"""The built site in a real headless browser: Debian's Chromium, driven by Playwright.

The site that `mkdocs build --strict` writes (the `built_site` fixture) is
served on a free localhost port, and for the home page, a stage page and the
performance page the test checks that the page answers 200, renders (a
screenshot that is not one flat colour, text in the content area), logs no
console error, has no request that fails or answers >= 400, and that every
image on it has loaded.

The browser is the system's Chromium (`apt-get install -y chromium`; `make test`
installs it), never one Playwright downloads. DECODESPEC_CHROMIUM names
another executable. Without it the test fails, it is never skipped.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.browser import MIN_DISTINCT_COLOURS, browser_for_test, distinct_colours

if TYPE_CHECKING:
    from playwright.sync_api import Browser, ConsoleMessage, Page, Request, Response

# The pages the issue names: the home page, one stage page, the performance page.
PAGES = {
    "home": "/",
    "stage": "/stages/sampling/",
    "performance": "/performance/",
}

# The pages whose figures the issue asks to see load: each has at least one image.
PAGES_WITH_FIGURES = {"home", "performance"}

PAGE_TIMEOUT_MS = 30_000
IMAGE_TIMEOUT_MS = 10_000

# Waits for every <img> (lazy ones made eager) to load or fail, then returns
# how many images the page has and the sources of those that have no pixels.
IMAGES_JS = """
async (timeoutMs) => {
  const images = Array.from(document.images);
  images.forEach((image) => { image.loading = "eager"; });
  const settled = (image) => image.complete ? null : new Promise((resolve) => {
    image.addEventListener("load", resolve, { once: true });
    image.addEventListener("error", resolve, { once: true });
  });
  const timeout = new Promise((resolve) => setTimeout(resolve, timeoutMs));
  await Promise.race([Promise.all(images.map(settled)), timeout]);
  const broken = images
    .filter((image) => !image.complete || image.naturalWidth === 0)
    .map((image) => image.currentSrc || image.src);
  return { count: images.length, broken };
}
"""

# The text of the theme's content area, or "" where the page has none.
CONTENT_TEXT_JS = '() => (document.querySelector(".md-content")?.innerText ?? "").trim()'


class QuietHandler(SimpleHTTPRequestHandler):
    """Serves files like `python -m http.server`, without a log line per request."""

    def log_message(self, format: str, *args: object) -> None:
        """Drop the access log."""


@pytest.fixture(scope="module")
def site_url(built_site: Path) -> Iterator[str]:
    """The built site served on a free localhost port, as its base URL (no trailing slash)."""
    handler = functools.partial(QuietHandler, directory=str(built_site))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    """Headless Chromium, launched from the system's executable.

    First in the test's arguments, so that a missing Chromium is reported
    before the site is built; module-scoped (see `tests.browser.chromium`).
    """
    with browser_for_test() as browser:
        yield browser


def record_problems(page: Page) -> list[str]:
    """A list that fills with the page's console errors, script errors and failed requests."""
    problems: list[str] = []

    def on_console(message: ConsoleMessage) -> None:
        if message.type == "error":
            problems.append(f"console error: {message.text} ({message.location})")

    def on_response(response: Response) -> None:
        if response.status >= 400:
            problems.append(f"HTTP {response.status}: {response.url}")

    def on_request_failed(request: Request) -> None:
        problems.append(f"request failed: {request.url} ({request.failure})")

    def on_page_error(error: Exception) -> None:
        problems.append(f"script error: {error}")

    page.on("console", on_console)
    page.on("response", on_response)
    page.on("requestfailed", on_request_failed)
    page.on("pageerror", on_page_error)
    return problems


@pytest.mark.parametrize(("name", "path"), PAGES.items(), ids=PAGES.keys())
def test_page_renders_in_chromium(
    browser: Browser,
    site_url: str,
    name: str,
    path: str,
    tmp_path_factory: pytest.TempPathFactory,
):
    """The page answers 200, renders, logs no error, and every image on it loads."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    try:
        page = context.new_page()
        page.set_default_timeout(PAGE_TIMEOUT_MS)
        problems = record_problems(page)

        response = page.goto(site_url + path, wait_until="load")
        assert response is not None and response.status == 200, (
            f"{path}: {response.status if response else 'no response'}"
        )
        page.wait_for_load_state("networkidle")

        images = page.evaluate(IMAGES_JS, IMAGE_TIMEOUT_MS)
        assert images["broken"] == [], f"{path}: images that did not load: {images['broken']}"
        if name in PAGES_WITH_FIGURES:
            assert images["count"] > 0, f"{path}: no figure (<img>) on the page"

        content_text = page.evaluate(CONTENT_TEXT_JS)
        assert content_text, f"{path}: no text in the content area (.md-content) of the theme"

        screenshot = tmp_path_factory.mktemp("screenshots") / f"{name}.png"
        png = page.screenshot(path=screenshot, full_page=True)
        assert png, f"{path}: empty screenshot"
        colours = distinct_colours(png, limit=MIN_DISTINCT_COLOURS)
        assert colours >= MIN_DISTINCT_COLOURS, (
            f"{path}: the screenshot {screenshot} has only {colours} colours (a blank page?)"
        )

        assert problems == [], f"{path}:\n" + "\n".join(problems)
    finally:
        context.close()
