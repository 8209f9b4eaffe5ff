"""The HTTP side of `decodespec check`: a small OpenAI API client that keeps the
evidence, counts its requests and stays on loopback unless told otherwise.

Standard library only (`urllib`): the checker must run wherever the engine
does. Every call goes through `Client.call`, which spends one request of the
budget, times out, and returns an `Exchange` (the request, the status, the
body or the stream's events) rather than raising on an HTTP error: an error
status is an observation the checks report, not a crash.
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


class BudgetExhaustedError(RuntimeError):
    """The run has spent its request budget (`--max-requests`)."""


@dataclass
class Exchange:
    """One request and what came back. `body` is the parsed JSON (or None); a
    streamed request's events are in `events` (the `data:` payloads, parsed)."""

    path: str
    request: dict
    status: int
    body: dict | None = None
    events: list[dict] = field(default_factory=list)
    error: str = ""  # a transport error or an unparsable body, in words
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error

    def evidence(self) -> dict:
        """The request and an excerpt of the response, for a report."""
        if self.events:
            response = json.dumps(self.events[:3] + self.events[-2:])
        elif self.body is not None:
            response = json.dumps(self.body)
        else:
            response = self.error
        return {
            "request": {"path": self.path, **self.request},
            "status": self.status,
            "response": response[:EXCERPT_CHARS],
        }


def is_loopback(base_url: str) -> bool:
    """Whether every address `base_url`'s host resolves to is a loopback address."""
    host = urllib.parse.urlsplit(base_url).hostname or ""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return bool(addresses) and all(ipaddress.ip_address(a).is_loopback for a in addresses)


class Client:
    """Requests to `base_url` (ending in `/v1`), at most `max_requests` of them, each
    within `timeout_s`. `api_key` goes in the Authorization header and nowhere else."""

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
                if body is not None and body.get("stream"):
                    exchange.events = _read_events(reply)
                else:
                    exchange.body = json.loads(reply.read() or b"null")
        except urllib.error.HTTPError as error:
            exchange.status = error.code
            text = error.read().decode(errors="replace")
            try:
                exchange.body = json.loads(text)
            except ValueError:
                exchange.error = text[:EXCERPT_CHARS] or error.reason
        except (OSError, ValueError, http.client.HTTPException) as error:
            # refused, timed out, cut off mid-body, not JSON
            exchange.error = f"{type(error).__name__}: {error}"
        exchange.seconds = time.perf_counter() - start
        return exchange


def _read_events(reply) -> list[dict]:  # noqa: ANN001 (http.client.HTTPResponse)
    events = []
    for raw in reply:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            break
        events.append(json.loads(data))
    return events
