"""The weight formats page: its results section and trade-off figure.

`tests/docs/data/quant-cpu-smoke.json` is what `make bench-quant --smoke`
wrote (tests/benchmarks/quant.py): the exact structure of
`results/quant-cpu.json`, with smoke numbers that are not measurements, so the
section must say so. The built site's page shows the results file when it
exists and "Not measured yet" when it does not.
"""

from __future__ import annotations

import copy
import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from docs.tools.performance import performance_page
from docs.tools.quant import (
    LLAMA_CPP_LABEL,
    QUANT_FIGURE,
    QUANT_FILE,
    quant_figure,
    quant_figures,
    quant_section,
)

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = Path(__file__).parent / "data" / "quant-cpu-smoke.json"
SVG_NS = "{http://www.w3.org/2000/svg}"
FORMATS = ("float32", "bfloat16", "int8", "int4")


@pytest.fixture
def smoke() -> dict:
    report = json.loads(SAMPLE.read_text())
    assert report["smoke"] is True
    return report


@pytest.fixture
def measured(smoke) -> dict:
    """The sample as a real run would write it: no smoke flag, no note."""
    report = copy.deepcopy(smoke)
    report["smoke"] = False
    del report["note"]
    return report


def test_a_smoke_file_renders_with_a_visible_warning(smoke):
    section = quant_section(smoke)
    assert '!!! danger "Smoke run"' in section and smoke["note"] in section


def test_the_section_names_date_device_threads_torch_and_command(measured):
    section = quant_section(measured)
    assert section.startswith("## Weight formats on a CPU\n")
    assert "Smoke run" not in section
    assert measured["date"] in section
    where = f"{measured['device']}, {measured['cores']} cores, {measured['threads']} threads"
    assert where in section
    assert f"torch {measured['software']['torch']}" in section
    assert "`make bench-quant`" in section


def test_the_tables_have_a_row_per_format_and_llama_cpp(measured):
    section = quant_section(measured)
    speed = measured["speed"]
    scores = {row["weights"]: row for row in measured["quality"]["formats"]}
    for name in FORMATS:
        row, score = speed["formats"][name], scores[name]
        cells = (
            f"| `{name}` | {row['decode_tokens_per_s']:.1f} | {row['over_llama_cpp']:.2f}× | "
            f"{row['weight_bytes'] / 1e6:.1f} |"
        )
        assert cells in section, name
        assert f"| `{name}` | {score['perplexity']:.3f} |" in section, name
        assert f"{score['top1_agreement']:.2%} |" in section, name
        assert row["layout"] in section
    int4 = scores["int4"]
    delta = int4["perplexity"] - scores["float32"]["perplexity"]
    kl = " | ".join(f"{int4[key]:.3g}" for key in ("kl_mean", "kl_median", "kl_p99", "kl_max"))
    assert f"| {delta:+.3f} | {kl} |" in section
    llama = speed["llama_cpp"]
    assert f"| llama.cpp {llama['version']} | {llama['decode_tokens_per_s']:.1f} |" in section
    assert "## Speed and memory" in section and "## Quality against float32" in section


def test_targets_say_met_or_not_with_the_measured_values(measured):
    measured["targets"][0]["met"] = True
    section = quant_section(measured, level=3)
    assert "\n#### Targets\n" in section
    first, second = measured["targets"]
    assert f"- {first['target']}: met (measured {first['measured']:.2f})" in section
    assert f"- {second['target']}: **NOT met** (measured {second['measured']:.2f})" in section


def test_the_section_names_the_text_scored(measured):
    section = quant_section(measured)
    quality = measured["quality"]
    assert quality["text"] in section and quality["text_sha256"] in section
    assert f"{quality['windows']} window" in section
    assert f"of {quality['context']} tokens" in section


def test_the_section_shows_the_figure_and_its_caption(measured):
    section = quant_section(measured)
    assert f"]({QUANT_FIGURE})" in section
    assert "*Measured with this project's engine on" in section


def test_a_missing_file_says_not_measured_yet():
    section = quant_section(None)
    assert "Not measured yet: run `make bench-quant`" in section
    assert "on a GPU" not in section and QUANT_FIGURE not in section


def parse(document: str) -> ET.Element:
    root = ET.fromstring(document)
    assert root.tag == f"{SVG_NS}svg" and root.find(f"{SVG_NS}title") is not None
    return root


def test_the_figure_has_a_point_per_format_and_the_llama_cpp_line(measured):
    root = parse(quant_figure(measured))
    points = root.findall(f"{SVG_NS}circle")
    assert len(points) == len(FORMATS)
    texts = [t.text or "" for t in root.iter(f"{SVG_NS}text")]
    for name in FORMATS:
        assert any(t.startswith(f"{name} ") for t in texts), name
    assert any(t.startswith(LLAMA_CPP_LABEL) for t in texts)
    dashed = [line for line in root.findall(f"{SVG_NS}line") if line.get("stroke-dasharray")]
    assert len(dashed) == 1 and dashed[0].get("y1") == dashed[0].get("y2")
    # float32 sits at KL 0, on the y axis; faster formats are higher (smaller y).
    by_name = dict(zip(measured["speed"]["formats"], points, strict=True))
    assert by_name["float32"].get("cx") == "70"
    speed = measured["speed"]["formats"]
    order = sorted(FORMATS, key=lambda name: speed[name]["decode_tokens_per_s"])
    heights = [float(by_name[name].get("cy")) for name in order]
    assert heights == sorted(heights, reverse=True)


def test_a_smoke_figure_says_so(smoke):
    texts = [t.text for t in parse(quant_figure(smoke)).iter(f"{SVG_NS}text")]
    assert any("not measurements" in (t or "") for t in texts)


def test_the_figure_exists_only_with_the_results_file(tmp_path, smoke):
    assert quant_figures(tmp_path) == {}
    (tmp_path / QUANT_FILE).write_text(json.dumps(smoke))
    figures = quant_figures(tmp_path)
    assert list(figures) == [QUANT_FIGURE]
    parse(figures[QUANT_FIGURE])


def test_the_performance_page_has_the_section_and_links_the_page(tmp_path, measured):
    assert "Not measured yet: run `make bench-quant`" in performance_page(tmp_path)
    (tmp_path / QUANT_FILE).write_text(json.dumps(measured))
    page = performance_page(tmp_path)
    assert "## Weight formats on a CPU" in page and "(quantization.md)" in page
    assert measured["date"] in page


def test_the_built_page_renders_the_results_file_or_says_not_measured(built_site):
    page = (built_site / "quantization" / "index.html").read_text()
    assert "<!-- quant-results -->" not in page
    for clause in ("quant-group-1", "quant-linear-1", "quant-tol-1", "quant-round-1"):
        assert f'href="../stages/quant/#{clause}"' in page
    assert 'href="../stages/quant/#gguf-groups-1"' in page
    results = ROOT / "results" / QUANT_FILE
    figure = built_site / QUANT_FIGURE
    if results.exists():
        assert json.loads(results.read_text())["date"] in page
        assert "assets/figures/quant-tradeoff.svg" in page and figure.is_file()
    else:
        assert "Not measured yet" in page and "make bench-quant" in page
        assert not figure.exists()
