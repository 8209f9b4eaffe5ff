"""llama-cpp-python in a process of its own, for `versus_llama`'s in-process comparisons.

    python -m tests.benchmarks.llama_cpp_child MODEL THREADS

llama.cpp and PyTorch load the same OpenMP runtime (`libgomp.so.1`), which
reads `OMP_WAIT_POLICY` once per process. decodespec runs with PASSIVE (its
command sets it: PyTorch's threads must not spin on the core its C product
needs); llama.cpp decodes about a third slower with it (51 against 72 tokens/s
measured on a 2-core machine). So llama.cpp runs here, in the environment the
benchmark started with, and answers one JSON line per request on stdin:
`{"op": "decode", "ids": [...], "tokens": N}` -> `{"rate": tokens/s, "tokens": [...]}`,
`{"op": "prefill", "ids": [...]}` -> `{"rate": prompt tokens/s}`.
"""

from __future__ import annotations

import json
import sys
import time

import llama_cpp

from tests.peers.llama_cpp_loop import llama_greedy


def decode(llm: llama_cpp.Llama, ids: list[int], tokens: int) -> dict:
    """Greedy decode tokens/s after the first token, and the tokens."""
    out, times = llama_greedy(llm, ids, tokens)
    return {"rate": (len(times) - 1) / (times[-1] - times[0]), "tokens": out}


def prefill(llm: llama_cpp.Llama, ids: list[int]) -> dict:
    """Prompt tokens/s: from an empty context to the first generated token."""
    llm.reset()
    start = time.perf_counter()
    for _token in llm.generate(ids, temp=0.0, repeat_penalty=1.0, reset=True):
        return {"rate": len(ids) / (time.perf_counter() - start)}
    raise RuntimeError("no token")


def main() -> None:
    model, threads = sys.argv[1], int(sys.argv[2])
    llm = llama_cpp.Llama(model_path=model, n_ctx=1024, n_batch=512, n_threads=threads,
                          n_threads_batch=threads, seed=0, verbose=False)  # fmt: skip
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "decode":
            answer = decode(llm, request["ids"], request["tokens"])
        else:
            answer = prefill(llm, request["ids"])
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
