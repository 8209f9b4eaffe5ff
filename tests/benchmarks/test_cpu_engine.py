"""CPU benchmark of the engine on the bundled model: `make bench-cpu`.

Measured in one process, on the same float32 weights (the bundled GGUF,
dequantized), the same prompt and the same thread count:

- the machine's limit for decode: the bytes of weights one token reads
  (every matrix once) over the measured matrix-vector bandwidth;
- prefill and decode tokens/s of the cached engine and of Hugging Face
  `generate` (greedy, KV cache);
- the per-token cost of naive decode (recompute the whole sequence) and of
  cached decode as the sequence grows.

Each measurement is a pytest-benchmark test (minimum over rounds, so noise
from the rest of the machine only ever makes a number worse); the summary,
with ratios, goes to `results/cpu-engine.json` (or DECODESPEC_BENCH_OUT).
These tests only run with `--benchmarks`.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
from pathlib import Path

import pytest
import torch

from decodespec.reference.engine import Engine
from decodespec.reference.loader import load_model
from decodespec.reference.model_files import bundled_model_path
from decodespec.spec.params import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(os.environ.get("DECODESPEC_BENCH_OUT", ROOT / "results" / "cpu-engine.json"))
THREADS = [int(t) for t in os.environ.get("DECODESPEC_BENCH_THREADS", "1,2").split(",")]
PROMPT_TOKENS = 128
DECODE_TOKENS = 32
LENGTHS = [32, 128, 256, 512, 1024]
SUMMARY: dict = {"runs": {}, "naive_vs_cached": {}}

pytestmark = pytest.mark.filterwarnings("ignore")


def cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    for line in cpuinfo.read_text().splitlines() if cpuinfo.exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def cpu_report_header(benchmark: str, command: str, smoke_note: str | None) -> dict:
    """How a CPU results file starts: the benchmark, its command, whether it was a
    smoke run (and the note saying so), when, on which CPU and software."""
    return {
        "benchmark": benchmark,
        "command": command,
        "smoke": smoke_note is not None,
        **({"note": smoke_note} if smoke_note is not None else {}),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": cpu_name(),
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "software": {"python": platform.python_version(), "torch": torch.__version__},
    }


@pytest.fixture(scope="module")
def model():
    return load_model(bundled_model_path())


@pytest.fixture(scope="module")
def peer():
    from tests.engine.checkpoints import hf_model_from_gguf

    return hf_model_from_gguf(bundled_model_path())


@pytest.fixture(scope="module")
def prompt(model):
    _, tokenizer = model
    text = "The quick brown fox jumps over the lazy dog. " * 40
    return tokenizer.encode(text)[:PROMPT_TOKENS]


@pytest.fixture(params=THREADS, ids=lambda t: f"{t}threads")
def threads(request):
    previous = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(previous)


def best(benchmark) -> float:
    return benchmark.stats.stats.min


def test_matvec_limit(benchmark, model, threads):
    """Every weight matrix times a vector: the bytes of one decode token."""
    weights, _ = model
    matrices = [weights.output]
    for layer in weights.layers:
        matrices += [layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj]
        matrices += [layer.gate_proj, layer.up_proj, layer.down_proj]
    vectors = {m.shape[1]: torch.randn(1, m.shape[1]) for m in matrices}
    nbytes = sum(m.numel() * m.element_size() for m in matrices)

    def read_all():
        for m in matrices:
            vectors[m.shape[1]] @ m.T

    benchmark.pedantic(read_all, rounds=8, warmup_rounds=2)
    run = SUMMARY["runs"].setdefault(str(threads), {"threads": threads})
    run["weights_bytes_per_token"] = nbytes
    run["matvec_bandwidth_GBps"] = nbytes / best(benchmark) / 1e9
    run["decode_limit_tokens_per_s"] = 1 / best(benchmark)


def _engine_after_prefill(model, prompt):
    weights, tokenizer = model
    engine = Engine(weights, tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=DECODE_TOKENS + 8, ignore_eos=True)
    engine.add_request(prompt, params)
    return engine


def test_ours_prefill(benchmark, model, prompt, threads):
    def setup():
        return (_engine_after_prefill(model, prompt),), {}

    benchmark.pedantic(lambda engine: engine.step(), setup=setup, rounds=5, warmup_rounds=1)
    run = SUMMARY["runs"].setdefault(str(threads), {"threads": threads})
    run["ours_prefill_tokens_per_s"] = len(prompt) / best(benchmark)


def test_ours_decode(benchmark, model, prompt, threads):
    def setup():
        engine = _engine_after_prefill(model, prompt)
        engine.step()  # prefill and the first token
        return (engine,), {}

    def decode(engine):
        for _ in range(DECODE_TOKENS):
            engine.step()

    benchmark.pedantic(decode, setup=setup, rounds=3, warmup_rounds=1)
    run = SUMMARY["runs"].setdefault(str(threads), {"threads": threads})
    run["ours_decode_tokens_per_s"] = DECODE_TOKENS / best(benchmark)


def _hf_generate(peer, prompt, new_tokens: int) -> None:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        peer.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
        )


def test_hf_prefill(benchmark, peer, prompt, threads):
    benchmark.pedantic(_hf_generate, args=(peer, prompt, 1), rounds=5, warmup_rounds=1)
    run = SUMMARY["runs"].setdefault(str(threads), {"threads": threads})
    run["hf_prefill_s"] = best(benchmark)
    run["hf_prefill_tokens_per_s"] = len(prompt) / best(benchmark)


def test_hf_decode(benchmark, peer, prompt, threads):
    """`generate` of 1 + DECODE_TOKENS tokens; the prefill's time is taken off."""
    benchmark.pedantic(
        _hf_generate, args=(peer, prompt, 1 + DECODE_TOKENS), rounds=3, warmup_rounds=1
    )
    run = SUMMARY["runs"][str(threads)]
    run["hf_decode_tokens_per_s"] = DECODE_TOKENS / (best(benchmark) - run["hf_prefill_s"])


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("naive", [False, True], ids=["cached", "naive"])
def test_per_token_cost(benchmark, model, length, naive):
    """One decode step at sequence length `length`, with and without the KV cache."""
    weights, tokenizer = model
    torch.set_num_threads(THREADS[0])
    ids = (list(range(1000, 1000 + length)) * 2)[:length]

    def setup():
        engine = Engine(weights, tokenizer, naive=naive)
        engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        engine.step()  # the prompt (the cached engine's prefill)
        return (engine,), {}

    benchmark.pedantic(lambda engine: engine.step(), setup=setup, rounds=3)
    point = SUMMARY["naive_vs_cached"].setdefault(str(length), {"length": length})
    point["naive_ms" if naive else "cached_ms"] = best(benchmark) * 1e3


def test_write_summary():
    """Ratios and the results file (runs last: pytest keeps file order)."""
    import transformers

    runs = list(SUMMARY["runs"].values())
    for run in runs:
        if "ours_decode_tokens_per_s" in run and "decode_limit_tokens_per_s" in run:
            run["ours_decode_fraction_of_limit"] = (
                run["ours_decode_tokens_per_s"] / run["decode_limit_tokens_per_s"]
            )
        if "hf_decode_tokens_per_s" in run:
            run["ours_decode_over_hf"] = (
                run["ours_decode_tokens_per_s"] / run["hf_decode_tokens_per_s"]
            )
            run["ours_prefill_over_hf"] = (
                run["ours_prefill_tokens_per_s"] / run["hf_prefill_tokens_per_s"]
            )
    summary = {
        "benchmark": "cpu-engine",
        "command": "make bench-cpu",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": cpu_name(),
        "cores": os.cpu_count(),
        "software": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "model": "SmolLM2-135M-Instruct (bundled GGUF, Q4_1/Q8_0 dequantized to float32)",
        "prompt_tokens": PROMPT_TOKENS,
        "decode_tokens": DECODE_TOKENS,
        "statistic": "best of rounds",
        "runs": runs,
        "naive_vs_cached": sorted(SUMMARY["naive_vs_cached"].values(), key=lambda p: p["length"]),
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    assert runs, "no measurement ran"
