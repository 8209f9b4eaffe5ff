"""The token-probability viewer (`GET /`) in a real browser, against the live server.

Debian's Chromium, driven by Playwright (never a browser Playwright downloads;
without Chromium the tests fail, they are not skipped), opens the page the
server serves, generates a greedy answer and checks that:

- the page asks nothing of any host but the server, and logs no console error;
- the answer streams in token by token (the count of token spans grows);
- the spans are the real tokens: their text is the text the server answers
  for the same request, not streamed;
- hovering a token shows its candidates, the chosen one marked, with its rank;
- TTFT and tokens/s show numbers, and the page renders (a screenshot with
  many colours);
- the body carries the sampling parameters the form sets, min_p among them;
- a bad parameter (top_p = 5, min_p = 2) shows the server's error, naming it, and
  marks its input;
- constrained to "any JSON object" the answer is the server's JSON object, and
  a token's candidates mark, in words, exactly the alternatives the server
  reports the grammar removed (`allowed: false`);
- constrained to "a JSON Schema" the page shows its schema box (prefilled with
  a strict schema), sends the schema as `response_format` `json_schema`, and
  the answer is the server's, valid under the schema, its removed alternatives
  marked the same way;
- a schema that is not JSON, or not an object, is said next to the box and
  nothing is sent; a schema the server refuses shows the server's message.

`tests/serve/viewer_screenshot.py` holds the steps (and makes the docs' picture).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest
from jsonschema import Draft202012Validator

from tests.browser import MIN_DISTINCT_COLOURS, browser_for_test, distinct_colours
from tests.serve.live import MODEL, LiveServer
from tests.serve.viewer_screenshot import (
    VIEWPORT,
    capture,
    generate,
    hover_token,
    open_viewer,
)

if TYPE_CHECKING:
    from playwright.sync_api import (
        Browser,
        BrowserContext,
        ConsoleMessage,
        Page,
        Request,
        Route,
    )

PROMPT = "Name three colours."
MAX_TOKENS = 12
# Greedy under the JSON grammar, the model answers this with a short object
# (about 18 tokens, finish "stop"); the model's own (raw) alternatives at most
# of its steps include tokens the grammar removed.
JSON_PROMPT = "Return a JSON object with the keys city and country for Paris."
JSON_MAX_TOKENS = 60
JSON_SEED = 7
# A strict schema (OpenAI's rules: every property required, no others). Greedy under
# it, the model answers this prompt with a short object (about 25 tokens, finish
# "stop").
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "population": {"type": "integer", "minimum": 0},
    },
    "required": ["city", "population"],
    "additionalProperties": False,
}
SCHEMA_PROMPT = "Return a JSON object with the city Paris and its population."
SCHEMA_MAX_TOKENS = 48
PAGE_TIMEOUT_MS = 30_000

# Records the number of token spans each time #output changes, until the status says done.
COUNT_TOKENS_JS = """() => {
  window.__tokenCounts = [];
  const output = document.querySelector("#output");
  const status = document.querySelector("#status");
  new MutationObserver(() => {
    if (status.textContent !== "done") {
      window.__tokenCounts.push(output.querySelectorAll(".token").length);
    }
  }).observe(output, { childList: true, subtree: true });
}"""


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    """The system's Chromium; the test fails (is not skipped) without it."""
    with browser_for_test() as launched:
        yield launched


@dataclass
class Viewer:
    """A page of a fresh browser context, with what went wrong on it."""

    page: Page
    context: BrowserContext
    problems: list[str] = field(default_factory=list)
    foreign: list[str] = field(default_factory=list)
    # The bodies of the chat requests the page sent, in order.
    chats: list[dict] = field(default_factory=list)


@pytest.fixture
def viewer(browser: Browser, live_server: LiveServer) -> Iterator[Viewer]:
    """A page whose requests may go to the live server only (others are aborted and
    recorded), and whose console errors, script errors and failed requests are recorded."""
    context = browser.new_context(viewport=VIEWPORT)
    page = context.new_page()
    page.set_default_timeout(PAGE_TIMEOUT_MS)
    seen = Viewer(page, context)

    def route(route: Route) -> None:
        url = route.request.url
        if url.startswith(live_server.url + "/"):
            route.continue_()
        else:
            seen.foreign.append(url)
            route.abort()

    def on_console(message: ConsoleMessage) -> None:
        if message.type == "error":
            seen.problems.append(f"console error: {message.text} ({message.location})")

    def on_request(request: Request) -> None:
        url = request.url
        if not url.startswith(live_server.url + "/") and not url.startswith("data:"):
            seen.foreign.append(url)
        if url == f"{live_server.url}/v1/chat/completions":
            seen.chats.append(request.post_data_json)

    context.route("**/*", route)
    page.on("request", on_request)
    page.on("console", on_console)
    page.on("pageerror", lambda error: seen.problems.append(f"script error: {error}"))
    page.on(
        "requestfailed",
        lambda request: seen.problems.append(f"request failed: {request.url} ({request.failure})"),
    )
    try:
        yield seen
    finally:
        context.close()


# The rows of a candidates list: probability, rendered text, and whether the token is
# struck through.
CANDIDATE_ROWS_JS = """list => Array.from(list.querySelectorAll(".candidate")).map(row => ({
  prob: Number(row.dataset.prob),
  text: row.innerText,
  struck: getComputedStyle(row.querySelector(".tok")).textDecorationLine.includes("line-through"),
}))"""


def server_choice(live_server: LiveServer, prompt: str, max_tokens: int, **extra: object) -> dict:
    """The server's own, non-streamed greedy choice for the request the page sends
    (`extra`: more fields of the body)."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "stream": False,
        "temperature": 0,
        "top_p": 1,
        "top_k": 0,
        "max_tokens": max_tokens,
        **extra,
    }
    response = httpx.post(f"{live_server.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def percent(text: str) -> float:
    """The probability a candidate row shows ("12.5%", "<0.01%", ">99.9%")."""
    match = re.search(r"([<>]?)(\d+(?:\.\d+)?)%", text)
    assert match, f"no percentage in {text!r}"
    return float(match.group(2)) / 100


def check_removed_marks(page: Page, steps: list[dict]) -> None:
    """Every token's candidates, raw (none has p = 0, so all are listed, in order), say
    "removed by grammar", struck through, for exactly the server's `allowed = false`."""
    assert page.locator("#output .token").count() == len(steps)
    assert any(not alt["allowed"] for step in steps for alt in step["top_logprobs"]), (
        "the grammar removed none of the model's alternatives: nothing to mark"
    )
    for i, step in enumerate(steps):
        page.mouse.move(0, 0)  # off the answer: the last token's panel must not cover this one
        panel = hover_token(page, i)
        rows = panel.locator(".cand-list").first.evaluate(CANDIDATE_ROWS_JS)
        assert len(rows) == len(step["top_logprobs"]), f"token {i}: {rows}"
        for row, alt in zip(rows, step["top_logprobs"], strict=True):
            # Not bit-equal: the second request reads the first's cached prompt blocks.
            assert math.isclose(row["prob"], math.exp(alt["logprob"]), rel_tol=1e-3), (i, row, alt)
            removed = not alt["allowed"]
            assert ("removed by grammar" in row["text"]) == removed, (i, row, alt)
            assert row["struck"] == removed, (i, row, alt)
        assert panel.locator(".candidate.chosen").count() == 1
        assert "removed by grammar" not in panel.locator(".candidate.chosen").inner_text()


def test_viewer_streams_the_real_tokens(viewer: Viewer, live_server: LiveServer, tmp_path: Path):
    page = viewer.page
    open_viewer(page, live_server.url)
    assert page.inner_text("#model") == MODEL
    page.evaluate(COUNT_TOKENS_JS)

    status = generate(
        page, PROMPT, temperature=0, top_k=0, top_p=1, min_p=0.05, max_tokens=MAX_TOKENS
    )
    assert status == "done"
    sent = viewer.chats[-1]
    assert {k: sent[k] for k in ("temperature", "top_k", "top_p", "min_p", "max_tokens")} == {
        "temperature": 0, "top_k": 0, "top_p": 1, "min_p": 0.05, "max_tokens": MAX_TOKENS,
    }  # fmt: skip

    # The answer streamed in: the page showed many different token counts before done.
    counts = page.evaluate("window.__tokenCounts")
    assert len(set(counts) - {0}) >= 3, f"the tokens did not stream in one by one: {counts}"

    spans = page.locator("#output .token")
    count = spans.count()
    assert 3 <= count <= MAX_TOKENS
    assert page.inner_text("#count") == str(MAX_TOKENS)
    assert "length" in page.inner_text("#finish")
    assert re.fullmatch(r"\d+", page.inner_text("#seed-used"))

    # The spans are the real tokens: together they are the server's answer.
    text = page.eval_on_selector("#output", "output => output.textContent")
    assert text == server_choice(live_server, PROMPT, MAX_TOKENS)["message"]["content"]

    # Greedy: every token is the most likely one, with a probability in (0, 1].
    for i in range(count):
        prob = float(spans.nth(i).get_attribute("data-prob") or "nan")
        assert 0 < prob <= 1, f"token {i}: data-prob {prob}"
        assert spans.nth(i).get_attribute("data-rank") == "1"

    # Hovering the first token shows its candidates, the chosen one marked.
    panel = hover_token(page, 0)
    rows = panel.locator(".candidate")
    assert rows.count() >= 2
    probs = [percent(rows.nth(i).inner_text()) for i in range(rows.count())]
    assert all(0 <= p <= 1 for p in probs) and sum(probs) <= 1.01, probs
    assert probs == sorted(probs, reverse=True)
    chosen = panel.locator(".candidate.chosen")
    assert chosen.count() == 1
    first = float(spans.first.get_attribute("data-prob") or "nan")
    assert math.isclose(float(chosen.get_attribute("data-prob") or "nan"), first, rel_tol=1e-6)
    assert "rank 1" in panel.inner_text()
    assert "removed by grammar" not in panel.inner_text()
    assert not page.is_visible("#grammar-note")  # an unconstrained answer

    # The timings are numbers (the server's, once the last chunk came).
    assert re.search(r"\d+ ms", page.inner_text("#ttft"))
    assert re.search(r"\d+(\.\d+)?", page.inner_text("#tps"))

    png = page.screenshot(path=tmp_path / "viewer.png")
    colours = distinct_colours(png, limit=MIN_DISTINCT_COLOURS)
    assert colours >= MIN_DISTINCT_COLOURS, f"the screenshot has only {colours} colours"

    assert viewer.foreign == [], f"requests to other hosts: {viewer.foreign}"
    assert viewer.problems == [], "\n".join(viewer.problems)


def test_viewer_constrains_the_answer_to_json(viewer: Viewer, live_server: LiveServer):
    page = viewer.page
    open_viewer(page, live_server.url)
    status = generate(
        page, JSON_PROMPT, temperature=0, top_k=0, top_p=1, max_tokens=JSON_MAX_TOKENS,
        seed=JSON_SEED, mode="raw", json_object=True,
    )  # fmt: skip
    assert status == "done"
    assert "stop" in page.inner_text("#finish")
    assert page.is_visible("#grammar-note")

    # The page's answer is a JSON object, the one the server gives the same request.
    text = page.eval_on_selector("#output", "output => output.textContent")
    assert isinstance(json.loads(text), dict), text
    choice = server_choice(
        live_server, JSON_PROMPT, JSON_MAX_TOKENS, seed=JSON_SEED,
        response_format={"type": "json_object"}, logprobs=True, top_logprobs=10,
        logprobs_mode="raw",
    )  # fmt: skip
    assert choice["finish_reason"] == "stop"
    assert text == choice["message"]["content"]
    assert viewer.chats[-1]["response_format"] == {"type": "json_object"}
    check_removed_marks(page, choice["logprobs"]["content"])

    assert viewer.foreign == [], f"requests to other hosts: {viewer.foreign}"
    assert viewer.problems == [], "\n".join(viewer.problems)


def test_viewer_constrains_the_answer_to_a_json_schema(viewer: Viewer, live_server: LiveServer):
    page = viewer.page
    open_viewer(page, live_server.url)

    # The schema box shows only when "a JSON Schema" is chosen, prefilled with a schema
    # OpenAI's strict mode accepts; both are labelled.
    assert not page.is_visible("#schema-box")
    constraint = page.get_by_label("Constrain to")
    assert constraint.evaluate("select => select.id") == "constraint"
    constraint.select_option("json_schema")
    assert page.is_visible("#schema-box")
    box = page.get_by_label("JSON Schema")
    assert box.evaluate("box => box.id") == "schema"
    example = json.loads(box.input_value())
    Draft202012Validator.check_schema(example)
    assert example["type"] == "object" and example["additionalProperties"] is False
    assert sorted(example["required"]) == sorted(example["properties"])
    constraint.select_option("json_object")
    assert not page.is_visible("#schema-box")

    status = generate(
        page, SCHEMA_PROMPT, temperature=0, top_k=0, top_p=1, max_tokens=SCHEMA_MAX_TOKENS,
        mode="raw", schema=SCHEMA,
    )  # fmt: skip
    assert status == "done"
    assert "stop" in page.inner_text("#finish")
    assert page.is_visible("#grammar-note")
    assert "JSON Schema" in page.inner_text("#grammar-note")
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "viewer", "strict": True, "schema": SCHEMA},
    }
    assert len(viewer.chats) == 1
    assert viewer.chats[0]["response_format"] == response_format

    # The page's answer fits the schema, and is the one the server gives the same request.
    text = page.eval_on_selector("#output", "output => output.textContent")
    Draft202012Validator(SCHEMA).validate(json.loads(text))
    choice = server_choice(
        live_server, SCHEMA_PROMPT, SCHEMA_MAX_TOKENS, response_format=response_format,
        logprobs=True, top_logprobs=10, logprobs_mode="raw",
    )  # fmt: skip
    assert choice["finish_reason"] == "stop"
    assert text == choice["message"]["content"]
    check_removed_marks(page, choice["logprobs"]["content"])

    assert viewer.foreign == [], f"requests to other hosts: {viewer.foreign}"
    assert viewer.problems == [], "\n".join(viewer.problems)


def schema_error(page: Page) -> str:
    """The error said next to the schema box ("" when none shows)."""
    return page.inner_text("#schema-error") if page.is_visible("#schema-error") else ""


def test_viewer_refuses_a_bad_schema(viewer: Viewer, live_server: LiveServer):
    page = viewer.page
    open_viewer(page, live_server.url)

    # Not JSON, or JSON but not an object: said next to the box, and nothing is sent.
    for text, words in [
        ('{"type": "object",', "not valid JSON"),
        ('[{"type": "object"}]', "must be a JSON object"),
        ('"object"', "must be a JSON object"),
    ]:
        status = generate(page, PROMPT, temperature=0, max_tokens=MAX_TOKENS, schema=text)
        assert words in schema_error(page), (text, schema_error(page))
        assert words in status
        assert "invalid" in (page.get_attribute("#schema", "class") or "")
        assert page.get_attribute("#schema", "aria-invalid") == "true"
        assert page.locator("#output .token").count() == 0
    assert viewer.chats == [], "a request was sent for a schema that is not a JSON object"
    # Editing the schema clears its error.
    page.fill("#schema", json.dumps(SCHEMA))
    assert schema_error(page) == ""
    assert "invalid" not in (page.get_attribute("#schema", "class") or "")

    # A schema the server refuses (a grammar cannot enforce "not"; the rest follows
    # OpenAI's strict rules): the server's message, naming the keyword and its place, in
    # the status and next to the box.
    refused = {
        "type": "object",
        "properties": {"a": {"not": {"type": "string"}}},
        "required": ["a"],
        "additionalProperties": False,
    }
    status = generate(page, PROMPT, temperature=0, max_tokens=MAX_TOKENS, schema=refused)
    # The server's own answer to the body the page sent.
    response = httpx.post(
        f"{live_server.url}/v1/chat/completions", json=viewer.chats[-1], timeout=60
    )
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert "'not' at /properties/a" in message
    assert status == message
    assert "error" in (page.get_attribute("#status", "class") or "")
    assert schema_error(page) == message
    assert "invalid" in (page.get_attribute("#schema", "class") or "")
    assert page.locator("#output .token").count() == 0
    assert len(viewer.chats) == 1

    assert viewer.foreign == [], f"requests to other hosts: {viewer.foreign}"
    # The 400 itself is the one console error a failed fetch logs; nothing else.
    others = [p for p in viewer.problems if "status of 400" not in p]
    assert others == [], "\n".join(others)


@pytest.mark.parametrize(
    ("param", "value", "input_id"), [("top_p", 5, "top-p"), ("min_p", 2, "min-p")]
)
def test_viewer_shows_the_servers_error(
    viewer: Viewer, live_server: LiveServer, param: str, value: float, input_id: str
):
    page = viewer.page
    open_viewer(page, live_server.url)
    status = generate(page, PROMPT, temperature=0, max_tokens=MAX_TOKENS, **{param: value})
    assert viewer.chats[-1][param] == value
    assert param in status
    assert "error" in (page.get_attribute("#status", "class") or "")
    assert "invalid" in (page.get_attribute(f"#{input_id}", "class") or "")
    others = [f"#{i}" for i in ("temperature", "top-k", "top-p", "min-p") if i != input_id]
    assert all("invalid" not in (page.get_attribute(i, "class") or "") for i in others)
    assert page.locator("#output .token").count() == 0
    assert viewer.foreign == [], f"requests to other hosts: {viewer.foreign}"
    # The 400 itself is the one console error a failed fetch logs; nothing else.
    others = [p for p in viewer.problems if "status of 400" not in p]
    assert others == [], "\n".join(others)


def test_capture_saves_a_picture(browser: Browser, live_server: LiveServer, tmp_path: Path):
    """The docs' screenshot script works: a sampled answer under the page's example
    schema, a token's candidates shown."""
    path = tmp_path / "viewer.png"
    png = capture(live_server.url, path, max_tokens=16, browser=browser)
    assert path.read_bytes() == png
    assert distinct_colours(png, limit=MIN_DISTINCT_COLOURS) >= MIN_DISTINCT_COLOURS
