"""Through the server (issues 40 and 60): 16 seeded, sampled requests with logprobs,
sent alone, together, staggered and beside a long prompt, give the same bits each
time on `decodespec serve` with its defaults, no option, in the file's format and in
float32 (`tests/benchmarks/determinism.py`)."""

from __future__ import annotations

import asyncio

import pytest

from tests.benchmarks import determinism
from tests.serve.live import MODEL, LiveServer


@pytest.mark.parametrize("weights", ["auto", "float32"])
def test_seeded_requests_give_the_same_bits_whatever_else_the_server_runs(weights):
    args = determinism.parse_args(["--requests", "16", "--max-tokens", "8", "--stagger-ms", "40"])
    with LiveServer(weights) as server:
        assert server.engine.batch_invariant and "by construction" in server.engine.path
        measured = asyncio.run(determinism.run_phases(server.base_url, MODEL, args))
    for name, phase in measured["phases"].items():
        assert phase["bitwise"] == phase["requests"] == 16, (name, phase)
