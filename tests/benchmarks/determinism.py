"""`make bench-determinism`: is a seeded request's answer a function of the request alone?

Sends N seeded, sampled chat requests with `top_logprobs` to an OpenAI-compatible
server in four ways and compares every answer with the same request's first
answer sent alone, bitwise: each token and each logprob, alternatives included,
exactly as the JSON carried them (issue 40, part 5):

- alone: one request at a time, twice (does the server repeat itself at all?);
- together: all N at once;
- staggered: all N, each sent `--stagger-ms` after the one before;
- long: all N at once, and a request with a long prompt arriving mid-way.

Without `--base-url` it starts decodespec's own server on 127.0.0.1 (the bundled
model, `--weights`, `--backend`, `--batch-invariant`); with it, it runs against any
server that speaks the chat completions API with `seed` and `logprobs` (llama.cpp's
`llama-server`, vLLM, ...). Loopback only unless `--allow-remote`. Results:
`results/determinism-cpu.json` by default; exit status 1 when any answer differs
from its alone answer.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import httpx

from tests.benchmarks.gpu import write_json
from tests.peers import llama_build
from tests.serve import load

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = ROOT / "results" / "determinism-cpu.json"
COMMAND = "python -m tests.benchmarks.determinism"
LONG_PROMPT = "Summarise the following notes. " + "The meeting moved to Thursday. " * 60

# One answer as compared: per token, (token, logprob, ((alternative, logprob), ...)).
Answer = tuple[tuple[str, float, tuple[tuple[str, float], ...]], ...]


@dataclass(frozen=True)
class Comparison:
    """How one phase's answers compare with the alone answers, request by request."""

    requests: int
    same_tokens: int  # answers whose tokens equal the alone answer's
    bitwise: int  # answers equal in every token and every logprob
    max_logprob_difference: float  # over the answers with the same tokens
    first_divergence: list[int | None]  # per request: the first token that differs

    def as_dict(self) -> dict:
        return {
            "requests": self.requests,
            "same_tokens": self.same_tokens,
            "bitwise": self.bitwise,
            "max_logprob_difference": self.max_logprob_difference,
            "first_divergence": self.first_divergence,
        }


def answer_of(response: dict) -> Answer:
    """The tokens and logprobs of a chat completion's first choice."""
    content = response["choices"][0]["logprobs"]["content"]
    return tuple(
        (
            entry["token"],
            float(entry["logprob"]),
            tuple((alt["token"], float(alt["logprob"])) for alt in entry["top_logprobs"]),
        )
        for entry in content
    )


def compare(reference: Sequence[Answer], answers: Sequence[Answer]) -> Comparison:
    """Each answer against the reference answer of the same request.

    Example:
        >>> a = (("x", -0.5, (("x", -0.5),)),)
        >>> b = (("x", -0.25, (("x", -0.25),)),)
        >>> compare([a, a], [a, b]).as_dict()["bitwise"], compare([a], [b]).max_logprob_difference
        (1, 0.25)
    """
    same_tokens = bitwise = 0
    largest = 0.0
    divergence: list[int | None] = []
    for expected, got in zip(reference, answers, strict=True):
        tokens = [t for t, _, _ in expected], [t for t, _, _ in got]
        first = next((i for i, (a, b) in enumerate(zip(*tokens, strict=False)) if a != b), None)
        if first is None and len(tokens[0]) != len(tokens[1]):
            first = min(len(tokens[0]), len(tokens[1]))
        divergence.append(first)
        if first is not None:
            continue
        same_tokens += 1
        bitwise += expected == got
        for (_, lp_a, alts_a), (_, lp_b, alts_b) in zip(expected, got, strict=True):
            largest = max(largest, abs(lp_a - lp_b))
            for (_, x), (_, y) in zip(alts_a, alts_b, strict=False):
                largest = max(largest, abs(x - y))
    return Comparison(len(reference), same_tokens, bitwise, largest, divergence)


def request_body(model: str, prompt: str, seed: int, args: argparse.Namespace) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "seed": seed,
        "logprobs": True,
        "top_logprobs": args.top_logprobs,
    }


async def send(client: httpx.AsyncClient, body: dict, delay_s: float = 0.0) -> dict:
    if delay_s:
        await asyncio.sleep(delay_s)
    response = await client.post("/chat/completions", json=body)
    if response.status_code != 200:
        raise SystemExit(f"HTTP {response.status_code} for seed {body['seed']}: {response.text}")
    return response.json()


async def run_phases(base_url: str, model: str, args: argparse.Namespace) -> dict:
    prompts = [load.PROMPTS[i % len(load.PROMPTS)] for i in range(args.requests)]
    bodies = [request_body(model, p, 1000 + i, args) for i, p in enumerate(prompts)]
    long_body = {**request_body(model, LONG_PROMPT, 7, args), "max_tokens": 8}
    async with load.client(base_url, args.requests + 1) as client:

        async def alone() -> list[Answer]:
            return [answer_of(await send(client, b)) for b in bodies]

        async def together(stagger_s: float = 0.0, long_at: int | None = None) -> list[Answer]:
            tasks = [send(client, b, i * stagger_s) for i, b in enumerate(bodies)]
            if long_at is not None:
                tasks.append(send(client, long_body, long_at * stagger_s))
            responses = await asyncio.gather(*tasks)
            return [answer_of(r) for r in responses[: len(bodies)]]

        started = time.perf_counter()
        reference = await alone()
        phases = {"alone again": await alone(), "together": await together()}
        stagger = args.stagger_ms / 1000
        phases["staggered"] = await together(stagger)
        phases["long prompt mid-way"] = await together(stagger, long_at=len(bodies) // 2)
        seconds = time.perf_counter() - started
    return {
        "phases": {name: compare(reference, got).as_dict() for name, got in phases.items()},
        "seconds": round(seconds, 1),
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", help="an OpenAI-compatible /v1 URL (default: start ours)")
    parser.add_argument("--model", default=load.MODEL, help="the model name to send")
    parser.add_argument("--allow-remote", action="store_true", help="allow a non-loopback URL")
    parser.add_argument(
        "--weights", default="auto", help="our server's weight format (default the file's)"
    )
    parser.add_argument("--backend", default=None, help="our server's backend")
    parser.add_argument(
        "--batch-invariant", action="store_true", help="our server with --batch-invariant"
    )
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-logprobs", type=int, default=5)
    parser.add_argument("--stagger-ms", type=float, default=150.0)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    if args.requests < 1 or args.max_tokens < 1 or not math.isfinite(args.stagger_ms):
        parser.error("--requests and --max-tokens must be >= 1, --stagger-ms finite")
    if args.base_url and not args.allow_remote:
        host = urlparse(args.base_url).hostname
        if host not in ("127.0.0.1", "localhost", "::1"):
            parser.error(f"--base-url {args.base_url}: not loopback (add --allow-remote)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.base_url:
        server_name = args.base_url
        measured = asyncio.run(run_phases(args.base_url, args.model, args))
    else:
        from tests.serve.live import LiveServer  # loads torch and the model: only here

        options = {"backend": args.backend} if args.backend else {}
        with LiveServer(
            weights=args.weights, batch_invariant=args.batch_invariant, **options
        ) as server:
            backend = server.engine.backend.name
            mode = " --batch-invariant" if args.batch_invariant else ""
            server_name = f"decodespec serve --weights {args.weights} --backend {backend}{mode}"
            measured = asyncio.run(run_phases(server.base_url, args.model, args))
    results = {
        "benchmark": "determinism",
        "command": " ".join([COMMAND, *(argv if argv is not None else sys.argv[1:])]),
        "server": server_name,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_logprobs": args.top_logprobs,
        "stagger_ms": args.stagger_ms,
        **measured,
        "cpu": llama_build.describe()["cpu"],
    }
    write_json(args.out, results)
    print(f"{server_name}: {args.requests} seeded requests, compared with each sent alone")
    for name, phase in measured["phases"].items():
        print(
            f"  {name:<20} same tokens {phase['same_tokens']:>3}/{phase['requests']}, "
            f"bitwise {phase['bitwise']:>3}/{phase['requests']}, "
            f"largest logprob difference {phase['max_logprob_difference']:.3g}"
        )
    print(f"wrote {args.out}")
    bitwise = all(p["bitwise"] == p["requests"] for p in measured["phases"].values())
    return 0 if bitwise else 1


if __name__ == "__main__":
    sys.exit(main())
