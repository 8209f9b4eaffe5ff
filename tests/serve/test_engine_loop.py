"""The engine loop: one engine thread serving many asyncio callers.

Requests from different callers share forward passes; each caller gets
exactly its request's events, the same as the engine alone gives; an abort
frees the request's blocks at once; a refused request raises at `submit`
and leaves the loop serving; closing ends what is unfinished with an error.
"""

from __future__ import annotations

import asyncio

import pytest

from decodespec.reference.engine import Engine
from decodespec.reference.engine_loop import EngineLoop
from decodespec.spec.params import SamplingParams
from tests.engine.toy import ByteTokenizer, random_weights, small_config

PROMPTS = [[5, 6, 7], [40, 41], [100, 101, 102, 103], [9]]


@pytest.fixture(scope="module")
def weights():
    return random_weights(small_config(max_context=96), seed=7)


def engine_of(weights) -> Engine:
    return Engine(weights, ByteTokenizer(), block_size=4, cache_tokens=512, seed=0)


def params(i: int, **overrides) -> SamplingParams:
    return SamplingParams(
        **{"temperature": 0.9, "seed": 100 + i, "max_tokens": 12, "ignore_eos": True, **overrides}
    )


def alone(weights, prompt, p) -> list[int]:
    engine = engine_of(weights)
    request_id = engine.add_request(prompt, p)
    while engine.has_unfinished():
        engine.step()
    return engine.output(request_id).token_ids


async def tokens_of(loop: EngineLoop, prompt, p) -> tuple[list[int | None], object]:
    stream = await loop.submit(prompt, p)
    return [event.token_id async for event in stream.events()], stream.output


def test_concurrent_callers_get_their_solo_tokens_and_share_passes(weights):
    engine = engine_of(weights)
    batch_sizes = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        batch = schedule()
        batch_sizes.append(len(batch))
        return batch

    engine.scheduler.schedule = recording_schedule

    async def main():
        loop = EngineLoop(engine)
        try:
            return await asyncio.gather(
                *(tokens_of(loop, prompt, params(i)) for i, prompt in enumerate(PROMPTS))
            )
        finally:
            loop.close()

    results = asyncio.run(main())
    for i, (prompt, (tokens, output)) in enumerate(zip(PROMPTS, results, strict=True)):
        expected = alone(weights, prompt, params(i))
        assert tokens == expected, f"request {i}: {tokens} != solo {expected}"
        assert output.token_ids == expected and output.finish_reason == "length"
    assert max(batch_sizes) == len(PROMPTS), f"the requests never shared a pass: {batch_sizes}"
    assert not engine.requests, "finished requests must be released"


def test_abort_ends_the_request_and_frees_its_blocks(weights):
    engine = engine_of(weights)
    total = engine.block_manager.allocator.num_blocks

    async def main():
        loop = EngineLoop(engine)
        try:
            stream = await loop.submit([1, 2, 3], params(0, max_tokens=80))
            events = []
            async for event in stream.events():
                events.append(event)
                if len(events) == 3:
                    loop.abort(stream.request_id)
            # the loop still serves others afterwards
            tokens, _ = await tokens_of(loop, [4, 5], params(1))
            return events, stream.output, tokens
        finally:
            loop.close()

    events, output, tokens = asyncio.run(main())
    assert events[-1].finish_reason == "abort" and output.finish_reason == "abort"
    assert len(output.token_ids) < 80
    assert tokens == alone(weights, [4, 5], params(1))
    assert engine.block_manager.allocator.num_free == total
    assert not engine.requests


def test_a_refused_request_raises_at_submit_and_the_loop_serves_on(weights):
    engine = engine_of(weights)

    async def main():
        loop = EngineLoop(engine)
        try:
            with pytest.raises(ValueError, match="prompt_ids"):
                await loop.submit([999], params(0))  # outside the 260-token vocabulary
            with pytest.raises(ValueError, match="max_tokens"):
                await loop.submit([1, 2], params(0, max_tokens=500))  # beyond the context
            return await tokens_of(loop, [1, 2], params(0))
        finally:
            loop.close()

    tokens, _ = asyncio.run(main())
    assert tokens == alone(weights, [1, 2], params(0))


def test_close_ends_unfinished_requests_with_an_error_and_refuses_new_ones(weights):
    engine = engine_of(weights)

    async def main():
        loop = EngineLoop(engine)
        stream = await loop.submit([1, 2, 3], params(0, max_tokens=80))
        first = await anext(stream.events())
        await asyncio.to_thread(loop.close)
        rest = [event async for event in stream.events()]
        with pytest.raises(RuntimeError, match="stopped"):
            await loop.submit([1], params(0))
        return first, rest, stream.output, loop

    first, rest, output, loop = asyncio.run(main())
    assert first.token_id is not None
    assert rest[-1].finish_reason == "error" and "shutting down" in rest[-1].error
    assert output.finish_reason == "error"
    assert not loop.alive
    assert engine.block_manager.allocator.num_free == engine.block_manager.allocator.num_blocks


def test_a_request_whose_caller_went_away_before_acceptance_is_aborted(weights):
    engine = engine_of(weights)

    async def main():
        loop = EngineLoop(engine)
        try:
            pending = asyncio.ensure_future(loop.submit([1, 2, 3], params(0, max_tokens=80)))
            await asyncio.sleep(0)  # the request is on its way to the engine thread
            pending.cancel()
            for _ in range(200):  # the engine thread accepts, then the abort lands
                await asyncio.sleep(0.01)
                if not engine.requests and not engine.has_unfinished():
                    break
        finally:
            loop.close()

    asyncio.run(main())
    assert not engine.requests and not engine.has_unfinished()
    assert engine.block_manager.allocator.num_free == engine.block_manager.allocator.num_blocks


def test_release_refuses_an_unfinished_request(weights):
    engine = engine_of(weights)
    request_id = engine.add_request([1, 2], params(0))
    with pytest.raises(ValueError, match="has not finished"):
        engine.release(request_id)
    engine.abort(request_id)
    assert engine.release(request_id).finish_reason == "abort"
    with pytest.raises(ValueError, match="no request"):
        engine.output(request_id)
