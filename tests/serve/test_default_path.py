"""`decodespec serve` as it starts by default: the bundled file in its own format
(int4, its Q4_1 blocks kept), the torch backend, the native decode step and chunked
prefill, and every answer says so (`timing.path`)."""

from __future__ import annotations

import httpx

from tests.serve import load
from tests.serve.live import LiveServer


def test_the_default_server_runs_the_files_own_format_and_says_so():
    with LiveServer() as server:
        assert server.engine.weights.output is not None
        bodies = [load.body(prompt, max_tokens=8, stream=False) for prompt in load.PROMPTS[:3]]
        with httpx.Client(base_url=server.base_url, timeout=120) as client:
            answers = [client.post("/completions", json=body).json() for body in bodies]
    for answer in answers:
        path = answer["timing"]["path"]
        assert path.startswith("projections int4 g32 ×210, int8 ×1"), path
        assert "backend torch" in path and "token budget 128" in path, path
        assert "native step" in path, path
        assert answer["usage"]["completion_tokens"] >= 1
