"""CPU benchmark of the weight formats: `make bench-quant` → results/quant-cpu.json.

The trade-off quantization makes, measured in one run on the bundled GGUF
(SmolLM2-135M-Instruct, Q4_1 projections and a Q8_0 embedding), with the same
thread count for everything:

- speed: decode tokens/s of the engine (torch backend, one greedy request,
  `DECODE_TOKENS` tokens after a `PROMPT_TOKENS`-token prompt) in each format,
  and of llama.cpp (llama-cpp-python) on the same file, the same prompt ids
  and the same threads; rounds interleave the five so that the machine's
  noise falls on all of them, and each keeps its best round;
- memory: the bytes each format's weights hold (`weight_formats.weight_bytes`);
- quality: `decodespec perplexity` on the default text (Python's help texts,
  20,480 tokens in windows of 512): perplexity, KL divergence to float32
  (mean, median, p99, max) and top-1 agreement.

Targets (issue 29): int4 decodes at least 100 tokens/s and at least 0.6× llama.cpp.
`--smoke` runs a few tokens and one short window: a check that the command
works, not a measurement.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from decodespec.reference.engine import Engine
from decodespec.reference.loader import load_formats
from decodespec.reference.model_files import bundled_model_path
from decodespec.reference.perplexity import DEFAULT_TEXT, default_text, format_table, score_formats
from decodespec.reference.weight_formats import WEIGHT_FORMATS, describe, weight_bytes
from decodespec.spec.params import SamplingParams
from tests.benchmarks.test_cpu_engine import cpu_report_header
from tests.peers.llama_cpp_loop import llama_greedy, open_llama

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "results" / "quant-cpu.json"
COMMAND = "make bench-quant"
PROMPT_TOKENS = 32
DECODE_TOKENS = 64
ROUNDS = 3
SMOKE_NOTE = "--smoke: 4 tokens, one round, one window of 64 tokens: not measurements"
TARGET_TOKENS_PER_S = 100.0
TARGET_RATIO = 0.6


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.benchmarks.quant")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help=SMOKE_NOTE)
    return parser.parse_args(argv)


def prompt_ids(tokenizer) -> list[int]:
    text = "The history of the printing press begins in the fifteenth century, when " * 4
    return tokenizer.encode(text, add_special_tokens=False)[:PROMPT_TOKENS]


def ours_decode(engine: Engine, ids: list[int], tokens: int) -> tuple[float, list[int]]:
    """Decode tokens/s after the first token, and the tokens, of one greedy request."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    times, out = [], []
    for event in engine.generate(ids, params):
        if event.error is not None:
            raise RuntimeError(event.error)
        if event.token_id is not None:
            times.append(time.perf_counter())
            out.append(int(event.token_id))
    return (len(times) - 1) / (times[-1] - times[0]), out


def llama_cpp_system_info() -> str:
    """The instruction sets this build of llama.cpp uses, in its own words."""
    import llama_cpp

    return llama_cpp.llama_print_system_info().decode().strip()


def llama_cpp_decode(llm, ids: list[int], tokens: int) -> tuple[float, list[int]]:
    """llama.cpp's decode tokens/s after the first token, and the tokens (greedy)."""
    out, times = llama_greedy(llm, ids, tokens)
    return (len(times) - 1) / (times[-1] - times[0]), out


def measure_speed(path: Path, threads: int, tokens: int, rounds: int) -> dict:
    """Best-of-rounds decode tokens/s per format and llama.cpp's, with memory."""
    models, tokenizer = load_formats(path, WEIGHT_FORMATS, progress=lambda _m: None)
    engines = {
        name: Engine(weights, tokenizer, backend="torch", cache_tokens=1024, seed=0)
        for name, weights in models.items()
    }
    del models
    llm, version = open_llama(path, threads), importlib.metadata.version("llama-cpp-python")
    ids = prompt_ids(tokenizer)
    best: dict[str, float] = {}
    outputs: dict[str, list[int]] = {}
    for round_number in range(rounds):
        for name, engine in engines.items():
            rate, outputs[name] = ours_decode(engine, ids, tokens)
            best[name] = max(best.get(name, 0.0), rate)
            print(f"round {round_number + 1}: {name} {rate:.1f} tokens/s", file=sys.stderr)
        rate, outputs["llama.cpp"] = llama_cpp_decode(llm, ids, tokens)
        best["llama.cpp"] = max(best.get("llama.cpp", 0.0), rate)
        print(f"round {round_number + 1}: llama.cpp {rate:.1f} tokens/s", file=sys.stderr)
    formats = {
        name: {
            "decode_tokens_per_s": best[name],
            "over_llama_cpp": best[name] / best["llama.cpp"],
            "weight_bytes": weight_bytes(engine.weights),
            "layout": describe(engine.weights),
            # the torch backend's decode step in C between the kernels (native_step.py)
            "native_step": engine.runner.native is not None,
            "greedy_tokens_equal_to_float32": sum(
                a == b for a, b in zip(outputs[name], outputs["float32"], strict=True)
            ),
        }
        for name, engine in engines.items()
    }
    return {
        "prompt_tokens": len(ids),
        "decode_tokens": tokens,
        "rounds": rounds,
        "llama_cpp": {
            "version": version,
            "decode_tokens_per_s": best["llama.cpp"],
            "system_info": llama_cpp_system_info(),
        },
        "formats": formats,
    }


def targets(speed: dict) -> list[dict]:
    int4 = speed["formats"]["int4"]
    return [
        {
            "target": f"int4 decodes >= {TARGET_TOKENS_PER_S:.0f} tokens/s",
            "measured": int4["decode_tokens_per_s"],
            "met": int4["decode_tokens_per_s"] >= TARGET_TOKENS_PER_S,
        },
        {
            "target": f"int4 >= {TARGET_RATIO}x llama.cpp's decode tokens/s",
            "measured": int4["over_llama_cpp"],
            "met": int4["over_llama_cpp"] >= TARGET_RATIO,
        },
    ]


def print_report(report: dict) -> None:
    speed = report["speed"]
    print(
        f"decode tokens/s, {report['threads']} threads (llama.cpp "
        f"{speed['llama_cpp']['decode_tokens_per_s']:.1f}):"
    )
    for name, row in speed["formats"].items():
        print(
            f"  {name:<9} {row['decode_tokens_per_s']:7.1f} tokens/s  "
            f"{row['over_llama_cpp']:5.2f}x llama.cpp  {row['weight_bytes'] / 1e6:7.1f} MB"
        )
    print(format_table(report["quality"]))
    for target in report["targets"]:
        print(
            f"{'met' if target['met'] else 'NOT met'}: {target['target']} "
            f"(measured {target['measured']:.2f})"
        )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    path = bundled_model_path()
    tokens, rounds = (4, 1) if args.smoke else (DECODE_TOKENS, ROUNDS)
    speed = measure_speed(path, args.threads, tokens, rounds)
    quality = score_formats(
        path,
        WEIGHT_FORMATS,
        default_text(),
        context=64 if args.smoke else 512,
        max_tokens=64 if args.smoke else 20_480,
        progress=lambda message: message.startswith("window") and print(message, file=sys.stderr),
    )
    quality["text"] = DEFAULT_TEXT
    report = {
        **cpu_report_header(
            "quant-cpu", " ".join([COMMAND, *(argv or [])]), SMOKE_NOTE if args.smoke else None
        ),
        "model": f"SmolLM2-135M-Instruct ({path.name}: Q4_1 projections, Q8_0 embedding)",
        "speed": speed,
        "quality": quality,
    }
    report["targets"] = targets(speed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print_report(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
