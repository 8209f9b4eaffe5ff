"""Through the server (issue 40, part 5): 16 seeded, sampled requests with logprobs,
sent alone, together, staggered and beside a long prompt, give the same bits each
time on `decodespec serve --batch-invariant` (`tests/benchmarks/determinism.py`)."""

from __future__ import annotations

import asyncio

from tests.benchmarks import determinism
from tests.serve.live import MODEL, LiveServer


def test_seeded_requests_give_the_same_bits_whatever_else_the_server_runs():
    args = determinism.parse_args(["--requests", "16", "--max-tokens", "8", "--stagger-ms", "40"])
    with LiveServer(batch_invariant=True) as server:
        measured = asyncio.run(determinism.run_phases(server.base_url, MODEL, args))
    for name, phase in measured["phases"].items():
        assert phase["bitwise"] == phase["requests"] == 16, (name, phase)
