"""`decodespec check`: it passes `decodespec serve`, and each check fails a server
that breaks its clause.

A broken server is the real one behind an ASGI layer that rewrites each request
before the engine sees it (drops `stop`, drops `seed`, ...), or answers it
itself: every check must notice the clause it names going missing. Plus the
parts that need no server: parsing both logprobs forms, the chi-square limit,
the loopback guard, the request budget. Small stdlib servers on 127.0.0.1 stand
for the APIs that are not OpenAI's: the command must find OpenAI's with or
without `/v1` in the URL, and stop with the URLs it tried where there is none.
"""

from __future__ import annotations

import ipaddress
import json
import math
import socket
import threading
import urllib.parse
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from scipy import stats

from decodespec.reference import check_sampling, check_suite, cli
from decodespec.reference.check_client import BudgetExhaustedError, Client, Exchange, is_loopback
from decodespec.reference.model_files import bundled_model_path
from tests.serve import live


def rewriting(app, state: dict):
    """`app` behind a layer that hands each POST's JSON body to `state["mutate"]`
    (which edits it, or returns a status to answer with instead), records the
    Authorization header it saw, and hands each JSON answer to `state["edit"]` (with
    the number of POSTs then in flight, this one included) to edit before it goes."""

    async def layer(scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await app(scope, receive, send)
        state["authorization"] = dict(scope["headers"]).get(b"authorization")
        body, more = b"", True
        while more:
            message = await receive()
            body, more = body + message.get("body", b""), message.get("more_body", False)
        data = json.loads(body)
        answer = state["mutate"](data)
        if answer is not None:  # a status, or (status, body): sent instead of the engine's
            status, content = answer if isinstance(answer, tuple) else (answer, b'{"error": "x"}')
            await send({"type": "http.response.start", "status": status,
                        "headers": [(b"content-type", b"application/json")]})  # fmt: skip
            await send({"type": "http.response.body", "body": content})
            return None
        new = json.dumps(data).encode()
        headers = [(k, v) for k, v in scope["headers"] if k != b"content-length"]
        headers.append((b"content-length", str(len(new)).encode()))
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": new, "more_body": False}
            return await receive()

        state["in_flight"] = state.get("in_flight", 0) + 1
        try:
            return await app(dict(scope, headers=headers), replay, edited(send, state))
        finally:
            state["in_flight"] -= 1

    return layer


def edited(send, state: dict):
    """`send` with a whole JSON answer passed through `state["edit"]` when it is set."""
    start = None

    async def sending(message):
        nonlocal start
        edit = state.get("edit")
        if edit is None:
            return await send(message)
        if message["type"] == "http.response.start":
            start = message  # sent with the edited body's length
            return None
        data = json.loads(message["body"])
        edit(data, state["in_flight"])
        body = json.dumps(data).encode()
        headers = [(k, v) for k, v in start["headers"] if k != b"content-length"]
        await send({**start, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
        return await send({"type": "http.response.body", "body": body})

    return sending


def keep(body: dict) -> None:
    return None


@pytest.fixture(scope="module")
def server():
    state = {"mutate": keep}
    original = live.create_app
    live.create_app = lambda engine, model: rewriting(original(engine, model), state)
    try:
        with live.LiveServer() as running:
            running.state = state
            yield running
    finally:
        live.create_app = original


def run_check(server, capsys, *args: str) -> tuple[int, dict]:
    capsys.readouterr()
    code = cli.main(["check", "--base-url", server.base_url, "--json", *args])
    return code, json.loads(capsys.readouterr().out)


def test_decodespec_serve_passes_every_check(server, capsys):
    """Every check, the teacher-forced comparison with the spec included (the same
    GGUF as `--model-file`), passes against the project's own server."""
    server.state["mutate"] = keep
    code, report = run_check(server, capsys, "--model-file", str(bundled_model_path()))
    outcomes = {c["check"]: (c["outcome"], c["detail"]) for c in report["checks"]}
    assert {outcome for outcome, _ in outcomes.values()} == {"pass"}, outcomes
    assert len(outcomes) == len(check_suite.CHECKS) + 1
    assert code == 0


def drop(*keys: str) -> Callable[[dict], None]:
    def mutate(body: dict) -> None:
        for key in keys:
            body.pop(key, None)

    return mutate


def hotter(body: dict) -> None:
    """Sampling at twice the asked temperature; greedy requests sampled."""
    body["temperature"] = 2 * body.get("temperature", 1.0) or 1.0


def accept_anything(body: dict) -> None:
    """Invalid values quietly replaced instead of refused."""
    if body.get("temperature", 0) < 0:
        body["temperature"] = 0
    if body.get("top_p", 1) > 1:
        body["top_p"] = 1
    if body.get("max_tokens", 1) < 1:
        body["max_tokens"] = 1
    body.pop("logit_bias", None)


def crash_structured(body: dict) -> int | None:
    return 500 if "response_format" in body else None


BROKEN = [
    ("temperature 0 takes the most likely token", hotter),
    ("temperature 0 repeats", hotter),
    ("a stop string ends the text before it", drop("stop")),
    ("a stop string is never streamed", drop("stop")),
    ("a seed reproduces a sampled answer", drop("seed")),
    ("invalid parameters are refused with a 4xx", accept_anything),
    ("logit_bias bans and forces tokens", drop("logit_bias")),
    ("a json_schema answer validates", drop("response_format")),
    ("a json_schema answer validates", crash_structured),
    ("a schema that is not valid JSON Schema is refused", drop("response_format")),
    ("top_p draws stay in the nucleus", drop("top_p")),
    ("top_k draws stay in the k most likely", drop("top_k")),
    ("min_p draws stay above the threshold", drop("min_p")),
    ("draw frequencies follow the reported probabilities at T 0.7, 1, 1.5", hotter),
]


def logprobs_move_with_load(answer: dict, in_flight: int) -> None:
    """An answer sent while other requests run has every logprob a bit lower, as a
    server's whose sums depend on its batch (its text unchanged)."""
    if in_flight < 2:
        return
    for choice in answer.get("choices") or []:
        logprobs = choice.get("logprobs") or {}
        logprobs["token_logprobs"] = [
            math.nextafter(x, -math.inf) for x in logprobs.get("token_logprobs") or []
        ]


def test_a_server_whose_logprobs_move_with_the_load_fails_loop_invariant(server, capsys):
    """LOOP-INVARIANT-1 compares every logprob bitwise where the server returns them: the
    same text with logprobs one bit apart under load is a fail naming the token; the
    server as it is passes, saying it compared the logprobs."""
    name = "a seeded answer does not depend on the load"
    code, report = run_check(server, capsys, "--only", name)
    (result,) = report["checks"]
    assert result["outcome"] == "pass" and "logprobs bitwise" in result["detail"], result
    server.state["edit"] = logprobs_move_with_load
    try:
        code, report = run_check(server, capsys, "--only", name)
    finally:
        server.state["edit"] = None
    (result,) = report["checks"]
    assert result["outcome"] == "fail", result["detail"]
    assert "the same text, but token 0 (" in result["detail"] and "under load" in result["detail"]
    assert result["evidence"] and code == 1


@pytest.mark.parametrize(("name", "mutate"), BROKEN, ids=[f"{n}-{m.__name__}" for n, m in BROKEN])
def test_each_check_fails_a_server_that_breaks_its_clause(server, capsys, name, mutate):
    server.state["mutate"] = mutate
    try:
        extra = ["--model-file", str(bundled_model_path())] if "logit_bias" in name else []
        code, report = run_check(server, capsys, "--only", name, *extra)
    finally:
        server.state["mutate"] = keep
    (result,) = [c for c in report["checks"] if c["check"] == name]
    assert result["outcome"] == "fail", result["detail"]
    assert result["evidence"], "a fail carries its evidence"
    assert code == 1


def test_a_refused_parameter_is_not_supported_not_a_fail(server, capsys):
    """A server that answers 400 to top_k does not support it: the check says so."""
    server.state["mutate"] = lambda body: 400 if "top_k" in body else None
    try:
        code, report = run_check(server, capsys, "--only", "top_k")
    finally:
        server.state["mutate"] = keep
    (result,) = report["checks"]
    assert result["outcome"] == "not supported" and "HTTP 400" in result["detail"]
    assert code == 0


@pytest.mark.parametrize("content", [b"[1, 2]", b'{"choices": [{"text": 7}]}', b"not json"])
def test_a_malformed_answer_is_a_fail_not_a_crash(server, capsys, content):
    """A 200 whose body is not the API's shape fails the check that read it, and
    the body shows in its detail and its evidence."""
    server.state["mutate"] = lambda body: (200, content)
    try:
        code, report = run_check(server, capsys, "--model", "smollm2", "--only",
                                 "temperature 0 repeats")  # fmt: skip
    finally:
        server.state["mutate"] = keep
    (result,) = report["checks"]
    assert result["outcome"] == "fail" and code == 1, result
    assert content.decode() in result["detail"]
    assert [e["response"] for e in result["evidence"]] == [content.decode()]


def test_the_api_key_is_sent_and_never_printed(server, capsys):
    server.state["mutate"] = keep
    capsys.readouterr()
    code = cli.main(["check", "--base-url", server.base_url, "--api-key", "sk-secret-7",
                     "--only", "temperature 0 repeats"])  # fmt: skip
    out = capsys.readouterr()
    assert code == 0
    assert server.state["authorization"] == b"Bearer sk-secret-7"
    assert "sk-secret-7" not in out.out + out.err


# ------------------------------------------------ the loopback guard, with no network

# Names the guard may look up: `offline` answers them itself (no DNS query leaves);
# None: the name does not resolve.
NAMES = {
    "localhost": ["127.0.0.1", "::1"],
    "api.example": ["127.0.0.1", "192.0.2.9"],  # one address off loopback is one too many
    "nowhere.invalid": None,
}
NOT_LOOPBACK = [
    "http://192.0.2.1:8000/v1",  # TEST-NET-1 (documentation): `is_private`, not loopback
    "http://10.0.0.7:8000",  # a private network's host
    "http://169.254.169.254/v1",  # link-local: a cloud's metadata service
    "http://[2001:db8::1]:8000/v1",  # IPv6 documentation
    "http://api.example:8000/v1",  # resolves to loopback and to another host
]
LOOPBACK = ["http://127.0.0.1:9/v1", "http://127.8.9.10:9", "http://[::1]:9", "http://localhost:9"]


class Offline:
    """What `offline` refused: each attempt to connect or to look a name up."""

    def __init__(self) -> None:
        self.attempts: list[str] = []

    def refuse(self, what: str) -> None:
        self.attempts.append(what)
        raise AssertionError(f"a network guard's test tried to {what}: nothing may leave")


@pytest.fixture
def offline(monkeypatch) -> Offline:
    """No packet can leave this process: every way out (`socket.create_connection`,
    which urllib's and http.client's connections take, and any socket's `connect` and
    `connect_ex`) raises an AssertionError naming the address, before a packet is
    sent; `getaddrinfo` answers IP literals and `NAMES` itself, and refuses any other
    name the same way (a DNS query is traffic too). A broken guard then fails its test
    where the client first tries to connect, naming the address, instead of after."""
    state = Offline()

    def create_connection(address, *args, **kwargs):
        state.refuse(f"connect to {address!r}")

    def connect(self, address):
        state.refuse(f"connect to {address!r}")

    def getaddrinfo(host, port, *args, **kwargs):
        host = host.decode() if isinstance(host, bytes) else host
        try:
            addresses = [ipaddress.ip_address(host)]
        except ValueError:
            if host not in NAMES:
                state.refuse(f"look up {host!r}")
            if NAMES[host] is None:
                raise socket.gaierror(socket.EAI_NONAME, "Name or service not known") from None
            addresses = [ipaddress.ip_address(a) for a in NAMES[host]]
        return [  # getaddrinfo's shape, made here: the system's resolver is never asked
            (socket.AF_INET6, socket.SOCK_STREAM, 6, "", (str(a), port or 0, 0, 0))
            if a.version == 6
            else (socket.AF_INET, socket.SOCK_STREAM, 6, "", (str(a), port or 0))
            for a in addresses
        ]

    monkeypatch.setattr(socket, "create_connection", create_connection)
    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket.socket, "connect_ex", connect)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return state


@pytest.mark.parametrize("url", NOT_LOOPBACK)
def test_another_host_needs_allow_remote(offline, capsys, url):
    """`decodespec check` refuses a host off loopback before any request, with a usage
    error naming `--allow-remote`: nothing tried to connect. With the guard broken the
    client's first connection raises `offline`'s AssertionError naming the address."""
    code = cli.main(["check", "--base-url", url])
    assert code == 2
    assert "--allow-remote" in capsys.readouterr().err
    assert offline.attempts == []


@pytest.mark.parametrize("url", NOT_LOOPBACK)
def test_allow_remote_lets_the_client_connect_and_offline_stops_it(offline, url):
    """With `--allow-remote` the checker goes on to connect, and `offline` stops that
    very connection (so the test above would see a broken guard at its first attempt,
    with nothing sent): the AssertionError names the host."""
    host = urllib.parse.urlsplit(url).hostname
    with pytest.raises(AssertionError, match="connect to"):
        cli.main(["check", "--base-url", url, "--allow-remote", "--timeout", "1"])
    assert len(offline.attempts) == 1 and host in offline.attempts[0], offline.attempts


@pytest.mark.parametrize(("url", "loopback"), [*((u, True) for u in LOOPBACK),
                                               *((u, False) for u in NOT_LOOPBACK),
                                               ("http://nowhere.invalid:9", False)])  # fmt: skip
def test_the_guard_takes_loopback_and_only_loopback(offline, url, loopback):
    """`is_loopback`: every address the host resolves to in 127.0.0.0/8 or ::1; a host
    with one address elsewhere is not, nor one that does not resolve. No lookup leaves
    (`offline` answers them)."""
    assert is_loopback(url) is loopback, url
    assert offline.attempts == []


def test_the_request_budget_stops_a_run():
    client = Client("http://127.0.0.1:9/v1", api_key=None, max_requests=1, timeout_s=1)
    client.get("/models")  # refused: port 9 has no server, still one request spent
    with pytest.raises(BudgetExhaustedError, match="--max-requests"):
        client.get("/models")
    context = check_suite.Context(client, "m")
    outcome = check_suite.run_check(check_suite.greedy_repeats, context)
    assert outcome.outcome == "not supported" and "budget" in outcome.detail


def test_both_logprobs_forms_and_streamed_chunks_are_read():
    legacy = {"choices": [{"text": " Paris", "finish_reason": "length", "logprobs": {
        "tokens": [" Paris"], "token_logprobs": [-0.1],
        "top_logprobs": [{" London": -3.0, " Paris": -0.1}]}}]}  # fmt: skip
    chat = {"choices": [{"message": {"content": " Paris"}, "finish_reason": "stop",
                         "logprobs": {"content": [{"token": " Paris", "logprob": -0.1,
                         "top_logprobs": [{"token": " London", "logprob": -3.0},
                                          {"token": " Paris", "logprob": -0.1}]}]}}]}  # fmt: skip
    for body in (legacy, chat):
        result = check_suite.answer(Exchange("/x", {}, 200, body=body))
        assert result.text == " Paris"
        assert result.positions[0].top == [(" Paris", -0.1), (" London", -3.0)]
    streamed = Exchange("/x", {"stream": True}, 200, events=[
        {"choices": [{"text": " Pa", "finish_reason": None}]},
        {"choices": [{"delta": {"content": "ris"}, "finish_reason": "stop"}]},
        {"choices": [], "usage": {"completion_tokens": 2}}])  # fmt: skip
    result = check_suite.answer(streamed)
    assert (result.text, result.finish_reason, result.usage) == (
        " Paris", "stop", {"completion_tokens": 2})  # fmt: skip


@pytest.mark.parametrize("df", [1, 2, 3, 5, 8, 13, 20])
def test_the_chi_square_limit_is_the_quantile(df):
    want = stats.chi2.ppf(1 - check_sampling.FALSE_ALARM, df)
    assert math.isclose(check_sampling.chi_square_limit(df, check_sampling.FALSE_ALARM), want,
                        rel_tol=0.03)  # fmt: skip


def test_the_frequency_test_accepts_the_law_and_rejects_another_temperature():
    probs = [("a", 0.4), ("b", 0.3), ("c", 0.2), ("d", 0.05)]  # 0.05 off the list
    at_one = ["a"] * 40 + ["b"] * 30 + ["c"] * 20 + ["d"] * 5 + ["z"] * 5
    statistic, limit, n, bins = check_sampling.frequency_test(probs, at_one, 1.0)
    assert statistic < 1e-9 and (n, len(bins)) == (100, 5) and limit > 10  # z: the rest
    statistic, limit, _, _ = check_sampling.frequency_test(probs, at_one, 0.5)
    assert statistic > limit
    statistic, limit, n, _ = check_sampling.frequency_test(probs, at_one[:95] + ["z"] * 30, 1.0)
    assert statistic > limit, "too many draws off the list at temperature 1"


def test_an_only_that_matches_no_check_is_refused(capsys):
    code = cli.main(["check", "--base-url", "http://127.0.0.1:9/v1", "--model", "m",
                     "--only", "no such check"])  # fmt: skip
    assert code == 2
    assert "no check's name or clause contains 'no such check'" in capsys.readouterr().err


# ------------------------------------------------ servers that are not (only) OpenAI's

MODELS = {"object": "list", "data": [{"id": "m", "object": "model", "owned_by": "x"}]}
COMPLETION = {
    "id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m",
    "choices": [{"index": 0, "text": " Paris", "finish_reason": "length", "logprobs": None}],
    "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
}  # fmt: skip
NATIVE_MODELS = {"models": [{"name": "m", "model": "m"}]}  # Ollama's /api/tags shape
NATIVE_COMPLETION = {"content": " Paris", "stop": True, "tokens_predicted": 1, "id_slot": 0}
# llama-server: OpenAI's model list at its root and under /v1, OpenAI's completions
# under /v1 only, its own at /completions
LLAMA_SERVER = {
    "/models": MODELS, "/completions": NATIVE_COMPLETION,
    "/v1/models": MODELS, "/v1/completions": COMPLETION,
}  # fmt: skip


@contextmanager
def fake_api(routes: dict[str, object]) -> Iterator[str]:
    """A server on 127.0.0.1 that answers a GET or POST to each path of `routes`
    with 200 and its value (JSON, or bytes as they are), any other path with a
    plain-text 404. Yields its URL."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.answer()

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.answer()

        def answer(self) -> None:
            found = routes.get(self.path)
            if found is None:
                status, body, kind = 404, b"File Not Found", "text/plain"
            elif isinstance(found, bytes):
                status, body, kind = 200, found, "text/html"
            else:
                status, body, kind = 200, json.dumps(found).encode(), "application/json"
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:  # quiet
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_port}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()


def check_at(url: str, capsys, *args: str) -> tuple[int, dict]:
    """`decodespec check --json` at `url` with one cheap check; its exit code and report."""
    capsys.readouterr()
    code = cli.main(["check", "--base-url", url, "--json", "--only", "temperature 0 repeats",
                     *args])  # fmt: skip
    return code, json.loads(capsys.readouterr().out)


def test_the_url_without_v1_finds_decodespec_serve(server, capsys):
    """`decodespec serve` speaks OpenAI under /v1 only: its bare URL finds it."""
    server.state["mutate"] = keep
    code, report = check_at(server.url, capsys)
    assert (report["base_url"], report["base_url_given"]) == (server.base_url, server.url)
    assert [c["outcome"] for c in report["checks"]] == ["pass"] and code == 0, report


@pytest.mark.parametrize("suffix", ["", "/", "/v1", "/v1/"])
def test_the_checks_run_under_v1_not_at_another_apis_root(capsys, suffix):
    """llama-server's root answers OpenAI's model list but its own /completions:
    with or without /v1 in the URL, the checks run under /v1, and pass."""
    with fake_api(LLAMA_SERVER) as url:
        code, report = check_at(url + suffix, capsys)
    assert (report["base_url"], report["base_url_given"]) == (url + "/v1", url + suffix)
    assert [c["outcome"] for c in report["checks"]] == ["pass"] and code == 0, report


@pytest.mark.parametrize("suffix", ["", "/"])
def test_a_server_speaking_openai_at_its_root_is_found_there(capsys, suffix):
    with fake_api({"/models": MODELS, "/completions": COMPLETION}) as url:
        code, report = check_at(url + suffix, capsys)
    assert report["base_url"] == url
    assert [c["outcome"] for c in report["checks"]] == ["pass"] and code == 0, report


def test_the_table_names_the_base_url_used(capsys):
    with fake_api(LLAMA_SERVER) as url:
        capsys.readouterr()
        code = cli.main(["check", "--base-url", url, "--only", "temperature 0 repeats"])
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith(f"{url}/v1 (from --base-url {url})  model 'm'") and code == 0


@pytest.mark.parametrize("suffix", ["", "/v1"])
def test_a_server_without_the_openai_api_is_a_usage_error_naming_the_urls(capsys, suffix):
    """No check runs against another API: the command stops with each URL it tried
    and what that URL answered."""
    with fake_api({"/models": NATIVE_MODELS, "/completions": NATIVE_COMPLETION}) as url:
        capsys.readouterr()
        code = cli.main(["check", "--base-url", url + suffix, "--json"])
    out = capsys.readouterr()
    assert code == 2 and out.out == ""
    assert f"no OpenAI API at {url}{suffix}" in out.err
    assert f"GET {url}/v1/models answered HTTP 404: File Not Found" in out.err
    if suffix == "":
        assert f"GET {url}/models answered HTTP 200: {json.dumps(NATIVE_MODELS)}" in out.err
    else:
        assert f"GET {url}/models" not in out.err, "a URL ending in /v1 is taken as it is"


STREAM = "streamed text is the whole text"


@pytest.mark.parametrize(
    ("answer", "only", "shown"),
    [
        (NATIVE_COMPLETION, "temperature 0 repeats", json.dumps(NATIVE_COMPLETION)),
        (b"<html>busy</html>", "temperature 0 repeats", "<html>busy</html>"),
        (b"", "temperature 0 repeats", "(an empty body)"),
        (COMPLETION, STREAM, json.dumps(COMPLETION)),  # JSON where events were asked for
    ],
    ids=["another-api", "not-json", "empty", "not-a-stream"],
)
def test_a_failing_checks_evidence_shows_the_body(capsys, answer, only, shown):
    """A 200 that is not an OpenAI answer fails the check, and what came instead
    is in its detail and its evidence, never an empty excerpt."""
    routes = {"/v1/models": MODELS, "/v1/completions": answer}
    with fake_api(routes) as url:
        capsys.readouterr()
        code = cli.main(["check", "--base-url", url + "/v1", "--json", "--only", only])
        (result,) = json.loads(capsys.readouterr().out)["checks"]
    assert result["outcome"] == "fail" and code == 1, result
    assert "not the OpenAI API's shape" in result["detail"] and shown in result["detail"]
    assert shown in [e["response"] for e in result["evidence"]], result["evidence"]
