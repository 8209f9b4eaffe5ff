"""The Determinism page's measured sections, from `results/determinism*.json`
(`make bench-determinism`, `tests/benchmarks/determinism.py`)."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The runs the page shows, in order: our server by default, in the mode, and in int4.
FILES = ("determinism-cpu.json", "determinism-invariant-cpu.json", "determinism-int4-cpu.json")
TABLE_MARKER = "{{ determinism_table }}"
COST_MARKER = "{{ determinism_cost }}"


def load(results_dir: Path = ROOT / "results") -> list[dict]:
    """The committed runs, those that exist, in `FILES` order."""
    return [json.loads(p.read_text()) for p in (results_dir / f for f in FILES) if p.exists()]


def phases_table(runs: list[dict]) -> str:
    """Per server and phase: answers with the alone answer's tokens, and bitwise."""
    if not runs:
        return "Not measured yet: run `make bench-determinism`."
    lines = [
        "| server | phase | same tokens | bitwise | largest logprob difference |",
        "|---|---|---|---|---|",
    ]
    for run in runs:
        for name, phase in run["phases"].items():
            n = phase["requests"]
            lines.append(
                f"| `{run['server']}` | {name} | {phase['same_tokens']}/{n} | "
                f"{phase['bitwise']}/{n} | {phase['max_logprob_difference']:.3g} |"
            )
    commands = ", ".join(f"`{c}`" for c in sorted({run["command"] for run in runs}))
    return "\n".join(lines) + f"\n\n*Commands: {commands}.*"


def cost_table(runs: list[dict]) -> str:
    """In-process decode throughput with and without the mode, per weight format."""
    costs = [run["cost"] for run in runs if run.get("cost")]
    if not costs:
        return "Not measured yet: run `make bench-determinism` with `--cost-rounds 2`."
    lines = [
        "| weights | streams | tokens/s | with `--batch-invariant` | relative |",
        "|---|---|---|---|---|",
    ]
    for cost in costs:
        rates = cost["tokens_per_s"]
        for streams in (1, 16):
            plain = rates[f"{streams} streams"]
            invariant = rates[f"{streams} streams, batch-invariant"]
            lines.append(
                f"| {cost['weights']} | {streams} | {plain:.1f} | {invariant:.1f} | "
                f"{invariant / plain:.2f}x |"
            )
    return "\n".join(lines) + (
        "\n\n*In-process engine, greedy, 32 tokens per stream, the fastest of the rounds "
        "(interleaved), `python -m tests.benchmarks.determinism --cost-rounds 2`.*"
    )


def fill(markdown: str, results_dir: Path = ROOT / "results") -> str:
    runs = load(results_dir)
    return markdown.replace(TABLE_MARKER, phases_table(runs)).replace(COST_MARKER, cost_table(runs))
