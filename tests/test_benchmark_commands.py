"""The benchmark commands, end to end on a machine without a GPU.

Without CUDA a GPU benchmark refuses before doing any work; `--smoke` runs it
on tiny shapes in the Triton interpreter and writes a results file of the real
run's form. The CPU benchmark of speculative decoding runs its `--smoke` on a
tiny random model, and so does the prefix-caching one; the serving benchmark's
`--smoke` serves the bundled model to a few clients for a few tokens, and the
structured-outputs one runs 4 prompts of the bundled model for a few tokens, and
the weight-formats one decodes a few tokens in each format (and with llama.cpp)
and scores one short window, and the one against llama.cpp runs its decodespec
side and llama-cpp-python in-process for a few tokens (not llama-server, which
it would build).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
ATTENTION = [sys.executable, "-m", "tests.benchmarks.attention"]
PEERS = {"sdpa", "flex_attention", "flashinfer"}
SAMPLING = [sys.executable, "-m", "tests.benchmarks.sampling"]
SAMPLING_PEERS = {"sort_based", "flashinfer"}
SPECULATIVE = [sys.executable, "-m", "tests.benchmarks.speculative"]
SERVE = [sys.executable, "-m", "tests.benchmarks.serve"]
PREFIX = [sys.executable, "-m", "tests.benchmarks.prefix"]
STRUCTURED = [sys.executable, "-m", "tests.benchmarks.structured"]
QUANT = [sys.executable, "-m", "tests.benchmarks.quant"]
QUANT_LINEAR = [sys.executable, "-m", "tests.benchmarks.quant_linear"]
VERSUS_LLAMA = [sys.executable, "-m", "tests.benchmarks.versus_llama"]
GPU_CHECK = [sys.executable, "-m", "tests.benchmarks.gpu_check"]
GPU_ENGINE = [sys.executable, "-m", "tests.benchmarks.gpu_engine"]


def run(command: list[str], **extra_env: str) -> subprocess.CompletedProcess:
    """Run `command` from the repository root; --smoke must switch the interpreter on itself."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env.update(extra_env)
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def is_finite_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="a CUDA GPU is present: the benchmark runs instead of refusing",
)
@pytest.mark.parametrize(
    "command",
    [ATTENTION, SAMPLING, QUANT_LINEAR, GPU_ENGINE],
    ids=["attention", "sampling", "quant-linear", "gpu-engine"],
)
def test_benchmark_refuses_without_cuda(tmp_path, command):
    out = tmp_path / "results.json"
    result = run([*command, "--out", str(out)])
    assert result.returncode == 2, result.stderr
    assert "a CUDA GPU is required" in result.stderr
    assert "--smoke" in result.stderr
    assert not out.exists()


def assert_smoke_header(report: dict) -> None:
    assert report["smoke"] is True
    assert "not measurements" in report["note"]
    assert {"date", "torch", "triton", "device"} <= set(report["environment"])
    assert is_finite_number(report["copy_bandwidth"]["GBps"])


def assert_peers(peers: dict, names: set[str], always: str) -> None:
    """Every peer is measured or says why not; `always` runs everywhere."""
    assert set(peers) == names
    assert "median_ms" in peers[always], f"{always} runs everywhere"
    for name, peer in peers.items():
        if "unavailable" in peer:
            assert isinstance(peer["unavailable"], str) and peer["unavailable"], name
        else:
            assert is_finite_number(peer["median_ms"]) and is_finite_number(peer["ratio"]), name


def test_attention_benchmark_smoke(tmp_path):
    out = tmp_path / "results" / "attention.json"
    result = run([*ATTENTION, "--smoke", "--out", str(out)])
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert_smoke_header(report)
    kinds = {shape["shape"]["q_len"] > 1 for shape in report["shapes"]}
    assert kinds == {False, True}, "a decode shape and a chunked-prefill shape"

    for shape in report["shapes"]:
        assert shape["name"] in result.stdout
        ours = shape["ours"]
        assert isinstance(ours["num_splits"], int) and ours["num_splits"] >= 1
        for key in ("median_ms", "bytes", "GBps", "percent_of_copy_bandwidth"):
            assert is_finite_number(ours[key]) and ours[key] > 0, key
        assert is_finite_number(ours["relative_error_vs_sdpa"])
        assert ours["within_tolerance"] is True
        assert_peers(shape["peers"], PEERS, always="sdpa")

    targets = report["targets"]
    assert len(targets) == 3
    assert all(target["met"] in (True, False, None) for target in targets)
    assert [target["met"] for target in targets[:2]] == [None, None], "issue shapes not run"


def test_sampling_benchmark_smoke(tmp_path):
    out = tmp_path / "results" / "sampling.json"
    result = run([*SAMPLING, "--smoke", "--out", str(out)])
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert_smoke_header(report)
    params = {case["case"]["params"]["name"] for case in report["cases"]}
    assert len(params) == 4, "every parameter set, greedy + logprobs included"

    for case in report["cases"]:
        assert case["name"] in result.stdout
        ours = case["ours"]
        for key in ("median_ms", "logits_bytes", "one_read_ms", "ratio_to_one_read"):
            assert is_finite_number(ours[key]) and ours[key] > 0, key
        assert ours["fraction_equal_to_spec"] == 1.0, case["name"]
        assert_peers(case["peers"], SAMPLING_PEERS, always="sort_based")

    targets = report["targets"]
    assert len(targets) == 3
    assert [target["met"] for target in targets] == [None, None, None], "nothing to compare"


def test_quant_linear_benchmark_smoke(tmp_path):
    """int4 and int8, decode and prefill rows: timed, checked against the spec, and
    compared with the dense product."""
    out = tmp_path / "results" / "quant_linear.json"
    result = run([*QUANT_LINEAR, "--smoke", "--out", str(out)])
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert_smoke_header(report)
    assert {(c["case"]["bits"], c["case"]["m"] == 1) for c in report["cases"]} == {
        (4, True),
        (4, False),
        (8, True),
        (8, False),
    }
    for case in report["cases"]:
        assert case["name"] in result.stdout
        assert case["ours"]["within_tolerance"] is True
        for part, keys in (("ours", ("median_ms", "bytes", "GBps")), ("dense", ("ratio",))):
            for key in keys:
                assert is_finite_number(case[part][key]) and case[part][key] > 0, (part, key)
    assert report["all_within_tolerance"] is True


def test_speculative_benchmark_smoke(tmp_path):
    """Plain, prompt lookup and layers:N on each workload; greedy tokens unchanged."""
    from docs.tools.performance import speculative_section

    out = tmp_path / "results" / "cpu-speculative.json"
    result = run([*SPECULATIVE, "--smoke", "--num-draft", "2,4", "--out", str(out)])
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["smoke"] is True and "not measurements" in report["note"]
    header = {"benchmark", "command", "date", "device", "cores", "threads", "software", "model"}
    assert header | {"statistic", "workloads", "targets", "same_tokens"} <= set(report)
    assert {"python", "torch"} <= set(report["software"])
    assert report["same_tokens"] is True

    assert [w["name"] for w in report["workloads"]] == ["repeat", "novel"]
    for workload in report["workloads"]:
        assert workload["name"] in result.stdout
        rows = workload["results"]
        assert [row["configuration"] for row in rows] == [
            "plain",
            "ngram K=2",
            "ngram K=4",
            "layers:1 K=4",
        ]
        assert rows[0]["speedup_vs_plain"] == 1.0 and rows[0]["acceptance_rate"] is None
        for row in rows:
            assert row["same_tokens_as_plain"] is True, row["configuration"]
            for key in ("wall_s", "end_to_end_tokens_per_s", "speedup_vs_plain"):
                assert is_finite_number(row[key]) and row[key] > 0, key
            assert row["completion_tokens"] == report["max_tokens"]
            assert row["accepted_tokens"] <= row["draft_tokens"]
            assert row["tokens_per_target_pass"] >= 1

    targets = report["targets"]
    assert len(targets) == 4, "each prompt-lookup K on each workload"
    assert all(target["met"] in (True, False) for target in targets)

    section = speculative_section(report)
    assert "Smoke run" in section and "| plain | – | 1.00 |" in section


def test_serve_benchmark_smoke(tmp_path):
    """Concurrency 1, 4 and 16 against a live server, the in-process baseline, the targets."""
    from docs.tools.performance import serve_section

    out = tmp_path / "results" / "serve-cpu.json"
    result = run([*SERVE, "--smoke", "--out", str(out)])
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["smoke"] is True and "not measurements" in report["note"]
    header = {"benchmark", "command", "date", "device", "cores", "threads", "software", "model"}
    assert header | {"statistic", "runs", "in_process_tokens_per_s", "targets"} <= set(report)
    assert {"python", "torch", "starlette", "uvicorn", "httpx"} <= set(report["software"])
    assert report["command"].startswith("python -m tests.benchmarks.serve --smoke")

    assert [row["concurrency"] for row in report["runs"]] == [1, 4, 16]
    for row in report["runs"]:
        assert str(row["concurrency"]) in result.stdout
        assert row["completed"] == row["requests"] and row["failed"] == 0
        assert row["output_tokens"] == row["requests"] * report["max_tokens"]
        for key in ("duration_s", "output_tokens_per_s"):
            assert is_finite_number(row[key]) and row[key] > 0, key
        for figures in (row["ttft_ms"], row["itl_ms"]):
            assert set(figures) == {"mean", "p50", "p99"}
            assert all(is_finite_number(v) and v > 0 for v in figures.values()), figures
            assert figures["p50"] <= figures["p99"]
    assert is_finite_number(report["in_process_tokens_per_s"])
    assert len(report["targets"]) == 2
    assert all(target["met"] in (True, False) for target in report["targets"])

    section = serve_section(report)
    assert "Smoke run" in section and "| 16 | 16 |" in section
    assert "in-process" in section and report["date"] in section


def test_prefix_benchmark_smoke(tmp_path):
    """Each system-prompt length with the cache off and on; later questions hit it."""
    from docs.tools.figures import prefix_cache_figure
    from docs.tools.performance import prefix_section

    out = tmp_path / "results" / "prefix-cpu.json"
    result = run([*PREFIX, "--smoke", "--out", str(out)])
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["smoke"] is True and "not measurements" in report["note"]
    header = {"benchmark", "command", "date", "device", "cores", "threads", "software", "model"}
    assert header | {"statistic", "lengths", "targets", "same_tokens", "backend"} <= set(report)
    assert report["same_tokens"] is True
    assert [row["system_tokens"] for row in report["lengths"]] == [24, 40]
    for row in report["lengths"]:
        off, on = row["cache_off"], row["cache_on"]
        assert off["warm_cached_tokens"] == [0] * (row["questions"] - 1)
        # The system prompt's whole blocks of 16 at least, never the whole prompt.
        for cached, prompt in zip(on["warm_cached_tokens"], on["warm_prompt_tokens"], strict=True):
            assert row["system_tokens"] // 16 * 16 <= cached < prompt
        assert 0 < on["hit_rate"] < 1 and off["hit_rate"] == 0
        for key in ("cold_ttft_ms", "warm_ttft_ms"):
            assert is_finite_number(off[key]) and is_finite_number(on[key]) and on[key] > 0
        assert str(row["system_tokens"]) in result.stdout
    assert len(report["targets"]) == 2
    assert all(target["met"] in (True, False) for target in report["targets"])

    section = prefix_section(report)
    assert "Smoke run" in section and "| 24 |" in section and "ttft-prefix-cache.svg" in section
    assert prefix_cache_figure(report).startswith("<svg")


def test_structured_benchmark_smoke(tmp_path):
    """Both modes over the four schemas, the mask's cost, both matchers on the same tokens."""
    from docs.tools.performance import structured_section

    out = tmp_path / "results" / "structured-cpu.json"
    result = run([*STRUCTURED, "--smoke", "--out", str(out)])
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["smoke"] is True and "not measurements" in report["note"]
    header = {"benchmark", "command", "date", "device", "cores", "threads", "software", "model"}
    assert header | {"batching", "sampling", "load_average", "targets", "anchor"} <= set(report)
    assert {"python", "torch", "xgrammar", "llguidance", "jsonschema"} <= set(report["software"])
    assert report["prompts"] == 4 and set(report["schemas"]) == {"flat", "nested", "enum", "array"}
    for mode in ("unconstrained", "constrained"):
        m = report[mode]
        assert m["requests"] == 4 and set(m["by_schema"]) == set(report["schemas"])
        assert sum(m["finish_reasons"].values()) == 4
        assert set(m["finish_reasons"]) <= {"stop", "length"}
        for key in ("valid_json_rate", "schema_valid_rate", "schema_valid_rate_with_fenced"):
            assert 0 <= m[key] <= 1, key
        assert m["schema_valid_rate"] <= m["valid_json_rate"]
        assert is_finite_number(m["decode_tokens_per_s"]) and m["decode_tokens_per_s"] > 0
        assert mode in result.stdout
    assert report["unconstrained"]["mask_fills"] == 0
    constrained = report["constrained"]
    # A mask for every decode-phase token of a constrained request.
    assert constrained["mask_fills"] == constrained["decode_tokens"] > 0
    # A constrained answer that stopped is complete: it parses and fits its schema.
    stopped = constrained["finish_reasons"].get("stop", 0)
    assert constrained["schema_valid_rate"] * 4 >= stopped
    cost = report["mask_overhead"]
    for key in ("fill_us_per_token", "mask_us_per_token", "decode_us_per_token"):
        assert is_finite_number(cost[key]), key
    assert is_finite_number(cost["percent_of_decode"])
    assert cost["fill_us_per_token"] > 0 and cost["decode_us_per_token"] > 0
    matchers = report["matchers"]
    for name in ("xgrammar", "llguidance"):
        lib = matchers[name]
        assert lib["rejected_tokens"] == 0, name
        assert lib["fill"]["masks"] == matchers["masks_compared"] > 0
        assert is_finite_number(lib["tables_ms"]) and is_finite_number(lib["fill"]["median_us"])
    assert set(matchers["compile_ms"]) == set(report["schemas"])
    assert [t["met"] in (True, False) for t in report["targets"]] == [True, True]

    section = structured_section(report)
    assert "Smoke run" in section and "| constrained |" in section
    assert report["date"] in section and "xgrammar 0." in section


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is present: it runs")
def test_gpu_check_refuses_without_cuda(tmp_path):
    result = run([*GPU_CHECK, "--out-dir", str(tmp_path)])
    assert result.returncode == 2, result.stderr
    assert "a CUDA GPU is required" in result.stderr and "--smoke" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_gpu_check_smoke_runs_every_stage_and_summarises(tmp_path):
    """The one GPU command end to end in the interpreter: every stage passes and
    writes its file; the summary names the stages, their status and the versions."""
    result = run([*GPU_CHECK, "--smoke", "--out-dir", str(tmp_path)])
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "gpu-check.json").read_text())
    assert summary["smoke"] is True and "not measurements" in summary["note"]
    assert {"date", "torch", "triton", "device"} <= set(summary["environment"])
    assert list(summary["stages"]) == ["tests", "attention", "sampling", "quant_linear", "engine"]
    assert summary["passed"] is True
    for name, stage in summary["stages"].items():
        assert stage["passed"] and stage["returncode"] == 0, name
        assert is_finite_number(stage["seconds"]), name
    assert "passed" in summary["stages"]["tests"]["output_tail"]
    engine = json.loads((tmp_path / "engine-gpu.json").read_text())
    assert [row["backend"] for row in engine["backends"]] == ["spec", "torch", "triton"]
    assert engine["same_tokens"] is True
    assert all(is_finite_number(row["ttft_ms"]) for row in engine["backends"])
    for name in ("attention", "sampling", "quant_linear"):
        assert json.loads((tmp_path / f"{name}-gpu.json").read_text())["smoke"] is True


def test_gpu_check_records_failing_and_hanging_stages_and_exits_1(tmp_path, monkeypatch):
    """A stage that fails or outlasts its limit is recorded with its output; the
    stages after it still run, and the command exits 1."""
    from tests.benchmarks import gpu_check

    python = sys.executable
    plan = [
        ("fails", [python, "-c", "import sys; print('boom'); sys.exit(3)"], {}, 60),
        (
            "hangs",
            [python, "-c", "import time; print('waiting', flush=True); time.sleep(30)"],
            {},
            2,
        ),
        ("passes", [python, "-c", "print('fine')"], {"X": "1"}, 60),
    ]
    monkeypatch.setattr(gpu_check, "stages", lambda out_dir, smoke: plan)
    assert gpu_check.main(["--smoke", "--out-dir", str(tmp_path)]) == 1
    stages = json.loads((tmp_path / "gpu-check.json").read_text())["stages"]
    assert stages["fails"]["returncode"] == 3 and "boom" in stages["fails"]["output_tail"]
    assert stages["hangs"]["returncode"] is None
    assert "stopped after 2 s" in stages["hangs"]["output_tail"]
    assert stages["passes"]["passed"] and stages["passes"]["environment"] == {"X": "1"}
    with pytest.raises(SystemExit):
        gpu_check.main(["--smoke", "--only", "nonsense", "--out-dir", str(tmp_path)])


def test_quant_benchmark_smoke(tmp_path):
    """Every format decodes beside llama.cpp and is scored against float32."""
    out = tmp_path / "results" / "quant.json"
    result = run([*QUANT, "--smoke", "--out", str(out)])
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["smoke"] is True and "not measurements" in report["note"]
    speed, quality = report["speed"], report["quality"]
    assert is_finite_number(speed["llama_cpp"]["decode_tokens_per_s"])
    assert list(speed["formats"]) == ["float32", "bfloat16", "int8", "int4"]
    sizes = [row["weight_bytes"] for row in speed["formats"].values()]
    assert sizes == sorted(sizes, reverse=True), "each format smaller than the one before"
    for name, row in speed["formats"].items():
        assert is_finite_number(row["decode_tokens_per_s"]) and row["over_llama_cpp"] > 0, name
        assert name in result.stdout
    scores = {score["weights"]: score for score in quality["formats"]}
    assert list(scores) == ["float32", "bfloat16", "int8", "int4"]
    assert scores["float32"]["kl_max"] == 0 and scores["float32"]["top1_agreement"] == 1
    assert all(scores[name]["kl_mean"] > 0 for name in ("bfloat16", "int8", "int4"))
    assert [t["met"] in (True, False) for t in report["targets"]] == [True, True]


def test_versus_llama_benchmark_smoke(tmp_path):
    """Decode and prefill beside llama-cpp-python, and `decodespec serve` (its defaults)
    at 1, 4 and 16 streams; llama-server skipped, its columns empty, its targets unmeasured."""
    from docs.tools.performance import versus_llama_sections

    out = tmp_path / "results" / "versus-llama-cpu.json"
    # a shell that set decodespec's wait policy: llama.cpp must not inherit it
    result = run(
        [*VERSUS_LLAMA, "--smoke", "--skip-llama-server", "--out", str(out)],
        OMP_WAIT_POLICY="PASSIVE",
        DECODESPEC_NATIVE_ISA="avx2",
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["smoke"] is True and "not measurements" in report["note"]
    assert report["command"].startswith("python -m tests.benchmarks.versus_llama --smoke")
    assert {"python", "torch", "llama-cpp-python"} <= set(report["software"])
    assert report["llama_server_build"] is None and report["llama_server"] is None
    assert report["llama_server_skipped"] == "--skip-llama-server"
    peer = report["peer_environment"]
    assert {"OMP_WAIT_POLICY", "DECODESPEC_NATIVE_ISA"} <= set(peer["removed"]), peer
    assert peer["build"]["options"][0] == "-DGGML_NATIVE=OFF"
    assert "-DGGML_AMX_TILE=ON" not in peer["build"]["options"] and peer["build"]["cpu"]
    assert report["llama_cpp_in_process"]["system_info"].startswith("CPU :")
    for stage in ("decode", "prefill"):
        for key in ("decodespec_tokens_per_s", "llama_cpp_tokens_per_s", "ratio"):
            assert is_finite_number(report[stage][key]) and report[stage][key] > 0, (stage, key)
        for key in ("decodespec_tokens_per_s", "llama_cpp_tokens_per_s"):
            assert report[stage][f"{key}_best"] >= report[stage][key], (stage, key)
    bound = report["memory_bound"]
    assert is_finite_number(bound["read_GBps"]) and bound["read_GBps"] > 0
    for name in ("decodespec", "llama.cpp"):  # the bundled model reads about 100 MB a token
        assert 60e6 < bound[name]["bytes_per_token"] < 160e6, bound
        assert is_finite_number(bound[name]["fraction_of_bound"]), bound
    server = report["decodespec"]["server"]
    assert any(line.startswith("serving ") for line in server["stderr"]), server["stderr"]
    assert server["check"]["usage"]["completion_tokens"] == report["serving"]["max_tokens"]
    levels = report["serving"]["levels"]
    assert [level["concurrency"] for level in levels] == [1, 4, 16]
    for level in levels:
        ours = level["decodespec"]
        assert ours["completed"] == ours["requests"] == level["requests"]
        assert ours["output_tokens"] == ours["requests"] * report["serving"]["max_tokens"]
        assert level["llama-server"] is None and level["ratio"] is None
    assert set(report["ratios"]) == {"decode", "prefill", "serving_1", "serving_4", "serving_16"}
    met = {target["key"]: target["met"] for target in report["targets"]}
    assert met["serving_4"] is None and met["serving_16"] is None
    assert met["decode"] in (True, False) and met["prefill"] in (True, False)
    assert "decode tok/s" in result.stdout and "not measured" in result.stdout

    assert report["cpu_family"].split("-")[0] in ("amd", "intel", "other")
    section = versus_llama_sections([report])
    assert "Smoke run" in section and report["date"] in section
    assert "| serving tok/s, 16 streams (16 requests) |" in section
    assert f"| {report['cpu_family']} ({report['device']}) |" in section  # the families' table


def test_chunked_prefill_benchmark_smoke(tmp_path):
    """The burst and the long prompt with the default budget and none: every request
    completes, the TTFTs and rates are measured, the path is the default's; the
    Performance page's section renders it."""
    from docs.tools.chunked import chunked_section

    out = tmp_path / "chunked.json"
    result = run([sys.executable, "-m", "tests.benchmarks.chunked_prefill", "--smoke",
                  "--out", str(out)])  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["smoke"] is True and "not measurements" in report["note"]
    assert "token budget 128" in report["path"] and "backend torch" in report["path"]
    assert [row["token_budget"] for row in report["budgets"]] == [None, 128]
    for row in report["budgets"]:
        for key in ("alone_ttft_ms", "ttft_ms_p50", "ttft_ms_p99", "output_tokens_per_s",
                    "decode_tokens_per_s_without", "decode_tokens_per_s_during",
                    "decode_longest_wait_ms", "long_prompt_ttft_ms"):  # fmt: skip
            assert is_finite_number(row[key]) and row[key] > 0, (row, key)
        assert row["ttft_ms_p50"] <= row["ttft_ms_p99"]
    assert [row["long_prompt_interval"] for row in report["budgets"]] == [1, 12]
    assert [t["met"] in (True, False) for t in report["targets"]] == [True, True]
    section = chunked_section(report)
    assert "Smoke run" in section and "| whole prompts |" in section
    assert "| 128 / 64 / 12 |" in section


def test_no_results_file_holds_this_machines_absolute_paths():
    """Results are written through write_json, which makes paths portable: relative to
    the repository, `~` for the home folder, `site-packages/` for an environment's."""
    from tests.benchmarks.gpu import portable_path

    home = str(Path.home())
    assert portable_path(f"{ROOT}/results/x.json {home}/.cache/y") == "results/x.json ~/.cache/y"
    assert portable_path("/opt/v/lib/python3.12/site-packages/torch/a.py") == (
        "site-packages/torch/a.py"
    )
    for path in sorted((ROOT / "results").glob("*.json")):
        text = path.read_text()
        for absolute in (f"{ROOT}/", f"{home}/"):
            assert absolute not in text, (path.name, absolute)
