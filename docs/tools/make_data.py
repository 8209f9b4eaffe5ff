"""Measure the data behind the site's figures with this project's engine: `make docs-data`.

    python -m docs.tools.make_data [--out-dir docs/data]

Runs the bundled SmolLM2-135M-Instruct on the CPU (about two minutes) and writes:

- `sampling.json`: one real next-token distribution (the first answer token of
  the chat-templated "What is the capital of France?") before and after
  temperature, top-k, top-p and min-p (`decodespec.spec.sampling.process_logits`), and
  the top candidates of every step of a short greedy generation;
- `engine-timing.json`: time to first token and cached decode time per token
  as the prompt grows, and the token times of one request.

Each file records the machine, the date, and the Python and torch versions.
The figures are drawn from these files when the site is built.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
from pathlib import Path

import torch

from decodespec.reference.engine import Engine
from decodespec.reference.loader import load_model
from decodespec.reference.model_files import bundled_model_path
from decodespec.spec.forward import ModelWeights, forward_naive
from decodespec.spec.params import SamplingParams
from decodespec.spec.sampling import process_logits

DATA_DIR = Path(__file__).resolve().parents[1] / "data"
COMMAND = "make docs-data"
QUESTION = "What is the capital of France?"
TOP_TOKENS = 20
# (name, label, temperature, top_k, top_p, min_p); 0 / 1 / 0 switch a filter off.
VIEWS = [
    ("raw", "the model's distribution (temperature 1, no filter)", 1.0, 0, 1.0, 0.0),
    ("temperature-0.5", "temperature 0.5", 0.5, 0, 1.0, 0.0),
    ("temperature-1.5", "temperature 1.5", 1.5, 0, 1.0, 0.0),
    ("top-k-5", "top-k 5", 1.0, 5, 1.0, 0.0),
    ("top-p-0.8", "top-p 0.8", 1.0, 0, 0.8, 0.0),
    ("min-p-0.3", "min-p 0.3", 1.0, 0, 1.0, 0.3),
    ("combined", "temperature 0.7, top-k 50, top-p 0.9", 0.7, 50, 0.9, 0.0),
]
GENERATION = SamplingParams(
    temperature=0.0, max_tokens=16, top_logprobs=5, logprobs_mode="processed"
)
PROMPT_LENGTHS = [32, 256, 512, 1024, 1536, 2048]
DECODE_STEPS = 8
REPEATS = 3
TIMELINE_PROMPT = 512
TIMELINE_TOKENS = 32
FILLER = (
    "The loop runs the model over the sequence, turns the last position into logits, "
    "draws a token, appends it and checks whether to stop. "
)


def cpu_name() -> str:
    """The processor's model name, from /proc/cpuinfo where there is one."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def environment() -> dict:
    """Machine, threads, date (UTC) and software versions of this run."""
    return {
        "command": COMMAND,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": f"CPU: {cpu_name()}",
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        # Other processes compete for the cores: the 1-minute load average when it started.
        "load_average": round(os.getloadavg()[0], 2),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "model": "SmolLM2-135M-Instruct (bundled GGUF, dequantized to float32)",
    }


def chat_prompt_ids(tokenizer: object, question: str) -> list[int]:
    """Token ids of `question` in the model's chat template, ready for the answer."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}])
    return tokenizer.encode(text, add_special_tokens=False)


def filtered_probs(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float
) -> torch.Tensor:
    """`[vocab]` probabilities the spec draws from with these parameters (steps 5-8)."""
    processed = process_logits(
        logits,
        temperature=torch.tensor([temperature]),
        top_k=torch.tensor([top_k]),
        top_p=torch.tensor([top_p]),
        min_p=torch.tensor([min_p]),
    )
    return processed.softmax(dim=-1)[0]


def token_entry(tokenizer: object, token_id: int) -> dict:
    """A token's id and text, and whether it ends a generation (its text is empty)."""
    return {
        "id": token_id,
        "text": tokenizer.decode([token_id]),
        "eos": token_id in tokenizer.eos_token_ids,
    }


def distribution_views(weights: ModelWeights, tokenizer: object, prompt_ids: list[int]) -> dict:
    """The top tokens of the next-token distribution under each view's parameters.

    Every view lists the same tokens (the raw top `TOP_TOKENS`, which no
    filter reorders); `rest` is the probability of all other tokens and
    `kept` how many tokens keep a non-zero probability.
    """
    logits = forward_naive(weights, torch.tensor(prompt_ids), last_only=True)
    raw = logits[0].softmax(dim=-1)
    top_ids = raw.topk(TOP_TOKENS).indices.tolist()
    views = []
    for name, label, temperature, top_k, top_p, min_p in VIEWS:
        probs = filtered_probs(logits, temperature, top_k, top_p, min_p)
        shown = probs[top_ids]
        views.append(
            {
                "name": name,
                "label": label,
                "params": {
                    "temperature": temperature,
                    "top_k": top_k,
                    "top_p": top_p,
                    "min_p": min_p,
                },
                "probs": shown.tolist(),
                "rest": max(0.0, float(probs.sum() - shown.sum())),
                "kept": int((probs > 0).sum()),
            }
        )
    tokens = [token_entry(tokenizer, i) for i in top_ids]
    return {"tokens": tokens, "views": views}


def generation_steps(weights: ModelWeights, tokenizer: object, prompt_ids: list[int]) -> dict:
    """Each step of a greedy generation: the chosen token and the top candidates it beat."""
    engine = Engine(weights, tokenizer)
    steps = []
    for event in engine.generate(prompt_ids, GENERATION):
        chosen = event.logprobs
        steps.append(
            {
                "token": token_entry(tokenizer, chosen.token_id),
                "prob": math.exp(chosen.logprob),
                "rank": chosen.rank,
                "candidates": [
                    {**token_entry(tokenizer, i), "prob": math.exp(lp)} for i, lp in chosen.top
                ],
            }
        )
    params = GENERATION
    return {
        "params": {"temperature": params.temperature, "max_tokens": params.max_tokens},
        "text": "".join(step["token"]["text"] for step in steps),
        "steps": steps,
    }


def sampling_data(weights: ModelWeights, tokenizer: object) -> dict:
    """Everything `docs/sampling-pictures.md` draws."""
    prompt_ids = chat_prompt_ids(tokenizer, QUESTION)
    return {
        **environment(),
        "question": QUESTION,
        "prompt": "chat template of the question, up to the first answer token",
        "distribution": distribution_views(weights, tokenizer, prompt_ids),
        "generation": generation_steps(weights, tokenizer, prompt_ids),
    }


def filler_ids(tokenizer: object, length: int) -> list[int]:
    """`length` token ids of English text (the content does not change the timing)."""
    ids = tokenizer.encode(FILLER, add_special_tokens=False)
    return (ids * (length // len(ids) + 1))[:length]


def timed_request(engine: Engine, prompt_ids: list[int], tokens: int) -> tuple[float, list[float]]:
    """Time to first token and the gaps between later tokens of one greedy request (s)."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    request_id = engine.add_request(prompt_ids, params)
    while engine.has_unfinished():
        engine.step()
    output = engine.output(request_id)
    return output.ttft_s, output.inter_token_latencies_s


def prompt_length_sweep(engine: Engine, tokenizer: object) -> list[dict]:
    """TTFT and cached decode ms/token after prompts of each length, best of `REPEATS`.

    The lengths run round-robin, so a burst of load from other processes
    spoils one run of a few lengths rather than every run of one.
    """
    runs: dict[int, list[tuple[float, list[float]]]] = {n: [] for n in PROMPT_LENGTHS}
    for _ in range(REPEATS):
        for length in PROMPT_LENGTHS:
            prompt = filler_ids(tokenizer, length)
            runs[length].append(timed_request(engine, prompt, DECODE_STEPS + 1))
    return [
        {
            "prompt_tokens": length,
            "ttft_ms": 1e3 * min(ttft for ttft, _ in runs[length]),
            "decode_ms_per_token": 1e3 * min(statistics.median(gaps) for _, gaps in runs[length]),
        }
        for length in PROMPT_LENGTHS
    ]


def token_timeline(engine: Engine, tokenizer: object) -> dict:
    """When each token of one request arrived, in ms after it was queued (fastest of `REPEATS`)."""
    prompt = filler_ids(tokenizer, TIMELINE_PROMPT)
    runs = [timed_request(engine, prompt, TIMELINE_TOKENS) for _ in range(REPEATS)]
    ttft, gaps = min(runs, key=lambda run: run[0] + sum(run[1]))
    times = [ttft]
    for gap in gaps:
        times.append(times[-1] + gap)
    return {
        "prompt_tokens": TIMELINE_PROMPT,
        "output_tokens": TIMELINE_TOKENS,
        "token_times_ms": [1e3 * t for t in times],
    }


def timing_data(weights: ModelWeights, tokenizer: object) -> dict:
    """Everything the home page's timing figures draw."""
    engine = Engine(weights, tokenizer)
    timed_request(engine, filler_ids(tokenizer, 64), 4)  # warm-up
    return {
        **environment(),
        "statistic": f"best of {REPEATS} runs; decode: median gap over {DECODE_STEPS} tokens",
        "decoding": "greedy, paged KV cache, spec backend",
        "prompt_lengths": prompt_length_sweep(engine, tokenizer),
        "timeline": token_timeline(engine, tokenizer),
    }


def write_json(path: Path, data: dict) -> None:
    """Write `data` as indented JSON, creating the folder if needed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=DATA_DIR)
    args = parser.parse_args(argv)
    weights, tokenizer = load_model(bundled_model_path())
    write_json(args.out_dir / "sampling.json", sampling_data(weights, tokenizer))
    write_json(args.out_dir / "engine-timing.json", timing_data(weights, tokenizer))


if __name__ == "__main__":
    main()
