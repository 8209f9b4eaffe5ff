"""The figures, data files and performance page of the documentation site.

The SVG module writes well-formed XML; `docs/data/*.json` holds what the
figures draw (distributions that sum to 1); the performance page renders a
table for each results file present and "Not measured yet" for each missing
one; captions name the device and date of their data.
"""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from docs.tools import svg
from docs.tools.figures import DATA_DIR, all_figures, fill_captions
from docs.tools.performance import performance_figures, performance_page

ROOT = Path(__file__).resolve().parents[2]
SVG_NS = "{http://www.w3.org/2000/svg}"


def parse_svg(document: str) -> ET.Element:
    root = ET.fromstring(document)
    assert root.tag == f"{SVG_NS}svg"
    assert root.find(f"{SVG_NS}title") is not None
    return root


def load_data(name: str) -> dict:
    return json.loads((DATA_DIR / name).read_text())


# ---------------------------------------------------------------- the SVG module


def test_line_chart_is_well_formed_xml():
    chart = svg.line_chart(
        [svg.Series("a <&> b", [1, 2, 3], [0.5, 4.0, 9.5]), svg.Series("c", [1, 3], [2, 1])],
        title='quotes " and <tags>',
        x_label="x",
        y_label="y",
    )
    root = parse_svg(chart)
    assert len(root.findall(f"{SVG_NS}polyline")) == 2
    assert "a <&> b" in [t.text for t in root.iter(f"{SVG_NS}text")]


def test_bar_chart_is_well_formed_xml_with_one_bar_per_label():
    chart = svg.bar_chart(
        ["␣Paris", "<b>", "&"],
        [0.5, 0.25, 0.0],
        title="bars",
        subtitle="sub",
        value_label="p",
        highlight=[True, False, False],
        dimmed=[False, False, True],
    )
    root = parse_svg(chart)
    texts = [t.text for t in root.iter(f"{SVG_NS}text")]
    assert {"bars", "sub", "␣Paris", "<b>", "&"} <= set(texts)
    fills = [r.get("fill") for r in root.findall(f"{SVG_NS}rect")]
    assert fills.count(svg.HIGHLIGHT) == 1
    assert fills.count(svg.GRID) == 1


def test_nice_ticks_cover_the_maximum():
    for high in (0.336, 1, 7, 1024, 5280.2):
        ticks = svg.nice_ticks(high)
        assert ticks[0] == 0 and ticks[-1] >= high and len(ticks) <= 7


def test_every_site_figure_is_well_formed_xml():
    figures = all_figures()
    assert "assets/figures/decode-loop.svg" in figures
    for path, document in figures.items():
        assert path.startswith("assets/figures/") and path.endswith(".svg")
        parse_svg(document)


# ---------------------------------------------------------------- data files


def test_sampling_data_has_the_expected_fields():
    data = load_data("sampling.json")
    for field in ("date", "device", "torch", "python", "command", "question"):
        assert data[field]
    tokens = data["distribution"]["tokens"]
    assert len(tokens) == 20 and all("id" in t and "text" in t for t in tokens)
    steps = data["generation"]["steps"]
    assert steps and all(len(step["candidates"]) == 5 for step in steps)


def test_each_distribution_view_sums_to_one():
    views = load_data("sampling.json")["distribution"]["views"]
    assert {"raw", "top-k-5", "combined"} <= {v["name"] for v in views}
    for view in views:
        assert math.isclose(sum(view["probs"]) + view["rest"], 1.0, abs_tol=1e-4), view["name"]
        assert all(0 <= p <= 1 for p in view["probs"])
        assert view["kept"] >= sum(p > 0 for p in view["probs"])


def test_generation_candidates_are_ordered_probabilities():
    for step in load_data("sampling.json")["generation"]["steps"]:
        probs = [c["prob"] for c in step["candidates"]]
        assert probs == sorted(probs, reverse=True) and sum(probs) <= 1 + 1e-4
        if step["rank"] <= len(probs):
            assert step["candidates"][step["rank"] - 1]["id"] == step["token"]["id"]


def test_engine_timing_data_has_the_expected_fields():
    data = load_data("engine-timing.json")
    for field in ("date", "device", "torch", "threads", "command"):
        assert data[field]
    rows = data["prompt_lengths"]
    assert [r["prompt_tokens"] for r in rows] == sorted(r["prompt_tokens"] for r in rows)
    assert all(r["ttft_ms"] > 0 and r["decode_ms_per_token"] > 0 for r in rows)
    times = data["timeline"]["token_times_ms"]
    assert len(times) == data["timeline"]["output_tokens"] and times == sorted(times)


# ---------------------------------------------------------------- the performance page


def synthetic_attention() -> dict:
    """The structure `tests/benchmarks/attention.py` writes, with made-up numbers."""
    return {
        "benchmark": "attention-gpu",
        "command": "make bench-attention",
        "smoke": False,
        "environment": {
            "date": "2026-11-20T10:00:00+00:00",
            "python": "3.11.7",
            "torch": "2.13.0",
            "triton": "3.9.0",
            "cuda": "12.8",
            "device": "Synthetic GPU 9000",
        },
        "statistic": "median (triton.testing.do_bench, L2 flushed)",
        "copy_bandwidth": {"bytes": 1 << 30, "median_ms": 1.0, "GBps": 2000.0},
        "shapes": [
            {
                "name": "decode b64 ctx8192",
                "shape": {"batch": 64, "seq_len": 8192},
                "ours": {"median_ms": 0.5, "GBps": 1800.0, "percent_of_copy_bandwidth": 90.0},
                "peers": {
                    "sdpa": {"median_ms": 1.0, "ratio": 2.0},
                    "flashinfer": {"unavailable": "not installed"},
                },
            }
        ],
        "targets": [
            {"target": ">= 90% of the measured copy bandwidth", "met": True},
            {"target": "no slower than the fastest peer on any shape", "met": None},
        ],
    }


def synthetic_sampling() -> dict:
    """The structure `tests/benchmarks/sampling.py` writes, with made-up numbers."""
    return {
        "benchmark": "sampling-gpu",
        "command": "make bench-sampling",
        "smoke": True,
        "note": "smoke numbers",
        "environment": {"date": "2026-11-20T11:00:00+00:00", "torch": "2.13.0", "device": "cpu"},
        "statistic": "one call",
        "copy_bandwidth": {"bytes": 1 << 24, "median_ms": 1.0, "GBps": 33.5},
        "cases": [
            {
                "name": "b256 v128256 float32 top-p 0.9",
                "case": {"batch": 256, "vocab": 128256},
                "ours": {
                    "median_ms": 0.2,
                    "logits_bytes": 131334144,
                    "one_read_ms": 0.1,
                    "ratio_to_one_read": 2.0,
                    "fraction_equal_to_spec": 1.0,
                },
                "peers": {"sort_based": {"median_ms": 2.0, "ratio": 10.0}},
            }
        ],
        "targets": [{"target": "within 2x of one read of the logits", "met": False}],
    }


def synthetic_serve() -> dict:
    """The structure `tests/benchmarks/serve.py` writes, with made-up numbers."""

    def run(concurrency: int, tokens_per_s: float, ttft: float, itl: float) -> dict:
        return {
            "concurrency": concurrency,
            "requests": 2 * concurrency,
            "completed": 2 * concurrency,
            "output_tokens": 64 * concurrency,
            "duration_s": 64 * concurrency / tokens_per_s,
            "output_tokens_per_s": tokens_per_s,
            "ttft_ms": {"mean": ttft, "p50": ttft, "p99": 2 * ttft},
            "itl_ms": {"mean": itl, "p50": itl, "p99": 1.5 * itl},
        }

    return {
        "benchmark": "serve-cpu",
        "command": "make bench-serve",
        "smoke": False,
        "date": "2026-11-22T09:00:00+00:00",
        "device": "Synthetic CPU 7",
        "cores": 2,
        "threads": 2,
        "software": {"python": "3.11.7", "torch": "2.13.0", "starlette": "1.0", "uvicorn": "0.5"},
        "model": "SmolLM2-135M-Instruct",
        "backend": "torch",
        "client": "httpx over loopback",
        "sampling": "greedy",
        "max_tokens": 32,
        "prompts": 16,
        "statistic": "fastest of 2 rounds",
        "runs": [run(1, 16.0, 70.0, 62.0), run(4, 50.0, 120.0, 80.0), run(16, 100.0, 600.0, 150.4)],
        "in_process_concurrency": 16,
        "in_process_tokens_per_s": 104.0,
        "targets": [
            {"target": "16 streams: >= 5x one stream", "met": True},
            {"target": "16 streams: >= 80% of the in-process engine", "met": False},
        ],
    }


def test_missing_results_say_not_measured_yet(tmp_path):
    page = performance_page(tmp_path)
    assert "Not measured yet: run `make bench-attention` on a GPU" in page
    assert "Not measured yet: run `make bench-sampling` on a GPU" in page
    assert "Not measured yet: run `make bench-cpu`" in page
    assert "Not measured yet: run `make bench-serve`" in page
    assert "Not measured yet: run `make bench-prefix`" in page
    assert "Not measured yet: run `make bench-structured`" in page
    assert "make bench-serve` on a GPU" not in page
    assert performance_figures(tmp_path) == {}


@pytest.fixture
def results_dir(tmp_path):
    (tmp_path / "attention-gpu.json").write_text(json.dumps(synthetic_attention()))
    (tmp_path / "sampling-gpu.json").write_text(json.dumps(synthetic_sampling()))
    (tmp_path / "serve-cpu.json").write_text(json.dumps(synthetic_serve()))
    return tmp_path


def test_present_results_render_tables_device_and_date(results_dir):
    page = performance_page(results_dir)
    assert "Not measured yet: run `make bench-attention`" not in page
    assert "| decode b64 ctx8192 | 0.500 | 1800.0 | 90% | 1.000 ms (×2.00) | n/a |" in page
    assert "| b256 v128256 float32 top-p 0.9 | 0.200 | 0.100 | 2.00 | 1.000 |" in page
    assert "Synthetic GPU 9000" in page and "2026-11-20T10:00:00+00:00" in page
    assert "flashinfer (not installed)" in page
    assert "Smoke run" in page  # the sampling file is a --smoke run
    assert "**NOT met**" in page and ": met" in page
    assert "| 16 | 32 | 100.0 | 600 / 1200 | 150 / 226 |" in page
    assert "| 1 | 2 | 16.0 | 70 / 140 | 62 / 93 |" in page
    assert "Synthetic CPU 7, 2 cores" in page and "2026-11-22T09:00:00+00:00" in page
    assert "same 16 requests added at once (best of its rounds): 104.0 tok/s" in page
    assert "starlette 1.0, uvicorn 0.5" in page
    for document in performance_figures(results_dir).values():
        parse_svg(document)


def test_performance_page_names_device_and_date_of_cpu_engine():
    cpu = json.loads((ROOT / "results" / "cpu-engine.json").read_text())
    page = performance_page()
    assert cpu["device"] in page and cpu["date"] in page
    assert f"{cpu['runs'][0]['ours_decode_tokens_per_s']:.1f}" in page


def test_performance_page_shows_the_serving_benchmark():
    serve = json.loads((ROOT / "results" / "serve-cpu.json").read_text())
    page = performance_page()
    assert "## Serving on a CPU" in page and "make bench-serve" in page
    assert serve["device"] in page and serve["date"] in page
    for run in serve["runs"]:
        assert (
            f"| {run['concurrency']} | {run['requests']} | {run['output_tokens_per_s']:.1f} |"
            in page
        )
    assert f"{serve['in_process_tokens_per_s']:.1f} tok/s" in page
    assert f"backend `{serve['backend']}`" in page


def test_performance_page_and_home_figure_show_the_prefix_caching_benchmark():
    prefix = json.loads((ROOT / "results" / "prefix-cpu.json").read_text())
    assert prefix["smoke"] is False and prefix["same_tokens"] is True
    page = performance_page()
    assert "## Prefix caching on a CPU" in page and prefix["command"] in page
    assert prefix["device"] in page and prefix["date"] in page
    for row in prefix["lengths"]:
        off, on = row["cache_off"], row["cache_on"]
        cells = (
            f"| {row['system_tokens']} | {off['cold_ttft_ms']:.0f} | {off['warm_ttft_ms']:.0f} |"
        )
        assert f"{cells} {on['warm_ttft_ms']:.0f} | {row['warm_speedup']:.1f}× |" in page
    caption = fill_captions("<!-- measured: prefix-cpu -->")
    assert prefix["device"] in caption and prefix["command"] in caption
    parse_svg(all_figures()["assets/figures/ttft-prefix-cache.svg"])


def test_performance_page_shows_the_structured_outputs_benchmark():
    report = json.loads((ROOT / "results" / "structured-cpu.json").read_text())
    assert report["smoke"] is False and report["prompts"] == 50
    page = performance_page()
    assert "## Structured outputs on a CPU" in page and report["command"] in page
    assert report["device"] in page and report["date"] in page
    for mode in ("unconstrained", "constrained"):
        m = report[mode]
        assert f"| {mode} | {m['valid_json_rate']:.0%} | {m['schema_valid_rate']:.0%} |" in page
    for target in report["targets"]:
        assert target["target"] in page
    for check in report["checks"]:
        assert check["check"] in page
    # Both backends, each with its Test Suite soundness, JSONSchemaBench coverage and
    # the model's valid-and-stopped answers.
    assert set(report["test_suite"]["backends"]) == {"llguidance", "xgrammar"}
    for name, suite in report["test_suite"]["backends"].items():
        assert suite["cases"] > 300 and suite["invalid_run"] > 200
        assert f"| **{suite['invalid_admitted']}** of {suite['invalid_run']} |" in page
        bench = report["jsonschemabench"]["backends"][name]
        assert bench["schemas"] == 126 and f"{bench['compiled']} / 126" in page
        answers = report["jsonschemabench_model"]["backends"][name]
        assert f"{answers['valid_and_stop']} / {answers['requests']}" in page
    # The keyword × backend table has a row per group of the suite.
    assert "| `maxLength` |" in page and "| `format/date` |" in page
    values = [run["max_whitespace"] for run in report["layouts"]["runs"]]
    assert {24, 4, 1, 0} <= set(values)
    engine = [run for run in report["layouts"]["runs"] if run["engine"]]
    assert [run["max_whitespace"] for run in engine] == [report["max_json_whitespace"]]
    assert (
        f"| {engine[0]['max_whitespace']} (the engine's) | {engine[0]['stop_rate']:.0%} |" in page
    )
    failures = [
        *(u for r in report["test_suite"]["backends"].values() for u in r["unsound"]),
        *(
            b
            for r in report["jsonschemabench_model"]["backends"].values()
            for b in r["stop_but_invalid"]
        ),
    ]
    assert ("Soundness failures" in page) == bool(failures)


def test_structured_section_raises_the_alarm_on_a_soundness_failure():
    from docs.tools.performance import structured_section

    report = json.loads((ROOT / "results" / "structured-cpu.json").read_text())
    suite = report["test_suite"]["backends"]["xgrammar"]
    suite["unsound"] = [{"case": "maxLength: a case", "instance": "too long", "text": '"abc"'}]
    answers = report["jsonschemabench_model"]["backends"]["llguidance"]
    answers["stop_but_invalid"] = [
        {"schema": "Set/x", "why": "at /: 1 is not a string", "text": "1"}
    ]
    section = structured_section(report)
    assert '!!! danger "Soundness failures' in section
    assert "xgrammar, Test Suite: maxLength: a case: too long" in section
    assert "llguidance, JSONSchemaBench answer to Set/x: at /: 1 is not a string" in section


def test_built_site_structured_page_renders_its_results(built_site):
    report = json.loads((ROOT / "results" / "structured-cpu.json").read_text())
    page = (built_site / "structured" / "index.html").read_text()
    assert "<!-- structured-results -->" not in page
    assert report["date"] in page and "xgrammar" in page and "llguidance" in page
    assert "JSON Schema Test Suite" in page and "JSONSchemaBench" in page
    assert 'href="../stages/token_mask/#mask-order-1"' in page


def test_captions_name_device_date_and_command():
    cpu = json.loads((ROOT / "results" / "cpu-engine.json").read_text())
    caption = fill_captions("<!-- measured: cpu-engine -->")
    assert cpu["device"] in caption and cpu["date"] in caption and "make bench-cpu" in caption
    timing = load_data("engine-timing.json")
    caption = fill_captions("<!-- measured: engine-timing -->")
    assert timing["device"] in caption and "make docs-data" in caption


def test_built_site_has_the_performance_page_and_figures(built_site):
    page = (built_site / "performance" / "index.html").read_text()
    assert "cpu-engine" in page or "CPU" in page
    assert (built_site / "assets" / "figures" / "decode-loop.svg").is_file()
    home = (built_site / "index.html").read_text()
    assert "assets/figures/naive-vs-cached.svg" in home and "<!-- measured" not in home
