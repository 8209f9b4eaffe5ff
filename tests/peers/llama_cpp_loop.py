"""The decoding loop next to llama.cpp's, on the bundled SmolLM2-135M-Instruct (Q4_1).

`compare_loop()` runs both engines on the same machine, on the same
prompts, and reports three things:

1. Tokenization: each prompt (plain text, no chat template) tokenized by
   llama.cpp (`Llama.tokenize(..., add_bos=False, special=True)`) and by
   the reference tokenizer (`Tokenizer.from_gguf`, `add_special_tokens=False`),
   whether the ids are equal and the first position where they differ.
2. Greedy decoding: `max_tokens` tokens per prompt from the same prompt ids
   (ours), llama.cpp with temperature 0 (its greedy sampler, no penalties,
   EOS not stopping the generator) and the reference `Engine` on the spec
   backend with `SamplingParams(temperature=0, max_tokens=..., ignore_eos=True)`;
   the index of the first differing token (None when all agree), both lists,
   and our two most likely tokens at that step with their logit gap (ours
   computes them for every step, `show_probs=2`, a small cost in its speed).
3. Decode speed of both in this run: tokens after the first over the time after
   the first token, summed over the prompts (llama.cpp with
   `n_threads = torch.get_num_threads()`, the same threads torch uses).

Identity of the generated tokens is not expected. The file stores the
layer weights in Q4_1 (and the tied embedding / output projection in Q8_0).
The reference engine dequantizes them to float32 once and computes every
matmul in float32 (the spec's arithmetic); llama.cpp keeps the weights
quantized and its CPU matmuls quantize the activations too (to Q8_1 blocks
for Q4_1 weights, Q8_0 for Q8_0: their `vec_dot_type`) before integer dot
products, and it orders its reductions differently. The two runs compute
slightly different logits, so wherever two candidates are within that
difference of each other the argmax can flip, and from the first flip on
the continuations are different texts (`ours_at_difference` gives our logit
gap between the two best tokens there). What the comparison shows is how
long greedy decoding stays in lockstep, not an error of either side; the
tokenizer ids, which involve no arithmetic, are expected to be equal.

`python -m tests.peers.llama_cpp_loop` prints the report as JSON.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import time
from pathlib import Path
from typing import Any

import llama_cpp
import torch

from decodespec.reference import loader
from decodespec.reference.engine import Engine
from decodespec.reference.model_files import bundled_model_path
from decodespec.spec.params import SamplingParams

PROMPTS = [
    "The capital of France is",
    " Once upon a time, there was a little robot who",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Compute 1234 + 5678 = 6912; then 6912 * 3 =",
    "Le café est très chaud aujourd'hui, et les élèves",
    "日本語のテキストと emoji 🎉 mixed together:",
    "  Leading spaces, TABS\tand\nnew lines:",
    "SELECT name, COUNT(*) FROM users WHERE age > 30 GROUP BY",
]


def open_llama(path: Path, threads: int) -> llama_cpp.Llama:
    """llama.cpp on a GGUF file: a 512-token context, `threads` for decode and prefill."""
    return llama_cpp.Llama(
        model_path=str(path),
        n_ctx=512,
        n_batch=512,
        n_threads=threads,
        n_threads_batch=threads,
        seed=0,
        verbose=False,
    )


def _first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _rate(times: list[float]) -> tuple[int, float]:
    """(tokens after the first, seconds after the first token) of one generation."""
    return len(times) - 1, (times[-1] - times[0]) if len(times) > 1 else 0.0


def llama_greedy(llm: llama_cpp.Llama, ids: list[int], max_tokens: int) -> tuple[list, list]:
    llm.reset()
    tokens: list[int] = []
    times: list[float] = []
    for token in llm.generate(ids, temp=0.0, repeat_penalty=1.0, reset=True):
        times.append(time.perf_counter())
        tokens.append(int(token))
        if len(tokens) == max_tokens:
            break
    return tokens, times


def _our_greedy(engine: Engine, ids: list[int], max_tokens: int) -> tuple[list, list, list]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    tokens: list[int] = []
    times: list[float] = []
    top2: list = []
    for event in engine.generate(ids, params):
        if event.error is not None:
            raise RuntimeError(f"reference engine failed: {event.error}")
        if event.token_id is not None:
            times.append(time.perf_counter())
            tokens.append(int(event.token_id))
            top2.append(event.candidates)
    return tokens, times, top2


def _near_tie(top2: list, first: int | None) -> dict[str, Any] | None:
    """Our two most likely tokens where the generations part, and their logit gap."""
    if first is None or first >= len(top2) or not top2[first] or len(top2[first]) < 2:
        return None
    (a, pa), (b, pb) = top2[first][:2]
    return {"top2": [[a, round(pa, 6)], [b, round(pb, 6)]], "logit_gap": math.log(pa / pb)}


def compare_loop(prompts: list[str] | None = None, max_tokens: int = 32) -> dict[str, Any]:
    """Tokenizer ids, greedy tokens and decode speed of llama.cpp and ours (module doc).

    Returns:
        {"model", "max_tokens", "threads", "versions", "prompts": [per prompt:
        "prompt", "tokenizer_equal", "tokenizer_first_difference", "llama_cpp_ids",
        "our_ids", "first_difference", "agreeing_tokens", "ours_at_difference",
        "llama_cpp_tokens", "our_tokens", "llama_cpp_text", "our_text"],
        "tokenizer_equal_all", "identical_generations", "tokens_per_s": {"llama_cpp",
        "ours"}, "seconds": {...}}
    """
    prompts = list(PROMPTS if prompts is None else prompts)
    path = bundled_model_path()
    threads = torch.get_num_threads()
    started = time.perf_counter()

    llm = open_llama(path, threads)
    weights, tokenizer = loader.load_model(path)
    # show_probs=2: each event carries our two most likely tokens (raw distribution for a
    # greedy row), to show how close the call was where the generations part.
    engine = Engine(weights, tokenizer, backend="spec", cache_tokens=2048, seed=0, show_probs=2)
    loaded = time.perf_counter()

    rows = []
    totals = {"llama_cpp": [0, 0.0], "ours": [0, 0.0]}
    for text in prompts:
        theirs = [int(t) for t in llm.tokenize(text.encode(), add_bos=False, special=True)]
        ours = tokenizer.encode(text, add_special_tokens=False)
        llama_tokens, llama_times = llama_greedy(llm, ours, max_tokens)
        our_tokens, our_times, top2 = _our_greedy(engine, ours, max_tokens)
        for name, times in (("llama_cpp", llama_times), ("ours", our_times)):
            n, seconds = _rate(times)
            totals[name][0] += n
            totals[name][1] += seconds
        first = _first_difference(llama_tokens, our_tokens)
        rows.append(
            {
                "prompt": text,
                "tokenizer_equal": theirs == ours,
                "tokenizer_first_difference": _first_difference(theirs, ours),
                "llama_cpp_ids": theirs,
                "our_ids": ours,
                "first_difference": first,
                "agreeing_tokens": len(our_tokens) if first is None else first,
                "ours_at_difference": _near_tie(top2, first),
                "llama_cpp_tokens": llama_tokens,
                "our_tokens": our_tokens,
                "llama_cpp_text": llm.detokenize(llama_tokens).decode("utf-8", "replace"),
                "our_text": tokenizer.decode(our_tokens),
            }
        )
    llm.close()
    finished = time.perf_counter()

    return {
        "model": path.name,
        "max_tokens": max_tokens,
        "threads": threads,
        "versions": {
            "llama_cpp_python": llama_cpp.__version__,
            "torch": torch.__version__,
            "decodespec": importlib.metadata.version("decodespec"),
        },
        "prompts": rows,
        "tokenizer_equal_all": all(r["tokenizer_equal"] for r in rows),
        "identical_generations": sum(r["first_difference"] is None for r in rows),
        "tokens_per_s": {
            name: (n / seconds if seconds > 0 else None) for name, (n, seconds) in totals.items()
        },
        "seconds": {
            "load": round(loaded - started, 2),
            "run": round(finished - loaded, 2),
            "decode_llama_cpp": round(totals["llama_cpp"][1], 3),
            "decode_ours": round(totals["ours"][1], 3),
        },
    }


if __name__ == "__main__":
    print(json.dumps(compare_loop(), indent=2, ensure_ascii=False))
