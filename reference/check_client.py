"""The HTTP side of `decodespec check`: a small OpenAI API client that keeps the
evidence, counts its requests and stays on loopback unless told otherwise.

Standard library only (`urllib`): the checker must run wherever the engine
does. Every call goes through `Client.call`, which spends one request of the
budget, times out, and returns an `Exchange` (the request, the status, the
body or the stream's events, and the body's text as it came) rather than
raising on an HTTP error: an error status is an observation the checks report,
not a crash.

`find_api_root` finds where the OpenAI API is, with or without `/v1` in the
URL given: llama-server, for one, answers its own non-OpenAI `/completions`
at its root and OpenAI's under `/v1`.
"""

from __future__ import annotations

import http.client
import ipaddress
import json
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field

EXCERPT_CHARS = 600  # of a response body, in a check's evidence
BRIEF_CHARS = 300  # of a response body, in a line of words


class BudgetExhaustedError(RuntimeError):
    """The run has spent its request budget (`--max-requests`)."""


class NoOpenAIApiError(ValueError):
    """No URL tried answers OpenAI's model list: the checks would only read another
    API's answers as fails. A ValueError: the command reports it as a usage error."""


@dataclass
class Exchange:
    """One request and what came back. `body` is the parsed JSON (or None); a
    streamed request's events are in `events` (the `data:` payloads, parsed)."""

    path: str
    request: dict
    status: int
    body: dict | None = None
    events: list[dict] = field(default_factory=list)
    text: str = ""  # the body as it came, its first EXCERPT_CHARS characters
    error: str = ""  # a transport error or an unparsable 200 body, in words
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error

    def excerpt(self, chars: int = EXCERPT_CHARS) -> str:
        """The response's first `chars` characters, never empty: the stream's first
        and last events, the JSON body, else the body's text as it came (an answer
        that is not what was asked for shows what it was), else what went wrong."""
        if self.events:
            text = json.dumps(self.events[:3] + self.events[-2:])
        elif self.body is not None:
            text = json.dumps(self.body)
        else:
            text = self.text or self.error or "(an empty body)"
        return text[:chars]

    def evidence(self) -> dict:
        """The request and an excerpt of the response, for a report."""
        evidence = {
            "request": {"path": self.path, **self.request},
            "status": self.status,
            "response": self.excerpt(),
        }
        if self.error:
            evidence["error"] = self.error
        return evidence

    def in_words(self) -> str:
        """What came back, in one line: the status and the body's beginning."""
        if not self.status:
            return f"nothing ({self.error})"
        return f"HTTP {self.status}: {self.excerpt(BRIEF_CHARS)}"


def is_loopback(base_url: str) -> bool:
    """Whether every address `base_url`'s host resolves to is a loopback address."""
    host = urllib.parse.urlsplit(base_url).hostname or ""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return bool(addresses) and all(ipaddress.ip_address(a).is_loopback for a in addresses)


class Client:
    """Requests to `base_url` (the API's root, as `find_api_root` finds it), at most
    `max_requests` of them, each within `timeout_s`. `api_key` goes in the
    Authorization header and nowhere else."""

    def __init__(
        self, base_url: str, *, api_key: str | None, max_requests: int, timeout_s: float
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._api_key = api_key
        self.max_requests = max_requests
        self.timeout_s = timeout_s
        self.requests = 0
        self._lock = threading.Lock()

    def _spend(self) -> None:
        with self._lock:
            if self.requests >= self.max_requests:
                raise BudgetExhaustedError(
                    f"the request budget ({self.max_requests}, --max-requests) is spent"
                )
            self.requests += 1

    def _open(self, path: str, body: dict | None) -> urllib.request.Request:
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        data = None if body is None else json.dumps(body).encode()
        return urllib.request.Request(self.base_url + path, data=data, headers=headers)

    def get(self, path: str) -> Exchange:
        return self.call(path, None)

    def call(self, path: str, body: dict | None) -> Exchange:
        """POST `body` (GET when None) to `path`; a streamed body (`"stream": true`)
        has its server-sent events read to the end."""
        self._spend()
        exchange = Exchange(path, dict(body or {}), status=0)
        start = time.perf_counter()
        try:
            with urllib.request.urlopen(self._open(path, body), timeout=self.timeout_s) as reply:
                exchange.status = reply.status
                text = _keep_text(exchange, reply.read())
                if body is not None and body.get("stream"):
                    exchange.events = _parse_events(text)
                else:
                    exchange.body = json.loads(text or "null")
        except urllib.error.HTTPError as error:
            exchange.status = error.code
            try:
                exchange.body = json.loads(_keep_text(exchange, error.read()))
            except ValueError:
                pass  # a plain-text error: `text` holds it
        except (OSError, ValueError, http.client.HTTPException) as error:
            # refused, timed out, cut off mid-body, not JSON
            exchange.error = f"{type(error).__name__}: {error}"
        exchange.seconds = time.perf_counter() - start
        return exchange


def _keep_text(exchange: Exchange, data: bytes) -> str:
    """The body decoded; its beginning kept in `exchange.text` for the evidence."""
    text = data.decode(errors="replace")
    exchange.text = text[:EXCERPT_CHARS]
    return text


def _parse_events(text: str) -> list[dict]:
    """The `data:` payloads of a server-sent event stream, parsed, up to `[DONE]`."""
    events = []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            break
        events.append(json.loads(data))
    return events


@dataclass
class ApiRoot:
    """Where the OpenAI API answered: its base URL and its `GET /models` exchange."""

    base_url: str
    models: Exchange


def root_candidates(base_url: str) -> list[str]:
    """The base URLs to try, in order. A URL ending in `/v1` is the OpenAI client's
    convention and is taken as it is; otherwise `URL/v1` comes first (llama-server
    answers OpenAI's model list at its root too, but its own `/completions`), then
    the URL itself (a server speaking OpenAI at its root)."""
    url = base_url.rstrip("/")
    if urllib.parse.urlsplit(url).path.endswith("/v1"):
        return [url]
    return [url + "/v1", url]


def is_openai_model_list(models: Exchange) -> bool:
    """Whether a `GET /models` answer has the shape of OpenAI's model list:
    a 200 with `{"object": "list", "data": [...]}`."""
    body = models.body
    return (
        models.ok
        and isinstance(body, dict)
        and body.get("object") == "list"
        and isinstance(body.get("data"), list)
    )


def find_api_root(base_url: str, *, api_key: str | None, timeout_s: float) -> ApiRoot:
    """The first of `root_candidates(base_url)` whose `/models` is OpenAI's model
    list; NoOpenAIApiError naming each URL tried and what it answered otherwise.
    These requests (one or two) are not the checks' budget."""
    tried = []
    for candidate in root_candidates(base_url):
        client = Client(candidate, api_key=api_key, max_requests=1, timeout_s=timeout_s)
        models = client.get("/models")
        if is_openai_model_list(models):
            return ApiRoot(candidate, models)
        tried.append(f"GET {candidate}/models answered {models.in_words()}")
    raise NoOpenAIApiError(
        f"no OpenAI API at {base_url}: no answer was OpenAI's model list "
        f'({{"object": "list", "data": [...]}}): {"; ".join(tried)}'
    )
