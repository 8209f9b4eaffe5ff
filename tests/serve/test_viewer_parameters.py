"""The viewer's sampling inputs against `SamplingParams`' declarations, read from the page.

No browser: the page's HTML and script are read as text (`tests/serve/test_viewer.py`
drives them in Chromium). Every input of the page's parameter grid is a sampling
parameter's, and:

- its `name` is the parameter's declared body name (`api`), and the request body
  sends it under that name, read from that input;
- a server error naming that parameter marks that input (`FIELD_INPUTS`);
- a number input's `min` and `max` are the bounds of the declared range (`RANGES`;
  none at infinity), its `step` is 1 exactly when the parameter is an integer, and
  the script reads it as an integer exactly then (`number(input, name, integer)`);
- a choice's options are the declared values (the field's `Literal`).

And the page offers each of OFFERED, the parameters that shape the distribution
it shows.
"""

from __future__ import annotations

import math
import re
import typing
from html.parser import HTMLParser
from importlib import resources

import pytest

from decodespec.spec.params import PARAMETERS, RANGES, SamplingParams

VIEWER = resources.files("decodespec.reference") / "static" / "viewer.html"
OFFERED = ("temperature", "top_k", "top_p", "min_p", "max_tokens", "seed", "logprobs_mode")
DECLARED = {p.api: name for name, p in PARAMETERS.items() if p.api is not None}


class ParamsGrid(HTMLParser):
    """The `input` and `select` elements inside `<div class="params">`, with their
    attributes (a select's with its options' values, under "options")."""

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0  # of divs, inside the grid
        self.inputs: list[dict[str, str | list[str] | None]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if tag == "div" and (self.depth or "params" in (found.get("class") or "").split()):
            self.depth += 1
        elif self.depth and tag in ("input", "select"):
            self.inputs.append({**found, "tag": tag, "options": []})
        elif self.depth and tag == "option":
            self.inputs[-1]["options"].append(found["value"])  # type: ignore[union-attr]

    def handle_endtag(self, tag: str) -> None:
        if tag == "div" and self.depth:
            self.depth -= 1


def grid_inputs(html: str) -> list[dict]:
    grid = ParamsGrid()
    grid.feed(html)
    return grid.inputs


def script_part(html: str, start: str, end: str) -> str:
    """The script's text from the line holding `start` to the next line holding `end`."""
    script = html[html.index("<script>") :]
    first = script.index(start)
    return script[first : script.index(end, first + len(start))]


def ui_ids(html: str) -> dict[str, str]:
    """The script's `ui` object: key -> element id."""
    return dict(re.findall(r"(\w+): \$\(\"([\w-]+)\"\)", script_part(html, "const ui = {", "};")))


def field_inputs(html: str) -> dict[str, str]:
    """The script's FIELD_INPUTS: body field -> `ui` key of the input its errors mark."""
    part = script_part(html, "const FIELD_INPUTS = {", "};")
    return dict(re.findall(r"(\w+): ui\.(\w+)", part))


def request_body(html: str) -> str:
    return script_part(html, "function requestBody()", "\n  }\n")


def sends(body: str, api: str, key: str) -> bool:
    """Whether the request body's script sends `api` read from the input `ui[key]`: as
    a property (`top_p: number(ui.topP, ...)`) or spliced into the JSON text
    (`"seed":${seed...}` after `const seed = ui.seed.value...`)."""
    read = rf"\bui\.{key}\b"
    if (line := re.search(rf"^\s*{api}: (.*)$", body, re.M)) is not None:
        return re.search(read, line[1]) is not None
    if (spliced := re.search(rf'"{api}":\$\{{(\w+)', body)) is not None:
        return re.search(rf"const {spliced[1]} = {read}", body) is not None
    return False


def check_viewer(html: str) -> None:
    """Every assertion of this module's docstring, on the page `html`."""
    inputs = grid_inputs(html)
    ids, marks, body = ui_ids(html), field_inputs(html), request_body(html)
    keys = {element_id: key for key, element_id in ids.items()}
    calls = {
        sent: (key, name, integer == "true")
        for sent, key, name, integer in re.findall(
            r"(\w+): number\(ui\.(\w+), \"(\w+)\", (true|false)\)", body
        )
    }
    offered = []
    for element in inputs:
        api = element.get("name")
        assert api in DECLARED, f"input #{element.get('id')}: {api!r} is no declared body name"
        field, declared = DECLARED[api], PARAMETERS[DECLARED[api]]
        offered.append(field)
        key = keys.get(element["id"])
        assert key is not None, f"#{element['id']} is not in the script's ui"
        assert marks.get(api) == key, f"an error naming {api} does not mark #{element['id']}"
        assert sends(body, api, key), f"the body does not send {api} from #{element['id']}"
        if element["tag"] == "select":
            allowed = typing.get_args(typing.get_type_hints(SamplingParams)[field])
            assert sorted(element["options"]) == sorted(allowed), f"{api}: {element['options']}"
            continue
        if element.get("type") != "number":
            continue  # text read as it is typed (the seed: digits, sent as they are)
        integer = declared.type is int
        assert calls.get(api) == (key, api, integer), (
            f"{api} must be sent as number(ui.{key}, {api!r}, {str(integer).lower()})"
        )
        assert (element.get("step") == "1") == integer, f"{api}: step {element.get('step')}"
        bounds = RANGES.get(field)
        for attr, bound in (("min", bounds and bounds.low), ("max", bounds and bounds.high)):
            expected = None if bound is None or math.isinf(bound) else f"{bound:g}"
            assert element.get(attr) == expected, (
                f"{api}: {attr}={element.get(attr)!r}, declared range {bounds}"
            )
        value = float(element["value"])
        assert bounds is None or value in bounds, f"{api}: value {value} outside {bounds}"
    missing = [field for field in OFFERED if field not in offered]
    assert not missing, f"the viewer offers no input for {missing}"


def test_the_viewers_inputs_are_the_declared_parameters():
    html = VIEWER.read_text()
    assert len(grid_inputs(html)) == len(OFFERED)
    check_viewer(html)


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ('name="min_p" type="number" min="0" max="1"', 'name="min_p" type="number" min="0"',
         r"min_p: max=None, declared range \[0, 1\]"),
        ('name="top_p" type="number" min="0" max="1"', 'name="top_p" type="number" min="0" max="2"',
         r"top_p: max='2'"),
        ('name="top_k" type="number" min="0" step="1"', 'name="top_k" type="number" min="0"',
         "top_k: step None"),
        ('min_p: number(ui.minP, "min_p", false)', 'min_p: number(ui.minP, "min_p", true)',
         "min_p must be sent as number"),
        ('min_p: number(ui.minP, "min_p", false)', 'minp: number(ui.minP, "min_p", false)',
         "the body does not send min_p from #min-p"),
        ('min_p: number(ui.minP, "min_p", false)', 'min_p: number(ui.topP, "min_p", false)',
         "the body does not send min_p from #min-p"),
        ('min_p: number(ui.minP, "min_p", false)', 'min_p: number(ui.minP, "min-p", false)',
         "min_p must be sent as number"),
        ("min_p: ui.minP,", "", "an error naming min_p does not mark #min-p"),
        ("const seed = ui.seed.value", "const seed = ui.prompt.value",
         "the body does not send seed from #seed"),
        ('logprobs_mode: ui.mode.value', 'logprobs_mode: "raw"',
         "the body does not send logprobs_mode from #mode"),
        ('name="min_p"', 'name="min-p"', "'min-p' is no declared body name"),
        ('<option value="raw">raw</option>', "", "logprobs_mode"),
    ],
)  # fmt: skip
def test_a_stale_input_fails(old, new, message):
    html = VIEWER.read_text()
    assert html.count(old) == 1, old
    with pytest.raises(AssertionError, match=message):
        check_viewer(html.replace(old, new))


def test_a_missing_input_fails():
    html = VIEWER.read_text()
    label = re.search(r"\n\s*<label>Min-p[^\n]*</label>", html)
    assert label
    with pytest.raises(AssertionError, match=r"offers no input for \['min_p'\]"):
        check_viewer(html.replace(label[0], ""))
