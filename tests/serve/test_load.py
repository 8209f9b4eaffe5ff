"""The server under load: 16 concurrent streaming clients over loopback.

- Every request completes, and each stream's text is exactly that of its
  non-streamed twin (same prompt, parameters and seed), sent alongside it:
  the batch a request shares does not change its tokens. Afterwards no cache
  block is held.
- A client that goes away mid-stream aborts its request: the engine ends it
  (finish reason "abort") long before its token budget, and its blocks go back.

Throughput (16 streams against one, and against the engine driven in-process)
is a measurement, not a pass/fail condition: `make bench-serve` measures it,
prints each bound beside its figure and records "met" in results/serve-cpu.json.
A test that asserted a speed would fail on a slower or busier machine.

The load is bounded in count (16 clients) and in time (each run has a
deadline; `tests/serve/load.py` fails it clearly when overstayed).
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from tests.serve import load
from tests.serve.live import LiveServer

CLIENTS = 16
DEADLINE_S = 120.0  # "it did not hang": every run of this file takes a few seconds


def assert_no_leak(server: LiveServer) -> None:
    server.wait_idle()
    assert server.free_blocks() == server.total_blocks(), "cache blocks leaked"


def test_concurrent_streams_equal_their_non_streamed_twins(live_server):
    """16 sampled streams (different seeds, both endpoints) and their 16 non-streamed
    twins, all 32 in flight together."""
    requests = [
        (
            prompt,
            load.body(
                prompt,
                temperature=0.8,
                top_p=0.95,
                seed=1000 + i,
                ignore_eos=False,
                chat=i % 2 == 1,
            ),
        )
        for i, prompt in enumerate(load.PROMPTS[:CLIENTS])
    ]

    async def streams_and_twins() -> tuple[load.LoadRun, load.LoadRun]:
        url = live_server.base_url
        return await asyncio.gather(
            load.run_load_async(url, requests, CLIENTS, DEADLINE_S),
            load.run_load_async(url, requests, CLIENTS, DEADLINE_S, stream=False),
        )

    streamed, whole = asyncio.run(streams_and_twins())

    assert not load.failures(streamed), load.failures(streamed)
    assert not load.failures(whole), load.failures(whole)
    for (prompt, request), stream, twin in zip(
        requests, streamed.results, whole.results, strict=True
    ):
        assert stream.finish_reason in ("length", "stop"), prompt
        assert stream.seed == twin.seed == request["seed"], prompt
        assert stream.text == twin.text, prompt
        assert stream.finish_reason == twin.finish_reason, prompt
        assert stream.output_tokens == twin.output_tokens, prompt
        assert 0 < stream.output_tokens <= load.MAX_TOKENS, prompt
        assert stream.ttft_s is not None and stream.server_timing["ttft_s"] is not None
    assert len({r.text for r in streamed.results}) == CLIENTS, "different prompts, different texts"
    assert_no_leak(live_server)


def test_a_client_that_disconnects_mid_stream_aborts_its_request(live_server, caplog):
    """Close the stream after a few chunks of a 400-token request: the engine ends the
    request with finish reason "abort", short of its 400 tokens, and every block
    comes back."""
    max_tokens = 400
    request = load.body(load.PROMPTS[0], max_tokens=max_tokens)
    seen = []  # the engine's record of the request, taken while it streams

    async def read_a_few_chunks() -> int:
        async with load.client(live_server.base_url, 1) as http:
            async with http.stream("POST", load.route(request), json=request) as response:
                assert response.status_code == 200
                chunks = 0
                async for line in response.aiter_lines():
                    if line.startswith("data: ") and '"text": ""' not in line:
                        chunks += 1
                    if chunks == 3:
                        seen.extend(live_server.engine.requests.values())
                        break  # leaving the block closes the connection
        return chunks

    with caplog.at_level(logging.INFO, logger="decodespec.serve"):
        assert asyncio.run(read_a_few_chunks()) == 3
        assert_no_leak(live_server)
    assert len(seen) == 1, "one request in flight while it streamed"
    aborted = seen[0]
    assert aborted.finish_reason == "abort", aborted.finish_reason
    assert len(aborted.output_ids) < max_tokens, "the engine generated the whole answer"
    assert any("client disconnected: aborted" in r.getMessage() for r in caplog.records)


def test_a_load_that_overstays_its_deadline_fails_clearly(live_server):
    """The driver's bound in time: unfinished streams are cancelled (so aborted) and
    the run raises, naming what was left."""
    requests = load.greedy_requests(2, max_tokens=400)
    with pytest.raises(load.LoadTimeout, match=r"2 of 2 requests .* deadline of 1 s"):
        load.run_load(live_server.base_url, requests, 2, deadline_s=1.0)
    assert_no_leak(live_server)
