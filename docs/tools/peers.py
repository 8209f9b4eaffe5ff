"""The peer matrix (`results/peers.json`, written by `make peers`) as the site shows it.

- `matrix_markdown`: the page's table, clauses down and engines across; each
  cell links to its clause, and every cell that is not a pass carries a
  numbered note saying why, in one sentence.
- `Note`, `note_check` and `unexplained`: the stage pages' hand-written
  "Differs from" notes against the runs. A note is *confirmed* when a run of
  its engine fails or xfails one of its clauses, *contradicted* when runs of
  its engine check its clauses and pass them, *unsupported* when its engine
  ran but nothing checks its clauses, and *unchecked* when no column of its
  engine could run on the machine (a GPU-only peer on a CPU). A disagreement
  a run found that no note mentions is unexplained.
  tests/docs/test_peer_notes.py fails on contradicted, unsupported and
  unexplained.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MATRIX = ROOT / "results" / "peers.json"
CLAUSE_ID = re.compile(r"\b[A-Z]+(?:-[A-Z0-9]+)*-\d+\b")
DISAGREE = ("xfail", "fail")


def load(path: Path = MATRIX) -> dict:
    return json.loads(path.read_text())


# Spec modules shown on another module's stage page (docs/hooks/spec_pages.py, STAGES).
PAGE_OF_MODULE = {
    "rng": "sampling",
    "params": "sampling",
    "checks": "sampling",
    "gguf_blocks": "quant",
}


def clause_link(clause_id: str, module: str) -> str:
    """The clause's anchor on its stage page, relative to a page at the site's root."""
    name = module.rsplit(".", 1)[-1]
    return f"stages/{PAGE_OF_MODULE.get(name, name)}.md#{clause_id.lower()}"


def _cell(column: dict, clause_id: str) -> tuple[str, str | None]:
    """A column's status at a clause, and why unless it passes."""
    if not column["ran"]:
        return "not run", column["why"]
    cell = column["clauses"].get(clause_id)
    if cell is None:
        return "skip", "no conformance test of this clause ran"
    return cell["status"], cell.get("why", "").rstrip(".") or None


def matrix_markdown(matrix: dict) -> str:
    """The table and its numbered notes."""
    peers = matrix["peers"]
    names = list(peers)
    notes: dict[str, int] = {}

    def note(text: str) -> str:
        number = notes.setdefault(text, len(notes) + 1)
        return f" <sup>[{number}](#peer-note-{number})</sup>"

    header = "| clause | " + " | ".join(names) + " |"
    rows = [header, "|" + " --- |" * (len(names) + 1)]
    for clause_id, info in matrix["clauses"].items():
        link = clause_link(clause_id, info["module"])
        cells = [f"[{clause_id}]({link})"]
        for name in names:
            status, why = _cell(peers[name], clause_id)
            shown = "**fail**" if status == "fail" else status
            cells.append(f"[{shown}]({link})" + (note(f"{name}: {why}.") if why else ""))
        rows.append("| " + " | ".join(cells) + " |")
    listing = "\n".join(f'<span id="peer-note-{n}"></span>{n}. {text}' for text, n in notes.items())
    return "\n".join(rows) + "\n\n**Why each cell that is not a pass is so:**\n\n" + listing + "\n"


def versions_markdown(matrix: dict) -> str:
    """One line per peer: version, what the adapter calls, wall time of its run."""
    lines = []
    for name, column in matrix["peers"].items():
        version = column.get("version", "?")
        calls = column.get("functions", "")
        if column["ran"]:
            counts = ", ".join(f"{n} {s}" for s, n in column["counts"].items() if n)
            lines.append(
                f"- **{name}** {version} (`{column['module']}`): {calls}. "
                f"{counts} clauses; {column['seconds']:.0f} s."
            )
        else:
            lines.append(f"- **{name}** (`{column['module']}`): {calls}. Not run: {column['why']}.")
    return "\n".join(lines) + "\n"


def loop_markdown(matrix: dict) -> str:
    """The llama.cpp loop comparison on the bundled model: speeds, then a row per prompt."""
    loop = matrix["peers"].get("llama.cpp", {}).get("loop")
    if not loop:
        return "*The llama.cpp column did not run: no loop comparison in this matrix.*\n"
    speed = loop["tokens_per_s"]
    lines = [
        f"Decode, greedy, {loop['threads']} threads, {len(loop['prompts'])} prompts of "
        f"{loop['max_tokens']} tokens: **llama.cpp {speed['llama_cpp']:.1f} tokens/s**, "
        f"**this engine {speed['ours']:.1f} tokens/s** (spec backend, float32). Tokenizer "
        f"ids equal on {sum(p['tokenizer_equal'] for p in loop['prompts'])} of "
        f"{len(loop['prompts'])} prompts; greedy tokens identical throughout on "
        f"{loop['identical_generations']}.",
        "",
        "| prompt | same ids | tokens in lockstep | our top-2 logit gap where they part |",
        "| --- | --- | --- | --- |",
    ]
    for prompt in loop["prompts"]:
        text = json.dumps(prompt["prompt"], ensure_ascii=False)[1:-1].replace("|", "\\|")
        agree = prompt["first_difference"]
        lockstep = f"all {loop['max_tokens']}" if agree is None else str(agree)
        gap = prompt.get("ours_at_difference") or {}
        shown = f"{gap['logit_gap']:.3f}" if "logit_gap" in gap else "–"
        same = "yes" if prompt["tokenizer_equal"] else "no"
        lines.append(f"| `{text}` | {same} | {lockstep} | {shown} |")
    return "\n".join(lines) + "\n"


def mask_order_markdown(matrix: dict) -> str:
    """The mask-order comparison (tests/peers/mask_order.py): allowed sets of both grammar
    libraries per grammar, then the tokens each order can return, case by case."""
    report = matrix.get("mask_order")
    if not report:
        return "*The llama.cpp column did not run: no mask-order comparison in this matrix.*\n"
    lines = [
        "| grammar | states | llama.cpp = xgrammar | allowed tokens per state |",
        "| --- | --- | --- | --- |",
    ]
    for grammar in report["grammars"]:
        steps = grammar["steps"]
        equal = sum(step["equal"] for step in steps)
        sizes = ", ".join(str(step["xgrammar_allowed"]) for step in steps)
        gbnf = grammar["gbnf"].replace("|", "\\|")
        lines.append(f"| `{gbnf}` | {len(steps)} | {equal} of {len(steps)} | {sizes} |")
    lines += [
        "",
        "| grammar | logits | top-k | top-p | raw kept (allowed) | llama.cpp resamples "
        "| mask first | chain first | same |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    filters = report["model_logits_filters"]
    for grammar in report["grammars"]:
        rows = [(case["case"], case) for case in grammar["constructed"]]
        model = [step["model_logits"] for step in grammar["steps"]]
        differ = sum(not row["same"] for row in model)
        for name, row in rows:
            lines.append(_order_row(grammar["name"], name, row))
        lines.append(
            f"| {grammar['name']} | the model's, at each of {len(model)} states | "
            f"{filters['top_k']} | {filters['top_p']} | – | "
            f"{sum(row['resamples'] for row in model)} of {len(model)} | – | – | "
            f"{'yes' if not differ else f'differ at {differ}'} |"
        )
    return "\n".join(lines) + "\n"


def _order_row(grammar: str, name: str, row: dict) -> str:
    top_k = row["top_k"] or "off"
    return (
        f"| {grammar} | {name} | {top_k} | {row['top_p']} | {row['chain_raw_kept']} "
        f"({row['chain_raw_allowed']}) | {'yes' if row['resamples'] else 'no'} | "
        f"{len(row['mask_first'])} | {len(row['chain_first'])} | "
        f"{'yes' if row['same'] else '**no**'} |"
    )


# --- "Differs from" notes against the runs ---------------------------------------------------


@dataclass(frozen=True)
class Note:
    """A hand-written difference: the engine it names, the clauses it concerns, its text."""

    engine: str
    clauses: tuple[str, ...]
    text: str


def note_check(note: Note, matrix: dict) -> tuple[str, str]:
    """("confirmed" | "contradicted" | "unsupported" | "unchecked", the runs that say so)."""
    columns = {n: c for n, c in matrix["peers"].items() if c.get("engine") == note.engine}
    found, checked = [], []
    for name, column in columns.items():
        for clause_id in note.clauses:
            cell = column["clauses"].get(clause_id) if column["ran"] else None
            if cell is None or cell["status"] == "skip":
                continue
            checked.append(f"{name} {cell['status']} at {clause_id}")
            if cell["status"] in DISAGREE:
                found.append(f"{name}: {cell['status']} at {clause_id}")
    if found:
        return "confirmed", "; ".join(found)
    if checked:
        return "contradicted", "; ".join(checked)
    if any(column["ran"] for column in columns.values()) or not columns:
        return "unsupported", f"no run of {note.engine} checks {', '.join(note.clauses)}"
    return "unchecked", "; ".join(f"{n}: {c['why']}" for n, c in columns.items())


def unexplained(matrix: dict, notes: list[Note]) -> list[str]:
    """Disagreements a run found that no note of that engine and clause mentions."""
    covered = {(note.engine, c) for note in notes for c in note.clauses}
    return [
        f"{name} {cell['status']}s {clause_id}: {cell['why']}"
        for name, column in matrix["peers"].items()
        for clause_id, cell in column["clauses"].items()
        if cell["status"] in DISAGREE and (column.get("engine"), clause_id) not in covered
    ]
