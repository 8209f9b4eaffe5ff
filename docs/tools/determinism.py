"""The Determinism page's measured sections, from `results/determinism*.json`
(`make bench-determinism`, `tests/benchmarks/determinism.py`) and
`results/invariance-cost-cpu.json` and `results/invariance-mode-cost-cpu.json`
(`make bench-invariance`), and its matrix of
which implementations, ours and the peers', meet the batch-invariance clauses,
from `results/peers.json` (`make peers`)."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The runs the page shows, in order: our server with its defaults (the file's int4), in
# float32, and llama.cpp's llama-server.
FILES = (
    "determinism-cpu.json",
    "determinism-float32-cpu.json",
    "determinism-llama-server-cpu.json",
)
COST_FILE = "invariance-cost-cpu.json"
MODE_COST_FILE = "invariance-mode-cost-cpu.json"
TABLE_MARKER = "{{ determinism_table }}"
COST_MARKER = "{{ determinism_cost }}"
MODE_COST_MARKER = "{{ mode_cost }}"
MATRIX_MARKER = "{{ invariance_matrix }}"
# The clauses the conformance suite's invariance checker tests
# (tests/conformance/test_batch_invariance.py, and verification's batch test).
INVARIANCE_CLAUSES = ("ATTN-INVARIANT-1", "SAMPLE-INVARIANT-1", "VERIFY-OUTPUT-1")
SYMBOLS = {"pass": "✅ pass", "fail": "❌ fail", "xfail": "❌ differs"}


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


def cost_table(cost: dict | None) -> str:
    """Per weight format and measure: the engine before and after invariance by
    construction (medians), and after / before."""
    if not cost:
        return "Not measured yet: run `make bench-invariance`."
    lines = ["| weights | measure | before | after | after / before |", "|---|---|---|---|---|"]
    for fmt, sides in cost["formats"].items():
        name = "int4 (the file's)" if fmt == "auto" else fmt
        for measure, before in sides["before"].items():
            after = sides["after"][measure]
            lines.append(
                f"| {name} | {measure} | {before:.2f} | {after:.2f} | "
                f"{sides['after_relative'][measure]:.2f}x |"
            )
    return "\n".join(lines) + (
        f"\n\n*{cost['machine']}; medians of {cost['rounds']} interleaved rounds, each "
        f"measurement in its own process; before: {cost['before']}, after: {cost['after']}; "
        "after / before > 1 is better (times inverted); `make bench-invariance`.*"
    )


def mode_cost_table(cost: dict | None) -> str:
    """Per configuration the mode is for and measure: off, on (medians), on / off."""
    if not cost:
        return "Not measured yet: run `make bench-invariance`."
    lines = ["| backend, weights | measure | off | mode | mode / off |", "|---|---|---|---|---|"]
    for name, sides in cost["configurations"].items():
        shown = name.replace("auto", "int4 (the file's)")
        for measure, off in sides["off"].items():
            lines.append(
                f"| {shown} | {measure} | {off:.2f} | {sides['mode'][measure]:.2f} | "
                f"{sides['mode_relative'][measure]:.2f}x |"
            )
    return "\n".join(lines) + (
        f"\n\n*{cost['machine']}; medians of {cost['rounds']} interleaved rounds, each "
        "measurement in its own process; mode / off > 1 is better (times inverted); "
        "`make bench-invariance`.*"
    )


def _cell(entry: dict | None) -> str:
    if entry is None:
        return "not run"
    status = entry["status"]
    if status in SYMBOLS:
        why = entry.get("why")
        return SYMBOLS[status] + (f": {why}" if why and status != "pass" else "")
    return "—"  # skipped: the implementation has no such operation or feature


def invariance_matrix(matrix: dict | None) -> str:
    """Per implementation, ours first, its status on each batch-invariance clause."""
    columns = {**(matrix or {}).get("ours", {}), **(matrix or {}).get("peers", {})}
    rows = [
        (name, column["clauses"])
        for name, column in columns.items()
        if column.get("ran")  # and has one of the operations
        and any(column["clauses"].get(c, {}).get("status") in SYMBOLS for c in INVARIANCE_CLAUSES)
    ]
    if not rows:
        return "Not run yet: `make peers`."
    lines = [
        "| implementation | " + " | ".join(INVARIANCE_CLAUSES) + " |",
        "|---" * (len(INVARIANCE_CLAUSES) + 1) + "|",
    ]
    for name, clauses in rows:
        statuses = " | ".join(_cell(clauses.get(c)) for c in INVARIANCE_CLAUSES)
        lines.append(f"| {name} | {statuses} |")
    return "\n".join(lines) + (
        "\n\n*— : the implementation has no such operation (or feature); not run: "
        "the invariance tests did not reach this clause. From `results/peers.json` "
        "(`make peers`).*"
    )


def _json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def fill(markdown: str, results_dir: Path = ROOT / "results") -> str:
    runs = load(results_dir)
    matrix = invariance_matrix(_json(results_dir / "peers.json"))
    return (
        markdown.replace(TABLE_MARKER, phases_table(runs))
        .replace(COST_MARKER, cost_table(_json(results_dir / COST_FILE)))
        .replace(MODE_COST_MARKER, mode_cost_table(_json(results_dir / MODE_COST_FILE)))
        .replace(MATRIX_MARKER, matrix)
    )
