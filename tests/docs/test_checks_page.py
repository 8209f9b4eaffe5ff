"""The Peers page's `decodespec check` table comes from the committed
`results/check-*.json` (`make check-servers`)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from docs.tools import checks

PAGE = (checks.ROOT / "docs" / "peers.md").read_text()
COMMITTED = sorted(checks.RESULTS.glob(checks.PATTERN))
ROW = re.compile(r"^\| (?P<check>.+?) \| `(?P<clause>[A-Z0-9-]+)` \| (?P<cells>.*) \|$", re.M)
NOTE = re.compile(r'^\d+\. <span id="check-note-(\d+)"></span>(.*)$', re.M)


def table(markdown: str) -> tuple[list[str], dict[tuple[str, str], list[str]], dict[str, str]]:
    """The rendered table: the server columns, the cells of each (check, clause) row,
    and the notes by number."""
    header = next(line for line in markdown.splitlines() if line.startswith("| check | clause |"))
    names = [cell.strip() for cell in header.strip("|").split("|")][2:]
    rows = {
        (m["check"], m["clause"]): [cell.strip() for cell in m["cells"].split(" | ")]
        for m in ROW.finditer(markdown)
    }
    return names, rows, dict(NOTE.findall(markdown))


def test_the_peers_page_has_the_marker_and_the_hook_fills_it():
    from docs.hooks import results_pages

    assert checks.MARKER in PAGE
    filled = results_pages.peers_page(PAGE)
    assert checks.MARKER not in filled
    assert checks.table_markdown() in filled


def test_the_table_lists_every_check_of_every_committed_file():
    assert COMMITTED, "no results/check-*.json: run `make check-servers`"
    names, rows, notes = table(checks.table_markdown())
    runs = [json.loads(path.read_text()) for path in COMMITTED]
    assert names[0] == "decodespec"
    assert sorted(names) == sorted(run["server"]["name"] for run in runs)
    for run in runs:
        column = names.index(run["server"]["name"])
        for result in run["report"]["checks"]:
            cells = rows[(checks.escape(result["check"]), result["clause"])]
            cell = cells[column]
            assert cell.startswith(checks.SHOWN[result["outcome"]]), (run["server"], result)
            if result["outcome"] == "pass":
                assert "<sup>" not in cell
            else:
                number = re.search(r"#check-note-(\d+)", cell)[1]
                detail = f"{run['server']['name']}: {checks.escape(result['detail'])}"
                assert notes[number] == detail
    assert len(rows) == len(
        {(r["check"], r["clause"]) for run in runs for r in run["report"]["checks"]}
    )


def test_decodespec_serve_passes_every_committed_check():
    path = checks.RESULTS / "check-decodespec.json"
    report = json.loads(path.read_text())["report"]
    assert report["checks"] and all(r["outcome"] == "pass" for r in report["checks"])


def run(name: str, outcomes: dict[str, tuple[str, str]]) -> dict:
    return {
        "server": {"name": name, "version": "1.0", "command": ["/usr/bin/python3", "-m", name]},
        "command": "make check-servers",
        "date": "2026-01-01T00:00:00+00:00",
        "machine": {"device": "a CPU", "cores": 2},
        "report": {
            "requests": 10,
            "check_s": 3.0,
            "checks": [
                {"check": check, "clause": clause, "outcome": outcome, "detail": detail}
                for check, (clause, outcome, detail) in outcomes.items()
            ],
        },
    }


def test_cells_and_notes_of_made_up_runs(tmp_path: Path):
    ours = {"greedy": ("SAMPLE-GREEDY-1", "pass", "fine"), "stop": ("STOP-STR-1", "pass", "ok")}
    theirs = {
        "greedy": ("SAMPLE-GREEDY-1", "fail", "token 3 | has *logprob* <-1>"),
        "schema": ("MASK-SOUND-1", "not supported", "refused with HTTP 400:\n  no"),
    }
    for name, outcomes in (("llama-server", theirs), ("decodespec", ours)):
        (tmp_path / f"check-{name}.json").write_text(json.dumps(run(name, outcomes)))
    markdown = checks.section(tmp_path)
    names, rows, notes = table(markdown)
    assert names == ["decodespec", "llama-server"]
    assert rows[("greedy", "SAMPLE-GREEDY-1")] == ["pass", "**fail** <sup>[1](#check-note-1)</sup>"]
    assert rows[("stop", "STOP-STR-1")][1] == "not run <sup>[2](#check-note-2)</sup>"
    assert rows[("schema", "MASK-SOUND-1")] == [
        "not run <sup>[3](#check-note-3)</sup>",
        "not supported <sup>[4](#check-note-4)</sup>",
    ]
    assert notes["1"] == r"llama-server: token 3 \| has \*logprob\* &lt;-1&gt;"
    assert notes["4"] == "llama-server: refused with HTTP 400: no"
    assert "- **decodespec** 1.0: `python -m decodespec`; 10 requests in 3 s" in markdown


def test_without_results_the_page_says_how_to_measure(tmp_path: Path):
    assert "Not measured yet: run `make check-servers`." in checks.section(tmp_path)
