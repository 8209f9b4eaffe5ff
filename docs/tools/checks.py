"""`decodespec check` against each server (`make check-servers`,
`results/check-<server>.json`, written by `tests/benchmarks/check_servers.py`)
as the Peers page shows it.

- `table_markdown`: checks down, one column per server (decodespec first, then
  the peers), each cell pass, **fail** or not supported; every cell that is not
  a pass carries a numbered note with the check's one-line detail from the
  report.
- `servers_markdown`: one line per server: its version, the command line it ran
  with, the check's requests and time, the date and the machine.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "results"
PATTERN = "check-*.json"
MARKER = "<!-- checks-table -->"
ORDER = ("decodespec", "llama-cpp-python", "llama-server")  # then any other, by name
SHOWN = {"pass": "pass", "fail": "**fail**", "not supported": "not supported"}
MISSING = "not run"
# Markdown's own characters in a detail shown as text (backslash first)
SPECIAL = re.compile(r"([\\`*_\[\]{}|#])")


def load(results_dir: Path = RESULTS) -> list[dict]:
    """The committed runs, decodespec first, then the peers in `ORDER`, then others."""
    runs = [json.loads(path.read_text()) for path in sorted(results_dir.glob(PATTERN))]

    def rank(run: dict) -> tuple[int, str]:
        name = run["server"]["name"]
        return (ORDER.index(name) if name in ORDER else len(ORDER), name)

    return sorted(runs, key=rank)


def escape(text: str) -> str:
    """`text` as one line of literal Markdown text (a table cell or a list item)."""
    text = " ".join(str(text).split())
    text = SPECIAL.sub(r"\\\1", text)
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def rows(runs: list[dict]) -> list[tuple[str, str]]:
    """Every (check, clause) of every run, in the order they ran."""
    seen: dict[tuple[str, str], None] = {}
    for run in runs:
        for row in run["report"]["checks"]:
            seen.setdefault((row["check"], row["clause"]), None)
    return list(seen)


def table_markdown(results_dir: Path = RESULTS) -> str:
    """The table and its numbered notes, or how to make them."""
    runs = load(results_dir)
    if not runs:
        return "*Not measured yet: run `make check-servers`.*\n"
    names = [run["server"]["name"] for run in runs]
    notes: dict[str, int] = {}

    def note(text: str) -> str:
        number = notes.setdefault(text, len(notes) + 1)
        return f" <sup>[{number}](#check-note-{number})</sup>"

    lines = ["| check | clause | " + " | ".join(names) + " |", "|" + " --- |" * (len(names) + 2)]
    by_run = [{(r["check"], r["clause"]): r for r in run["report"]["checks"]} for run in runs]
    for check, clause in rows(runs):
        cells = [escape(check), f"`{clause}`"]
        for name, results in zip(names, by_run, strict=True):
            result = results.get((check, clause))
            if result is None:
                cells.append(MISSING + note(f"{escape(name)}: not in this server's report."))
                continue
            cell = SHOWN.get(result["outcome"], escape(result["outcome"]))
            if result["outcome"] != "pass":
                cell += note(f"{escape(name)}: {escape(result['detail'])}")
            cells.append(cell)
        lines.append("| " + " | ".join(cells) + " |")
    listing = "\n".join(
        f'{n}. <span id="check-note-{n}"></span>{text}' for text, n in notes.items()
    )
    why = "\n\n**Why each cell that is not a pass is so** (the check's own detail):\n\n"
    return "\n".join(lines) + (why + listing if notes else "") + "\n"


def shown_command(command: list[str]) -> str:
    """A command line for the page: an interpreter as `python`, paths by their names."""
    parts = []
    for i, part in enumerate(command):
        if i == 0 and Path(part).name.startswith("python"):
            parts.append("python")
        elif part.startswith("/"):
            parts.append(Path(part).name)
        else:
            parts.append(part)
    return " ".join(parts)


def servers_markdown(results_dir: Path = RESULTS) -> str:
    """One line per server: version, command, requests and time, date and machine."""
    lines = []
    for run in load(results_dir):
        server, report, machine = run["server"], run["report"], run["machine"]
        lines.append(
            f"- **{escape(server['name'])}** {escape(server['version'])}: "
            f"`{shown_command(server['command'])}`; {report['requests']} requests in "
            f"{report['check_s']:.0f} s, {run['date'][:10]} on {escape(machine['device'])} "
            f"({machine['cores']} cores), `{run['command']}`."
        )
    return "\n".join(lines) + "\n" if lines else ""


def section(results_dir: Path = RESULTS) -> str:
    """What the page's marker becomes: the servers, then the table."""
    servers = servers_markdown(results_dir)
    return (servers + "\n" if servers else "") + table_markdown(results_dir)
