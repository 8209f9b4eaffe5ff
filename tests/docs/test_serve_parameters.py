"""The Serve page's tables of request fields, against what the code declares.

The tables under "Parameters" in docs/serve.md are written by hand, for their
notes; this test keeps them true:

- every sampling parameter that `SamplingParams` declares a body name for
  (`api`) has a row, and every field the server takes (`openai_api.FIELDS`)
  is named, in a row's first column or in its notes (vLLM's older
  `guided_*` spellings); no row names a field the server refuses;
- a declared parameter's default column shows its declared default (`none`
  for an empty collection; a default of None means something the notes say);
- every interval a declared parameter's notes state is its declared range
  (`RANGES`), and a range bounded on both sides is stated.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from decodespec.reference.openai_api import FIELDS
from decodespec.spec.checks import Range
from decodespec.spec.params import PARAMETERS, RANGES, SamplingParams

SERVE = Path(__file__).resolve().parents[2] / "docs" / "serve.md"
SECTION = "## Parameters"
NUMBER = r"-?\d+(?:\.\d+)?"
INTERVAL = re.compile(rf"[\[(]({NUMBER}), ({NUMBER})[\])]")
# A one-sided range as the notes say it: "> 0", ">= 1".
BOUND = re.compile(rf"(?<![\w-])(>=?|≥) ?({NUMBER})(?![\d.])")
DECLARED = {p.api: name for name, p in PARAMETERS.items() if p.api is not None}


def parameter_rows(text: str) -> list[tuple[list[str], str, str]]:
    """(field names of the first column, default, notes) of each row of the tables of
    the "Parameters" section; a dotted name (`stream_options.include_usage`) counts as
    its top-level field."""
    start = text.index(f"\n{SECTION}\n")
    end = text.index("\n## ", start + 1)
    rows = []
    for line in text[start:end].splitlines():
        if not line.startswith("|"):
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 3:
            raise AssertionError(f"docs/serve.md: a row of {len(cells)} cells, not 3: {line}")
        if cells[0] in ("Parameter", "Extra field") or set(cells[0]) <= {"-", " "}:
            continue  # a header or its rule
        names = [name.split(".")[0] for name in re.findall(r"`([^`]+)`", cells[0])]
        rows.append((names, cells[1], cells[2]))
    return rows


@pytest.fixture(scope="module")
def rows() -> list[tuple[list[str], str, str]]:
    found = parameter_rows(SERVE.read_text())
    assert found, f"docs/serve.md: no table rows under {SECTION!r}"
    return found


def declared_rows(rows: list[tuple[list[str], str, str]]) -> list[tuple[str, str, str]]:
    """(field, default, notes) of every declared parameter named in a row."""
    return [
        (DECLARED[api], default, notes)
        for names, default, notes in rows
        for api in names
        if api in DECLARED
    ]


def shown_default(value: object) -> str | None:
    """A default as the tables write it; None for a default the notes explain."""
    if value is None:
        return None
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, (int, float)):
        return f"{value:g}"
    return "none" if len(value) == 0 else None


def check_fields(rows: list[tuple[list[str], str, str]]) -> None:
    """Every declared parameter and every field the server takes is named; no other."""
    named = {name for names, _, _ in rows for name in names}
    assert set(DECLARED) - named == set(), "declared parameters without a row"
    accepted = FIELDS["completion"] | FIELDS["chat"]
    assert named - accepted == set(), "rows for fields the server refuses"
    in_notes = {name for _, _, notes in rows for name in re.findall(r"`([\w.]+)`", notes)}
    assert accepted - named - in_notes == set(), "fields the server takes that no row names"


def check_defaults(rows: list[tuple[list[str], str, str]]) -> int:
    """The number of defaults checked."""
    checked = 0
    for field, default, _ in declared_rows(rows):
        value = SamplingParams.__dataclass_fields__[field]
        declared = value.default_factory() if callable(value.default_factory) else value.default
        shown = shown_default(declared)
        if shown is None:
            continue
        checked += 1
        pattern = rf"(?<![\w.-]){re.escape(shown)}(?![\w.])"
        assert re.search(pattern, default), f"{field}: default {shown}, the page says {default!r}"
    return checked


def stated_bounds(notes: str) -> tuple[list[Range], list[tuple[str, float]]]:
    """The intervals ("in (0, 1]") and one-sided bounds ("> 0") a row's notes state."""
    intervals = [
        Range(float(m[1]), float(m[2]), low_open=m[0][0] == "(", high_open=m[0][-1] == ")")
        for m in INTERVAL.finditer(notes)
    ]
    bounds = [(op.replace("≥", ">="), float(x)) for op, x in BOUND.findall(notes)]
    return intervals, bounds


def check_ranges(rows: list[tuple[list[str], str, str]]) -> int:
    """The number of ranges bounded on both sides found stated."""
    bounded = 0
    for field, _, notes in declared_rows(rows):
        declared = RANGES.get(field)
        intervals, bounds = stated_bounds(notes)
        if declared is None:
            assert not intervals and not bounds, f"{field} declares no range: {notes!r}"
            continue
        for stated in intervals:
            assert stated == declared, f"{field}: the page says {stated}, declared {declared}"
        for op, x in bounds:
            expected = (">" if declared.low_open else ">=", declared.low)
            assert math.isinf(declared.high) and (op, x) == expected, (
                f"{field}: the page says {op} {x:g}, declared {declared}"
            )
        if math.isfinite(declared.low) and math.isfinite(declared.high):
            assert f"in {declared}" in notes, f"{field}: its range {declared} is not stated"
            bounded += 1
    return bounded


def test_every_declared_parameter_and_every_field_the_server_takes_has_a_row(rows):
    check_fields(rows)


def test_the_defaults_are_the_declared_ones(rows):
    assert check_defaults(rows) >= 10


def test_the_ranges_are_the_declared_ones(rows):
    assert check_ranges(rows) >= 5  # top_p, min_p, the two penalties, logit_bias


TABLE = "\n## Parameters\n\n| Parameter | Default | Notes |\n| --- | --- | --- |\n{}\n\n## Next\n"


@pytest.mark.parametrize(
    ("row", "check", "message"),
    [
        ("| `top_p` | 0.9 | in (0, 1] |", check_defaults, "top_p: default 1"),
        ("| `top_p` | 1 | in [0, 1] |", check_ranges, r"top_p: the page says \[0, 1\]"),
        ("| `min_p` | 0 | keep the likely tokens |", check_ranges, r"min_p: its range \[0, 1\]"),
        ("| `repetition_penalty` | 1 | >= 0 |", check_ranges, "repetition_penalty: .* says >= 0"),
        ("| `seed` | drawn | in [0, 1] |", check_ranges, "seed declares no range"),
    ],
)  # fmt: skip
def test_a_stale_row_fails(row, check, message):
    rows = parameter_rows(TABLE.format(row))
    with pytest.raises(AssertionError, match=message):
        check(rows)


def test_a_bound_that_is_not_a_number_is_not_read_as_an_interval():
    assert stated_bounds("in [0, 2<sup>64</sup>)") == ([], [])
    assert stated_bounds("in (0, 1] and > 0") == ([Range(0, 1, low_open=True)], [(">", 0.0)])


def test_a_missing_or_unknown_field_fails(rows):
    without_min_p = [row for row in rows if "min_p" not in row[0]]
    with pytest.raises(AssertionError, match="declared parameters without a row"):
        check_fields(without_min_p)
    with pytest.raises(AssertionError, match="fields the server refuses"):
        check_fields([*rows, *parameter_rows(TABLE.format("| `top-p` | 1 | in (0, 1] |"))])
    without_guided = [
        (names, default, notes.replace("guided_json", "")) for names, default, notes in rows
    ]
    with pytest.raises(AssertionError, match="fields the server takes that no row names"):
        check_fields(without_guided)
