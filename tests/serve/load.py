"""The load driver of the serving test and benchmark (`tests/serve/test_load.py`,
`make bench-serve`): concurrent streaming clients over loopback, in the style
of vLLM's `benchmark_serving`.

Each client streams `/v1/completions` (or `/v1/chat/completions`) with
`httpx.AsyncClient` and records, per request, what the client saw:

- TTFT: from sending the request to the first chunk that carries text;
- inter-token latencies: the arrival gaps between chunks that carry text
  (a chunk may hold more than one token when the stream held text back);
- the output tokens (the usage chunk), the text, the finish reason, and the
  server's own `timing` and `seed`.

`run_load` opens C connections (`GET /models`), then sends N requests at
concurrency C (an `asyncio.Semaphore`) under one overall deadline: the load
is bounded in count and in time, and a run that overstays its deadline
raises `LoadTimeout` naming what was unfinished.
`summarize` gives vLLM's figures: completed, duration, output tokens, output
tokens/s, TTFT mean/p50/p99 and ITL p50/p99 in milliseconds.

`in_process` is the baseline the server is held to: the same prompts through
an `Engine` in this process, all added at once and stepped until done.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx
import torch

from decodespec.reference.backend import DEFAULT_BACKEND
from decodespec.reference.engine import Engine
from decodespec.spec.forward import ModelWeights
from decodespec.spec.params import SamplingParams

MODEL = "smollm2"
MAX_TOKENS = 32
# Short prompts, all different, of similar lengths: one per client of a 16-way load.
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "To make a cup of tea, first",
    "The largest planet in our solar system is",
    "A haiku about autumn leaves:",
    "The main ingredients of bread are",
    "In computer science, a linked list is",
    "The quick brown fox jumps over",
    "My favourite season of the year is",
    "Water boils at a temperature of",
    "The first step in learning to swim is",
    "A good name for a pet dragon would be",
    "The moon orbits the Earth every",
    "Photosynthesis is the process by which",
    "The best way to learn a new language is",
]
# Bounds on any single HTTP exchange; the run as a whole has its own deadline.
TIMEOUT = httpx.Timeout(connect=10.0, read=120.0, write=10.0, pool=120.0)


class LoadTimeout(AssertionError):
    """The load did not finish within its deadline."""


@dataclass
class Result:
    """What one client saw of one request."""

    prompt: str
    body: dict
    ok: bool = False
    error: str | None = None
    status: int | None = None
    text: str = ""
    finish_reason: str | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    latency_s: float | None = None
    chunks: int = 0
    seed: int | None = None
    server_timing: dict | None = None


@dataclass
class LoadRun:
    """The results of one run, in request order, and its wall time."""

    concurrency: int
    results: list[Result]
    duration_s: float


def body(
    prompt: str,
    *,
    max_tokens: int = MAX_TOKENS,
    temperature: float = 0.0,
    seed: int | None = None,
    stream: bool = True,
    chat: bool = False,
    **extra: object,
) -> dict:
    """A request body; greedy and `ignore_eos` by default, so that each request gives
    exactly `max_tokens` tokens. Extra fields (top_p, top_k, ...) pass through."""
    request: dict = {"model": MODEL, "max_tokens": max_tokens, "temperature": temperature}
    if chat:
        request["messages"] = [{"role": "user", "content": prompt}]
    else:
        request["prompt"] = prompt
    if seed is not None:
        request["seed"] = seed
    if stream:
        request |= {"stream": True, "stream_options": {"include_usage": True}}
    return {"ignore_eos": True, **request, **extra}


def route(request: dict) -> str:
    """The endpoint, under the client's `base_url` (the server's `/v1`)."""
    return "/chat/completions" if "messages" in request else "/completions"


def client(base_url: str, concurrency: int) -> httpx.AsyncClient:
    """A loopback client: no proxies from the environment, bounded timeouts, and a
    connection per concurrent request."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    return httpx.AsyncClient(base_url=base_url, trust_env=False, timeout=TIMEOUT, limits=limits)


def _content(chunk: dict) -> str:
    """The text a stream chunk carries ("" for the role, finish and usage chunks)."""
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        return choice["delta"].get("content") or ""
    return choice.get("text") or ""


async def stream_one(http: httpx.AsyncClient, prompt: str, request: dict) -> Result:
    """Stream one request and record what arrives, and when."""
    result = Result(prompt, request)
    start = time.perf_counter()
    last = None
    parts = []
    try:
        async with http.stream("POST", route(request), json=request) as response:
            result.status = response.status_code
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:500]!r}"
                return result
            done = False
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"error chunk: {chunk['error']}"
                    return result
                now = time.perf_counter()
                text = _content(chunk)
                if text:
                    if last is None:
                        result.ttft_s = now - start
                    else:
                        result.itl_s.append(now - last)
                    last = now
                    result.chunks += 1
                    parts.append(text)
                for choice in chunk.get("choices") or []:
                    if choice.get("finish_reason") is not None:
                        result.finish_reason = choice["finish_reason"]
                        result.server_timing = chunk.get("timing")
                        result.seed = chunk.get("seed")
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
            if not done:
                result.error = "the stream ended without data: [DONE]"
                return result
    except httpx.HTTPError as error:
        result.error = f"{type(error).__name__}: {error}"
        return result
    result.latency_s = time.perf_counter() - start
    result.text = "".join(parts)
    result.ok = result.finish_reason in ("length", "stop")
    if not result.ok:
        result.error = f"finish_reason {result.finish_reason!r}"
    return result


async def whole_one(http: httpx.AsyncClient, prompt: str, request: dict) -> Result:
    """One non-streamed request (`stream` false): its text, finish reason and usage."""
    request = {k: v for k, v in request.items() if k not in ("stream", "stream_options")}
    result = Result(prompt, request)
    start = time.perf_counter()
    try:
        response = await http.post(route(request), json=request)
    except httpx.HTTPError as error:
        result.error = f"{type(error).__name__}: {error}"
        return result
    result.status = response.status_code
    if response.status_code != 200:
        result.error = f"HTTP {response.status_code}: {response.text[:500]}"
        return result
    answer = response.json()
    choice = answer["choices"][0]
    result.latency_s = time.perf_counter() - start
    result.text = choice["message"]["content"] if "message" in choice else choice["text"]
    result.finish_reason = choice["finish_reason"]
    result.output_tokens = answer["usage"]["completion_tokens"]
    result.prompt_tokens = answer["usage"]["prompt_tokens"]
    result.seed = answer.get("seed")
    result.server_timing = answer.get("timing")
    result.ok = result.finish_reason in ("length", "stop")
    if not result.ok:
        result.error = f"finish_reason {result.finish_reason!r}"
    return result


async def run_load_async(
    base_url: str,
    requests: Sequence[tuple[str, dict]],
    concurrency: int,
    deadline_s: float,
    *,
    stream: bool = True,
) -> LoadRun:
    """Send `requests` ((prompt, body) pairs), at most `concurrency` at a time, and wait
    for all of them; `LoadTimeout` if they are not all done within `deadline_s`."""
    gate = asyncio.Semaphore(concurrency)
    send = stream_one if stream else whole_one

    async with client(base_url, concurrency) as http:
        # Open the connections before the clock starts, as a client's pool keeps
        # them: the run times the server, not TCP handshakes.
        opened = await asyncio.gather(*(http.get("/models") for _ in range(concurrency)))
        assert all(response.status_code == 200 for response in opened)

        async def one(prompt: str, request: dict) -> Result:
            async with gate:
                return await send(http, prompt, request)

        tasks = [asyncio.ensure_future(one(prompt, request)) for prompt, request in requests]
        start = time.perf_counter()
        _, pending = await asyncio.wait(tasks, timeout=deadline_s)
        duration = time.perf_counter() - start
        if pending:
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            raise LoadTimeout(
                f"{len(pending)} of {len(tasks)} requests (concurrency {concurrency}) "
                f"unfinished after the deadline of {deadline_s:.0f} s"
            )
    return LoadRun(concurrency, [task.result() for task in tasks], duration)


def run_load(
    base_url: str,
    requests: Sequence[tuple[str, dict]],
    concurrency: int,
    deadline_s: float = 120.0,
    *,
    stream: bool = True,
) -> LoadRun:
    """`run_load_async` on an event loop of its own (from synchronous code)."""
    return asyncio.run(run_load_async(base_url, requests, concurrency, deadline_s, stream=stream))


def greedy_requests(count: int, max_tokens: int = MAX_TOKENS) -> list[tuple[str, dict]]:
    """`count` greedy streamed requests of `max_tokens` tokens, cycling over `PROMPTS`."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(count)]
    return [(prompt, body(prompt, max_tokens=max_tokens)) for prompt in prompts]


# ---------------------------------------------------------------- summaries


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100), linearly interpolated as numpy's default; None
    for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _ms(value: float | None) -> float | None:
    return None if value is None else value * 1000


def summarize(run: LoadRun) -> dict:
    """vLLM's `benchmark_serving` figures for one run (times in milliseconds)."""
    completed = [r for r in run.results if r.ok]
    output_tokens = sum(r.output_tokens for r in completed)
    ttfts = [r.ttft_s for r in completed if r.ttft_s is not None]
    itls = [gap for r in completed for gap in r.itl_s]
    return {
        "concurrency": run.concurrency,
        "requests": len(run.results),
        "completed": len(completed),
        "failed": len(run.results) - len(completed),
        "duration_s": run.duration_s,
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / run.duration_s,
        "requests_per_s": len(completed) / run.duration_s,
        "ttft_ms": {
            "mean": _ms(statistics.fmean(ttfts)) if ttfts else None,
            "p50": _ms(percentile(ttfts, 50)),
            "p99": _ms(percentile(ttfts, 99)),
        },
        "itl_ms": {
            "mean": _ms(statistics.fmean(itls)) if itls else None,
            "p50": _ms(percentile(itls, 50)),
            "p99": _ms(percentile(itls, 99)),
        },
    }


def failures(run: LoadRun) -> list[str]:
    """One line per request that did not complete."""
    return [f"{r.prompt!r}: {r.error}" for r in run.results if not r.ok]


# ---------------------------------------------------------------- the in-process baseline


def in_process(
    weights: ModelWeights,
    tokenizer: object,
    prompts: Sequence[str],
    max_tokens: int = MAX_TOKENS,
    cache_tokens: int = 4096,
    backend: str = DEFAULT_BACKEND,
    **engine_options: object,
) -> float:
    """Aggregate output tokens/s of `prompts` (greedy, `ignore_eos`, `max_tokens` each)
    through a fresh `Engine` in this process: all added at once, stepped until done.
    The prompts are encoded as `/v1/completions` encodes a string prompt; the
    backend is the server's; `engine_options` go to the `Engine`."""
    engine = Engine(
        weights, tokenizer, seed=0, cache_tokens=cache_tokens, backend=backend, **engine_options
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [tokenizer.encode(prompt) for prompt in prompts]
    with torch.inference_mode():
        start = time.perf_counter()
        requests = [engine.add_request(prompt_ids, params) for prompt_ids in ids]
        while engine.has_unfinished():
            engine.step()
        duration = time.perf_counter() - start
    tokens = sum(engine.output(r).completion_tokens for r in requests)
    assert tokens == max_tokens * len(prompts), "ignore_eos: every request gives max_tokens"
    return tokens / duration
