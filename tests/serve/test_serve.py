"""`decodespec serve` as a process, and connections that end early.

The installed command listens where it is told (a taken port is a clear error
before the model loads), answers, and stops on Ctrl-C with the CLI's
interrupted status. A client that disconnects before a whole (non-streamed)
answer is ready aborts the request: the engine frees its blocks at once.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from decodespec.reference.__main__ import INTERRUPTED_STATUS

REPO = Path(__file__).resolve().parents[2]
COMMAND = [sys.executable, "-m", "decodespec.reference", "serve"]
SERVING = re.compile(r"serving (\S+) on (http://\S+) ")


def start(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [*COMMAND, *args], cwd=REPO, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True
    )


def wait_for_url(process: subprocess.Popen, timeout: float = 120) -> tuple[str, str]:
    """The model name and URL the server prints once it listens."""
    killer = threading.Timer(timeout, process.kill)  # a hung start fails, never hangs
    killer.start()
    try:
        for line in process.stderr:
            match = SERVING.search(line)
            if match:
                return match.group(1), match.group(2)
    finally:
        killer.cancel()
    raise AssertionError(f"the server exited ({process.wait()}) without serving")


def test_the_command_serves_and_stops_on_ctrl_c():
    process = start("--port", "0", "--served-model-name", "tiny-talker")
    try:
        model, url = wait_for_url(process)
        assert model == "tiny-talker"
        with httpx.Client(base_url=url, trust_env=False, timeout=60) as client:
            assert client.get("/health").json() == {"status": "ok"}
            body = {"model": model, "prompt": "Hello", "max_tokens": 3, "temperature": 0}
            response = client.post("/v1/completions", json=body).json()
            assert response["usage"]["completion_tokens"] == 3
            assert "<html" in client.get("/").text.lower()
        process.send_signal(signal.SIGINT)
        status = process.wait(timeout=60)
        rest = process.stderr.read()
    finally:
        process.kill()
    assert status == INTERRUPTED_STATUS, rest
    assert "decodespec: interrupted" in rest
    assert "/v1/completions" in rest, "one log line per request"
    assert "Traceback" not in rest, rest


# Keeps one core busy (what else runs on a shared machine); bounded by itself, and
# killed by the test when it is done.
SPIN = "import time\nend = time.monotonic() + 300\nwhile time.monotonic() < end: pass"


def connect_when_printed(process: subprocess.Popen) -> str:
    """Connect to the URL the instant the line appears; what happened, in words."""
    _, url = wait_for_url(process)
    host, port = url.removeprefix("http://").split(":")
    try:
        socket.create_connection((host, int(port)), timeout=60).close()
    except ConnectionRefusedError:
        return f"{url} refused a connection right after it was printed"
    with httpx.Client(base_url=url, trust_env=False, timeout=60) as client:
        if client.get("/health").json() != {"status": "ok"}:
            return f"{url}/health did not answer ok"
    return "ok"


def test_the_printed_url_accepts_connections_at_once_on_a_busy_machine():
    """`serving ... on URL` means listening: a client that connects the instant the line
    appears is never refused, even while every core is busy (the socket listens before
    the line is printed; uvicorn accepts the queued connection once it runs). Three
    servers start at once, each watched by its own thread, beside a spinner per core."""
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(os.cpu_count() or 2)]
    servers = [start("--port", "0") for _ in range(3)]
    outcomes: list[str] = ["not started"] * len(servers)

    def watch(i: int) -> None:
        try:
            outcomes[i] = connect_when_printed(servers[i])
        except Exception as error:  # reported below, with the other servers'
            outcomes[i] = repr(error)

    try:
        watchers = [threading.Thread(target=watch, args=(i,)) for i in range(len(servers))]
        for watcher in watchers:
            watcher.start()
        for watcher in watchers:
            watcher.join(300)
        assert outcomes == ["ok"] * len(servers), outcomes
        for process in servers:
            process.send_signal(signal.SIGINT)
            assert process.wait(timeout=60) == INTERRUPTED_STATUS
    finally:
        for process in servers + spinners:
            process.kill()
            process.wait()


def test_a_taken_port_is_a_clear_error_before_the_model_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [*COMMAND, "--port", str(port)], cwd=REPO, capture_output=True, text=True, timeout=120
        )
    assert result.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "loading" not in result.stderr


def test_bad_serve_arguments_are_refused():
    for args, message in [
        (["--port", "70000"], "--port must be in [0, 65535]"),
        (["--num-draft", "0"], "--num-draft must be >= 1"),
        (["--speculate", "bogus"], "--speculate must be"),
    ]:
        result = subprocess.run(
            [*COMMAND, *args], cwd=REPO, capture_output=True, text=True, timeout=120
        )
        assert result.returncode == 2 and message in result.stderr, (args, result.stderr)


def test_a_client_gone_before_the_whole_answer_aborts_its_request(live_server):
    """No stream: the server notices the closed connection and aborts."""
    host, port = live_server.url.removeprefix("http://").split(":")
    body = json.dumps(
        {"prompt": "Count to a thousand:", "max_tokens": 2000, "ignore_eos": True}
    ).encode()
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    with socket.create_connection((host, int(port))) as connection:
        connection.sendall(request)
        deadline = time.monotonic() + 30
        while not live_server.engine.has_unfinished():  # generating now
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.02)
    # 2000 tokens take minutes on a CPU: finishing in seconds means it was aborted.
    live_server.wait_idle(timeout=20)
    assert live_server.free_blocks() == live_server.total_blocks()
