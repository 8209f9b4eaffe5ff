"""The documentation site builds offline and strictly, and its generated pages are complete."""

from __future__ import annotations

import ast
import html
import importlib
import inspect
import json
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest

from decodespec import kernels
from decodespec.spec import registry
from docs.tools import peers

ROOT = Path(__file__).resolve().parents[2]
# (stage page, spec module it shows): the sampling page shows the stage, its random
# numbers, its parameters and their checks.
STAGES = [
    ("generate", "decodespec.spec.generate"),
    ("forward", "decodespec.spec.forward"),
    ("quant", "decodespec.spec.quant"),
    ("quant", "decodespec.spec.gguf_blocks"),
    ("attention", "decodespec.spec.attention"),
    ("token_mask", "decodespec.spec.token_mask"),
    ("logits", "decodespec.spec.logits"),
    ("softmax", "decodespec.spec.softmax"),
    ("sampling", "decodespec.spec.sampling"),
    ("sampling", "decodespec.spec.rng"),
    ("sampling", "decodespec.spec.params"),
    ("sampling", "decodespec.spec.checks"),
    ("append", "decodespec.spec.append"),
    ("stop", "decodespec.spec.stop"),
    ("speculative", "decodespec.spec.speculative"),
]


class _TextOf(HTMLParser):
    """The text of an HTML page, tags dropped (highlighted code reads as written)."""

    def __init__(self) -> None:
        super().__init__()
        self.parts: list[str] = []

    def handle_data(self, data: str) -> None:
        self.parts.append(data)


def page_html(site: Path, page: str) -> str:
    return (site / page / "index.html").read_text()


def page_text(site: Path, page: str) -> str:
    parser = _TextOf()
    parser.feed(page_html(site, page))
    return "".join(parser.parts)


def clause_block(page: str, clause_id: str) -> str:
    """The HTML of a clause's anchored block."""
    match = re.search(rf'<div class="clause" id="{clause_id.lower()}">(.*?)</div>', page, re.S)
    assert match, f"no anchored block for {clause_id}"
    return match.group(1)


def test_every_spec_module_has_a_stage_page():
    assert {module for _, module in STAGES} == set(registry.SPEC_MODULES)


@pytest.mark.parametrize(("stage", "module"), STAGES)
def test_the_peer_matrix_links_each_clause_to_its_stage_page(stage, module):
    assert peers.clause_link("X-1", module) == f"stages/{stage}.md#x-1"


def test_the_sampling_page_shows_the_stage_before_its_random_numbers_and_parameters(
    built_site,
):
    text = page_text(built_site, "stages/sampling")
    order = [text.index(clause) for clause in ("SAMPLE-VALID-1", "SAMPLE-RNG-1", "PARAM-RANGE-1")]
    assert order == sorted(order)
    code = [text.index(f"def {name}(") for name in ("sample", "uniform", "sampling_tensors")]
    assert code == sorted(code)


def test_strict_build_writes_every_page(built_site):
    for page in ("engine", "kernels", "conformance", *(f"stages/{name}" for name, _ in STAGES)):
        assert (built_site / page / "index.html").exists(), page


def test_the_site_loads_nothing_from_the_network(built_site):
    remote = re.compile(r'<(?:script|link)[^>]+(?:src|href)="(?:https?:)?//', re.I)
    for page in built_site.rglob("*.html"):
        assert not remote.search(page.read_text()), f"{page} loads a remote script or style"


@pytest.mark.parametrize(("stage", "module"), STAGES)
def test_stage_page_states_every_clause_with_its_anchor_and_tests(built_site, stage, module):
    page = page_html(built_site, f"stages/{stage}")
    stated = [c for c in registry.clauses().values() if c.module == module]
    assert stated, f"{module} states no clause"
    for clause in stated:
        block = clause_block(page, clause.id)
        assert f'href="#{clause.id.lower()}"' in block, clause.id
        assert clause.id in block
        assert re.search(r"tests/[\w/]+\.py::test_\w+", html.unescape(block)), (
            f"{clause.id}: no test link"
        )


@pytest.mark.parametrize(("stage", "module"), STAGES)
def test_stage_page_shows_the_reference_code(built_site, stage, module):
    text = page_text(built_site, f"stages/{stage}")
    spec_module = importlib.import_module(module)
    functions = [
        name
        for name, value in vars(spec_module).items()
        if inspect.isfunction(value) and value.__module__ == module and not name.startswith("_")
    ]
    assert functions, f"{module} has no public function"
    for name in functions:
        assert f"def {name}(" in text, f"{stage}: no source of {name}"


def test_stage_pages_note_the_differences_from_other_engines(built_site):
    text = page_text(built_site, "stages/sampling")
    assert "Differs from" in text and "SAMPLE-TOPP-2" in text


def test_sampling_page_links_the_pictures_when_they_exist(built_site):
    page = page_html(built_site, "stages/sampling")
    linked = 'href="../../sampling-pictures/"' in page
    assert linked == (ROOT / "docs" / "sampling-pictures.md").exists()


def test_kernels_page_documents_every_public_kernel(built_site):
    text = page_text(built_site, "kernels")
    for name in kernels.__all__:
        assert re.search(rf"(def|class) {name}\b", text), f"kernels.{name} is not documented"
    assert "--impl yourpkg.kernels" in text


def clause_marked_tests() -> set[tuple[str, str]]:
    """(clause id, `file::test`) of every `@pytest.mark.clause(...)` in tests/conformance."""
    marked = set()
    for path in sorted((ROOT / "tests" / "conformance").glob("test_*.py")):
        for node in ast.parse(path.read_text()).body:
            if not (isinstance(node, ast.FunctionDef) and node.name.startswith("test_")):
                continue
            test = f"{path.relative_to(ROOT).as_posix()}::{node.name}"
            for mark in node.decorator_list:
                if isinstance(mark, ast.Call) and getattr(mark.func, "attr", "") == "clause":
                    marked |= {(arg.value, test) for arg in mark.args}
    return marked


REPORTS = ("conformance-report.json", "conformance-report-native.json")


@pytest.mark.parametrize("name", REPORTS)
def test_the_committed_report_has_every_conformance_test(name):
    """docs/conformance-report*.json are current: `make docs-report` after a test changes."""
    report = json.loads((ROOT / "docs" / name).read_text())
    reported = {
        (clause, entry["nodeid"].split("[")[0])
        for clause, value in report["clauses"].items()
        for entry in value["tests"]
    }
    marked = clause_marked_tests()
    assert len(marked) > 50
    missing, stale = sorted(marked - reported), sorted(reported - marked)
    assert not (missing or stale), (
        f"run `make docs-report` and commit docs/{name}\n"
        f"not in the report: {missing}\nno longer in the suite: {stale}"
    )


def test_conformance_page_renders_the_committed_report(built_site):
    text = page_text(built_site, "conformance")
    report_path = ROOT / "docs" / "conformance-report.json"
    if not report_path.exists():
        assert "No report yet" in text
        return
    report = json.loads(report_path.read_text())
    assert report["implementation"]["name"] in text
    assert report["date"] in text
    for clause_id in report["clauses"]:
        assert clause_id in text, f"{clause_id} missing from the coverage matrix"
    assert "Boundaries drawn" in text
    for family in report["boundary_families"]:
        assert family in text, f"boundary family {family} missing from the page"


def test_conformance_page_renders_the_native_steps_report(built_site):
    text = page_text(built_site, "conformance")
    report = json.loads((ROOT / "docs" / "conformance-report-native.json").read_text())
    assert report["implementation"]["name"] in text
    assert report["date"] in text
    assert "Unsupported features (their tests skip): " in text
    for feature in report["unsupported_features"]:
        assert feature in text, feature


def test_the_native_matrix_keeps_the_clauses_of_its_operations():
    """An explicitly named implementation's matrix: only its operations' clauses (the
    others' tests all skip as missing), its unsupported features named."""
    from docs.hooks import spec_pages

    report = json.loads((ROOT / "docs" / "conformance-report-native.json").read_text())
    matrix = spec_pages.conformance_matrix(ROOT / "docs" / "conformance-report-native.json")
    ops = registry.OPERATIONS
    for clause_id in report["clauses"]:
        ours = clause_id in (*ops["paged_attention"].clauses, *ops["append_kv"].clauses)
        assert (f"[{clause_id}]" in matrix) == ours, clause_id
    assert "Operations it provides: `paged_attention`, `append_kv`" in matrix
    assert "Unsupported features (their tests skip): `float16`, `bfloat16`, `float64`" in matrix
    assert "failed" not in matrix
