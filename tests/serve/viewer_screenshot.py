"""Drive the token-probability viewer (`GET /`) in the system's Chromium, and screenshot it.

    python -m tests.serve.viewer_screenshot docs/images/viewer.png

starts a `LiveServer` with the bundled model, chooses "Constrain to a JSON
Schema" (the page's example schema, in its box), generates an answer at
temperature 0.8 with a fixed seed, hovers a token so that its candidates
show, and saves a PNG of the page (1000×700). The functions here are the
steps `tests/serve/test_viewer.py` takes too: `open_viewer()`, `generate()`,
`hover_token()`, `capture()`. The browser is `tests.browser.chromium()`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

from tests.browser import chromium

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Locator, Page

VIEWPORT = {"width": 1000, "height": 700}
PROMPT = "Return a JSON object with the city Paris and its population."
SEED = 7
# The model does about 10 tokens/s on two CPU cores; a generation of a few
# dozen tokens finishes well inside this.
DONE_TIMEOUT_MS = 60_000

# True once the generation has ended: done, stopped or an error.
FINISHED_JS = """() => {
  const status = document.querySelector("#status");
  return status.textContent === "done" || status.textContent === "stopped"
    || status.classList.contains("error");
}"""

# The index of the least likely of the first `limit` tokens on the first `lines`
# lines of the answer: the most interesting one to hover, with room below for the panel.
PICK_TOKEN_JS = """([limit, lines]) => {
  const spans = Array.from(document.querySelectorAll("#output .token:not(.special)"));
  if (spans.length === 0) return -1;
  const top = spans[0].getBoundingClientRect().top;
  const lineHeight = parseFloat(getComputedStyle(document.querySelector("#output")).lineHeight);
  let best = 0;
  spans.slice(0, limit).forEach((span, i) => {
    const onTop = span.getBoundingClientRect().top - top < (lines - 0.5) * lineHeight;
    if (onTop && Number(span.dataset.prob) < Number(spans[best].dataset.prob)) best = i;
  });
  return Number(spans[best].dataset.index);
}"""


def open_viewer(page: Page, url: str) -> None:
    """Load the viewer and wait until it has the model's name (Generate enabled)."""
    response = page.goto(url.rstrip("/") + "/", wait_until="load")
    if response is None or response.status != 200:
        raise RuntimeError(f"GET {url}/: {response.status if response else 'no response'}")
    page.wait_for_selector("#generate:not([disabled])")


def fill(
    page: Page,
    prompt: str,
    *,
    temperature: float | str = 0.8,
    top_k: int | str = 0,
    top_p: float | str = 1.0,
    min_p: float | str = 0,
    max_tokens: int | str = 32,
    seed: int | str | None = None,
    mode: str = "processed",
    constraint: str | None = None,
    json_object: bool = False,
    schema: str | dict | None = None,
) -> None:
    """Set the prompt, the sampling parameters and the constraint in the form.

    `constraint` is the "Constrain to" option: "none", "json_object" or
    "json_schema"; `json_object=True` is short for "json_object", and a
    `schema` (JSON text, or a dict to write as JSON) for "json_schema" with that
    schema in the box. "json_schema" without a schema keeps the box's text.
    """
    page.fill("#prompt", prompt)
    page.fill("#temperature", str(temperature))
    page.fill("#top-k", str(top_k))
    page.fill("#top-p", str(top_p))
    page.fill("#min-p", str(min_p))
    page.fill("#max-tokens", str(max_tokens))
    page.fill("#seed", "" if seed is None else str(seed))
    page.select_option("#mode", mode)
    if constraint is None and schema is not None:
        constraint = "json_schema"
    elif constraint is None:
        constraint = "json_object" if json_object else "none"
    page.select_option("#constraint", constraint)
    if schema is not None:
        page.fill("#schema", schema if isinstance(schema, str) else json.dumps(schema))


def wait_finished(page: Page, timeout_ms: int = DONE_TIMEOUT_MS) -> str:
    """Wait for the generation to end; the text of `#status` ("done" or the error)."""
    page.wait_for_function(FINISHED_JS, timeout=timeout_ms)
    return page.inner_text("#status")


def generate(page: Page, prompt: str, timeout_ms: int = DONE_TIMEOUT_MS, **params: object) -> str:
    """Fill the form, press Generate and wait for the end; the text of `#status`."""
    fill(page, prompt, **params)  # type: ignore[arg-type]
    page.click("#generate")
    return wait_finished(page, timeout_ms)


def hover_token(page: Page, index: int | None = None) -> Locator:
    """Hover the token span `index` (None: an interesting one near the top) and
    wait for the candidates panel; the panel."""
    if index is None:
        index = page.evaluate(PICK_TOKEN_JS, [24, 2])
    page.hover(f'#output .token[data-index="{index}"]')
    panel = page.locator("#candidates")
    panel.wait_for(state="visible")
    return panel


def capture(
    url: str,
    path: Path,
    prompt: str = PROMPT,
    *,
    temperature: float = 0.8,
    top_k: int = 0,
    top_p: float = 0.95,
    min_p: float = 0,
    max_tokens: int = 40,
    seed: int | None = SEED,
    mode: str = "processed",
    constraint: str = "json_schema",
    schema: str | dict | None = None,
    hover: int | None = None,
    browser: Browser | None = None,
) -> bytes:
    """Generate an answer in the viewer at `url`, hover a token, and save a PNG at `path`.

    The answer is constrained as `constraint` says (see `fill`); by default to
    the JSON Schema in the page's box, shown open. Returns the PNG's bytes.
    Raises RuntimeError if the generation fails.
    """
    with contextlib.ExitStack() as stack:
        if browser is None:
            browser = stack.enter_context(chromium())
        context = browser.new_context(viewport=VIEWPORT)
        stack.callback(context.close)
        page = context.new_page()
        open_viewer(page, url)
        status = generate(
            page,
            prompt,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            max_tokens=max_tokens,
            seed=seed,
            mode=mode,
            constraint=constraint,
            schema=schema,
        )
        if status != "done":
            raise RuntimeError(f"the viewer's generation failed: {status}")
        hover_token(page, hover)
        path.parent.mkdir(parents=True, exist_ok=True)
        return page.screenshot(path=path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path, help="where to save the PNG")
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--hover", type=int, default=None, help="the token to hover (0-based)")
    args = parser.parse_args()

    from tests.serve.live import LiveServer

    with LiveServer() as server:
        capture(
            server.url,
            args.path,
            args.prompt,
            temperature=args.temperature,
            max_tokens=args.max_tokens,
            seed=args.seed,
            hover=args.hover,
        )
    print(f"wrote {args.path}")


if __name__ == "__main__":
    main()
