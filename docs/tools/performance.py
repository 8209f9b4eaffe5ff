"""The performance page, rendered from the benchmark results in `results/`.

`performance_page` returns the Markdown of `performance.md` and
`performance_figures` its figures; the `results_pages` hook adds both to the
site at build time. Each section names the device, software and date its
file records, or says how to measure it when the file is missing.
"""

from __future__ import annotations

import json
from pathlib import Path

from docs.tools import svg
from docs.tools.figures import FIGURES, RESULTS_DIR, read_json

CPU_FILE = "cpu-engine.json"
ATTENTION_FILE = "attention-gpu.json"
SAMPLING_FILE = "sampling-gpu.json"
SPECULATIVE_FILE = "cpu-speculative.json"
SERVE_FILE = "serve-cpu.json"
VERSUS_LLAMA_FILES = "versus-llama-cpu*.json"  # one per CPU family (bench-llama)
PREFIX_FILE = "prefix-cpu.json"
STRUCTURED_FILE = "structured-cpu.json"
PREFIX_FIGURE = f"{FIGURES}/ttft-prefix-cache.svg"
ATTENTION_FIGURE = f"{FIGURES}/attention-bandwidth.svg"
SAMPLING_FIGURE = f"{FIGURES}/sampling-one-read.svg"
NAIVE_FIGURE = f"{FIGURES}/naive-vs-cached.svg"
INTRO = """\
# Performance

Every number on this page is read from the benchmark results in `results/`
when the site is built; rerun a benchmark and rebuild to update it. Each
section says on which device, with which software and when it was measured.
"""


def table(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def not_measured(file_name: str, command: str) -> str:
    """The admonition standing in for a missing results file."""
    return (
        f'!!! warning "Not measured yet"\n\n'
        f"    Not measured yet: run `{command}` on a GPU; it writes `results/{file_name}`.\n"
    )


def measured_on(environment: dict, command: str) -> str:
    """One line: device, software versions, date and the command that measured it."""
    software = ", ".join(
        f"{name} {environment[name]}"
        for name in ("python", "torch", "triton", "cuda", "transformers", "xgrammar", "llguidance")
        if environment.get(name)
    )
    return (
        f"**Device:** {environment['device']}. **Software:** {software}. "
        f"**Date:** {environment['date']}. **Command:** `{command}`."
    )


def cpu_environment(report: dict) -> dict:
    """`measured_on`'s environment for a CPU results file: software, CPU, date."""
    return {
        **report["software"],
        "device": f"{report['device']}, {report['cores']} cores, {report['threads']} threads",
        "date": report["date"],
    }


def smoke_warning(report: dict) -> str:
    """A warning for a `--smoke` run, whose timings are not measurements."""
    if not report.get("smoke"):
        return ""
    return f'!!! danger "Smoke run"\n\n    {report.get("note", "Not a measurement.")}\n\n'


def peer_cell(peer: dict) -> str:
    """A peer's median time and its time over ours (> 1: ours is faster), or n/a."""
    if "unavailable" in peer:
        return "n/a"
    return f"{peer['median_ms']:.3f} ms (×{peer['ratio']:.2f})"


def unavailable_peers(results: list[dict]) -> str:
    """The peers that could not run, with their reasons, as a sentence (or nothing)."""
    reasons = {
        f"{name} ({peer['unavailable']})"
        for result in results
        for name, peer in result["peers"].items()
        if "unavailable" in peer
    }
    return f"Unavailable peers: {'; '.join(sorted(reasons))}.\n\n" if reasons else ""


def targets_list(targets: list[dict]) -> str:
    """The issue's targets as a list with met / NOT met / not measured."""
    verdict = {True: "met", False: "**NOT met**", None: "not measured"}
    return "\n".join(f"- {t['target']}: {verdict[t['met']]}" for t in targets) + "\n"


# ---------------------------------------------------------------- CPU engine


def cpu_section(cpu: dict | None) -> str:
    """The CPU engine against Hugging Face generate, and naive against cached decode."""
    heading = "## The engine on a CPU\n\n"
    if cpu is None:
        return heading + not_measured(CPU_FILE, "make bench-cpu").replace(" on a GPU", "")
    environment = {**cpu["software"], "device": f"{cpu['device']}, {cpu['cores']} cores"}
    environment["date"] = cpu["date"]
    runs = [
        [
            str(run["threads"]),
            f"{run['ours_prefill_tokens_per_s']:.0f}",
            f"{run['hf_prefill_tokens_per_s']:.0f}",
            f"{run['ours_decode_tokens_per_s']:.1f}",
            f"{run['hf_decode_tokens_per_s']:.1f}",
            f"{run['decode_limit_tokens_per_s']:.1f}",
            f"{run['ours_decode_fraction_of_limit']:.0%}",
        ]
        for run in cpu["runs"]
    ]
    lengths = [
        [
            str(row["length"]),
            f"{row['naive_ms']:.0f}",
            f"{row['cached_ms']:.1f}",
            f"{row['naive_ms'] / row['cached_ms']:.1f}×",
        ]
        for row in cpu["naive_vs_cached"]
    ]
    return (
        heading
        + f"{measured_on(environment, cpu['command'])}\n\n"
        + f"Model: {cpu['model']}. Prompt: {cpu['prompt_tokens']} tokens, then "
        + f"{cpu['decode_tokens']} decoded tokens; statistic: {cpu['statistic']}.\n\n"
        + table(
            [
                "threads",
                "prefill tok/s (ours)",
                "prefill tok/s (HF)",
                "decode tok/s (ours)",
                "decode tok/s (HF)",
                "decode limit tok/s",
                "ours / limit",
            ],
            runs,
        )
        + "\n\nThe decode limit is the bytes of weights one token reads over the measured "
        + "matrix-vector bandwidth.\n\n### Naive against cached decode\n\n"
        + f"![Time per token, naive and cached]({NAIVE_FIGURE})\n\n"
        + table(["sequence length", "naive ms/token", "cached ms/token", "naive / cached"], lengths)
        + "\n"
    )


def percent(value: float | None) -> str:
    """A fraction as a percentage, or a dash where there is none (nothing drafted)."""
    return "–" if value is None else f"{value:.0%}"


def speculative_workload(workload: dict) -> str:
    """One workload's table: each configuration against plain decode."""
    rows = [
        [
            row["configuration"],
            percent(row["acceptance_rate"]),
            f"{row['tokens_per_target_pass']:.2f}",
            f"{row['end_to_end_tokens_per_s']:.2f}",
            f"{row['speedup_vs_plain']:.2f}×",
            "yes" if row["same_tokens_as_plain"] else "**NO**",
        ]
        for row in workload["results"]
    ]
    return (
        f"### {workload['name']}\n\n"
        + f"{workload['description']}; {workload['prompt_tokens']} prompt tokens.\n\n"
        + table(
            [
                "configuration",
                "acceptance rate",
                "tokens / target pass",
                "end-to-end tok/s",
                "speedup vs plain",
                "same tokens",
            ],
            rows,
        )
        + "\n"
    )


def speculative_section(report: dict | None) -> str:
    """Prompt lookup (and the first layers) as drafters against plain cached decode."""
    heading = "## Speculative decoding on a CPU\n\n"
    if report is None:
        command = "make bench-speculative"
        return heading + not_measured(SPECULATIVE_FILE, command).replace(" on a GPU", "")
    environment = cpu_environment(report)
    return (
        heading
        + smoke_warning(report)
        + f"{measured_on(environment, report['command'])}\n\n"
        + f"Model: {report['model']}. Sampling: {report['sampling']}, "
        + f"{report['max_tokens']} new tokens; statistic: {report['statistic']}.\n\n"
        + "End to end: completion tokens over the wall time of `Engine.generate`, prefill "
        + "included. Speedup: end-to-end tokens/s over plain cached decode's on the same "
        + "workload. Same tokens: every round emitted exactly plain decode's (greedy) tokens. "
        + "`ngram K=k`: prompt lookup, at most k drafts per step; `layers:N`: the model's first "
        + "N layers draft (for information, no target).\n\n"
        + "\n".join(speculative_workload(workload) for workload in report["workloads"])
        + "\n### Targets\n\n"
        + targets_list(report["targets"])
    )


# ---------------------------------------------------------------- serving


def milliseconds(figures: dict) -> str:
    """The p50 and p99 of a latency, in whole milliseconds: "p50 / p99"."""
    return " / ".join("–" if figures[q] is None else f"{figures[q]:.0f}" for q in ("p50", "p99"))


def serve_section(report: dict | None) -> str:
    """`decodespec serve` under 1, 4 and 16 concurrent streaming clients."""
    heading = "## Serving on a CPU\n\n"
    if report is None:
        return heading + not_measured(SERVE_FILE, "make bench-serve").replace(" on a GPU", "")
    environment = cpu_environment(report)
    rows = [
        [
            str(run["concurrency"]),
            str(run["requests"]),
            f"{run['output_tokens_per_s']:.1f}",
            milliseconds(run["ttft_ms"]),
            milliseconds(run["itl_ms"]),
        ]
        for run in report["runs"]
    ]
    http = ", ".join(
        f"{name} {report['software'][name]}"
        for name in ("starlette", "uvicorn", "httpx")
        if report["software"].get(name)
    )
    return (
        heading
        + smoke_warning(report)
        + f"{measured_on(environment, report['command'])}"
        + (f" **HTTP:** {http}." if http else "")
        + "\n\n"
        + f"Model: {report['model']}"
        + (f", backend `{report['backend']}`" if report.get("backend") else "")
        + f". Clients: {report['client']}. Each request: "
        + f"{report['sampling']}, {report['max_tokens']} new tokens, one of "
        + f"{report['prompts']} short prompts; statistic: {report['statistic']}.\n\n"
        + "In the style of vLLM's `benchmark_serving`: output tok/s is every output token "
        + "over the run's wall time; TTFT runs from sending a request to the first chunk "
        + "that carries text; ITL is the gap between such chunks (p50 / p99, in "
        + "milliseconds, as the client sees them).\n\n"
        + table(
            ["concurrency", "requests", "output tok/s", "TTFT p50 / p99 ms", "ITL p50 / p99 ms"],
            rows,
        )
        + "\n\nThe engine itself, driven in-process with the same "
        + f"{report['in_process_concurrency']} requests added at once (best of its rounds): "
        + f"{report['in_process_tokens_per_s']:.1f} tok/s.\n\n"
        + "### Targets\n\n"
        + targets_list(report["targets"])
    )


def ratio_cell(value: float | None) -> str:
    """decodespec over llama.cpp ("1.20×"), or a dash where llama.cpp did not run."""
    return "–" if value is None else f"{value:.2f}×"


def peer_environment(report: dict) -> str:
    """What the file says of llama.cpp's environment and build, in words."""
    peer = report.get("peer_environment")
    if peer is None:
        return ""
    removed = ", ".join(f"`{name}`" for name in peer["removed"]) or "none"
    build = peer["build"]
    return (
        "; llama.cpp runs in its users' default environment, without the bench's own "
        f"thread settings (removed: {removed}), built for {build['cpu']} with "
        f"{', '.join(build['instruction_sets'])}, AMX off"
    )


def versus_llama_sections(reports: list[dict]) -> str:
    """decodespec against llama.cpp on each CPU family measured: the ratios side by side,
    then each family's section."""
    heading = "## Against llama.cpp on a CPU\n\n"
    if not reports:
        return heading + not_measured(VERSUS_LLAMA_FILES, "make bench-llama").replace(
            " on a GPU", ""
        )
    keys = ("decode", "prefill", "serving_1", "serving_4", "serving_16")
    rows = [
        [
            f"{r.get('cpu_family', '?')} ({r['device']})",
            *(ratio_cell(r["ratios"][key]) for key in keys),
            "–"
            if "memory_bound" not in r
            else f"{r['memory_bound']['decodespec']['fraction_of_bound']:.0%}",
        ]
        for r in reports
    ]
    summary = (
        "decodespec over llama.cpp per CPU family (medians of interleaved rounds; above 1, "
        "decodespec is faster), and one-stream decode as a share of the memory bound:\n\n"
        + table(
            [
                "CPU family",
                "decode",
                "prefill",
                "serving 1",
                "serving 4",
                "serving 16",
                "decode / bound",
            ],
            rows,
        )
        + "\n\n"
    )
    return heading + summary + "\n".join(versus_llama_section(r) for r in reports)


def versus_llama_section(report: dict) -> str:
    """decodespec against llama.cpp on the same GGUF on one CPU: decode, prefill, serving."""
    heading = f"### {report.get('cpu_family', 'One CPU')}: {report['device']}\n\n"
    environment = cpu_environment(report)
    decode, prefill, serving = report["decode"], report["prefill"], report["serving"]
    ours = report["decodespec"]
    defaults = ours["serve_defaults"]
    build = report.get("llama_server_build")
    server = report.get("llama_server")
    llama_server = (
        f"llama.cpp's `llama-server` ({build['package']}: llama.cpp {build['llama_cpp_tag']}, "
        f"built from source for this CPU; {server['slots']} slots, continuous batching)"
        if build and server
        else f"llama.cpp's `llama-server`, which did not run ({report['llama_server_skipped']})"
    )

    def with_best(figures: dict, key: str, digits: int) -> str:
        """A median and, where the file has it, the best round beside it."""
        best = figures.get(f"{key}_best")
        shown = f"{figures[key]:.{digits}f}"
        return shown if best is None else f"{shown} (best {best:.{digits}f})"

    rows = [
        [
            f"decode tok/s (one stream, {decode['decode_tokens']} tokens)",
            with_best(decode, "decodespec_tokens_per_s", 1),
            with_best(decode, "llama_cpp_tokens_per_s", 1),
            ratio_cell(decode["ratio"]),
        ],
        [
            f"prefill tok/s ({prefill['prompt_tokens']}-token prompt)",
            with_best(prefill, "decodespec_tokens_per_s", 0),
            with_best(prefill, "llama_cpp_tokens_per_s", 0),
            ratio_cell(prefill["ratio"]),
        ],
    ]
    bound = report.get("memory_bound")
    if bound:  # decode over the bytes a token reads at the measured read bandwidth
        rows.append(
            [
                f"decode, share of the memory bound ({bound['read_GBps']} GB/s read)",
                *(
                    f"{bound[name]['fraction_of_bound']:.0%} of "
                    f"{bound[name]['bound_tokens_per_s']:.0f} tok/s"
                    for name in ("decodespec", "llama.cpp")
                ),
                "",
            ]
        )
    latency = []
    for level in serving["levels"]:
        theirs = level["llama-server"]
        rows.append(
            [
                f"serving tok/s, {level['concurrency']} stream"
                + ("s" if level["concurrency"] > 1 else "")
                + f" ({level['requests']} requests)",
                with_best(level["decodespec"], "output_tokens_per_s", 1),
                "–" if theirs is None else with_best(theirs, "output_tokens_per_s", 1),
                ratio_cell(level["ratio"]),
            ]
        )
        latency.append(
            [
                str(level["concurrency"]),
                milliseconds(level["decodespec"]["ttft_ms"]),
                "–" if theirs is None else milliseconds(theirs["ttft_ms"]),
                milliseconds(level["decodespec"]["itl_ms"]),
                "–" if theirs is None else milliseconds(theirs["itl_ms"]),
            ]
        )
    software = report["software"]
    busy = report.get("load_average", {}).get("before", [0.0])[0]
    noisy = (
        f'!!! warning "A busy machine"\n\n    Measured while other work kept the machine busy '
        f"(load average {busy:.1f} on {report['cores']} cores): the numbers are noisy "
        "(both engines' threads wait on each other at every step, and stall when others hold "
        "the cores); rerun `make bench-llama` on a quiet machine for a comparison.\n\n"
        if busy > 0.5 * report["cores"] and not report.get("smoke")
        else ""
    )
    return (
        heading
        + smoke_warning(report)
        + noisy
        + f"{measured_on(environment, report['command'])}"
        + f" **llama.cpp:** llama-cpp-python {software.get('llama-cpp-python', '?')} "
        + "in-process"
        + (f", {build['package']} for `llama-server`" if build else "")
        + ".\n\n"
        + f"Model: {report['model']}, the same file and {report['threads']} threads for both. "
        + f"decodespec as `decodespec serve` runs by default: weights `{defaults['weights']}` "
        + f"({ours['in_process_engine']['layout']}), backend `{defaults['backend']}`. "
        + "Decode: one greedy stream in-process after the same "
        + f"{decode['prompt_tokens']}-token prompt ids, tokens after the first over their "
        + f"time; prefill: a {prefill['prompt_tokens']}-token prompt from an empty cache to its "
        + "first token, in-process (llama.cpp through llama-cpp-python, in a process of its "
        + "own: decodespec runs with `OMP_WAIT_POLICY=PASSIVE`, as its command sets it, which "
        + "would slow llama.cpp, whose OpenMP runtime is the same library"
        + peer_environment(report)
        + "). Serving: "
        + "`decodespec serve` against "
        + f"{llama_server}, the same "
        + f"streamed `/v1/completions` ({serving['sampling']}, {serving['max_tokens']} tokens "
        + f"each, {serving['prompts']} short prompts) from the same clients; each request must "
        + "return exactly that many tokens. Statistic: "
        + (
            f"the median of {report['rounds']} interleaved rounds, the best in parentheses; "
            "ratios of medians"
            if "decodespec_tokens_per_s_best" in decode
            else f"the best of {report['rounds']} interleaved rounds"
        )
        + ". Ratio: decodespec over llama.cpp (above 1, decodespec is faster).\n\n"
        + table(["", "decodespec", "llama.cpp", "ratio"], rows)
        + "\n\nServing latency, p50 / p99 in milliseconds, as the clients see it:\n\n"
        + table(
            [
                "streams",
                "TTFT decodespec",
                "TTFT llama-server",
                "ITL decodespec",
                "ITL llama-server",
            ],
            latency,
        )
        + "\n\n#### Targets\n\n"
        + targets_list(report["targets"])
    )


def prefix_section(report: dict | None) -> str:
    """Time to first token after a repeated system prompt, prefix caching off and on."""
    heading = "## Prefix caching on a CPU\n\n"
    if report is None:
        return heading + not_measured(PREFIX_FILE, "make bench-prefix").replace(" on a GPU", "")
    environment = cpu_environment(report)
    rows = [
        [
            str(row["system_tokens"]),
            f"{row['cache_off']['cold_ttft_ms']:.0f}",
            f"{row['cache_off']['warm_ttft_ms']:.0f}",
            f"{row['cache_on']['warm_ttft_ms']:.0f}",
            f"{row['warm_speedup']:.1f}×",
            " / ".join(str(n) for n in row["cache_on"]["warm_cached_tokens"]),
            f"{row['cache_on']['hit_rate']:.0%}",
            "yes" if row["same_tokens"] else "**no**",
        ]
        for row in report["lengths"]
    ]
    return (
        heading
        + smoke_warning(report)
        + f"{measured_on(environment, report['command'])}\n\n"
        + f"Model: {report['model']}, backend `{report['backend']}`, blocks of "
        + f"{report['block_size']} tokens. A system prompt, then a short question per "
        + "request, answered one after another by a fresh engine per setting; "
        + f"{report['sampling']}; statistic: {report['statistic']}. The first question "
        + "is cold in both settings; with the cache on, the later ones map the blocks "
        + "it filled and prefill only the rest.\n\n"
        + f"![Time to first token with and without prefix caching]({PREFIX_FIGURE})\n\n"
        + table(
            [
                "system tokens",
                "first question TTFT ms",
                "later TTFT ms, cache off",
                "later TTFT ms, cache on",
                "off / on",
                "cached tokens per later question",
                "hit rate",
                "same tokens",
            ],
            rows,
        )
        + "\n\nThe hit rate is the later questions' cached prompt tokens over their prompt "
        + "tokens: the system prompt and any opening the questions share, to the token (whole "
        + "blocks, then the part of the next one an earlier request's block holds).\n\n"
        + "### Targets\n\n"
        + targets_list(report["targets"])
    )


# ---------------------------------------------------------------- structured outputs


def _us(value: float | None, spec: str = ".1f") -> str:
    return "–" if value is None else f"{value:{spec}}"


def _finish_reasons(reasons: dict) -> str:
    return ", ".join(f"{name} {count}" for name, count in sorted(reasons.items()))


def _rate(part: int, whole: int) -> str:
    return f"{part} / {whole}" + (f" ({part / whole:.0%})" if whole else "")


def _by_keyword(counts: dict[str, dict[str, int]], backends: list[str]) -> str:
    """A table of refusals per keyword (rows) and backend (columns), most first."""
    keywords = sorted(
        {k for c in counts.values() for k in c},
        key=lambda k: (-sum(c.get(k, 0) for c in counts.values()), k),
    )
    return table(
        ["keyword", *backends],
        [[f"`{k}`", *(str(counts[b].get(k, 0)) for b in backends)] for k in keywords],
    )


def _soundness_alarm(report: dict) -> str:
    """A danger admonition for every soundness failure the report holds."""
    lines = []
    for name, result in report["test_suite"]["backends"].items():
        for bad in result["unsound"]:
            lines.append(f"{name}, Test Suite: {bad['case']}: {bad['instance']}: `{bad['text']}`")
    for name, result in report["jsonschemabench_model"]["backends"].items():
        for bad in result["stop_but_invalid"]:
            lines.append(f"{name}, JSONSchemaBench answer to {bad['schema']}: {bad['why']}")
    if not lines:
        return ""
    return (
        '!!! danger "Soundness failures: output the schema rejects got through"\n\n'
        + "".join(f"    - {line}\n" for line in lines)
        + "\n"
    )


def _test_suite_part(report: dict, hashes: str) -> str:
    suite = report["test_suite"]
    backends = list(suite["backends"])
    totals = [
        [
            f"{name}{' (default)' if name == report['grammar_backend'] else ''}",
            str(r["cases"]),
            _rate(r["refused"], r["cases"]),
            f"**{r['invalid_admitted']}** of {r['invalid_run']}",
            _rate(r["valid_accepted"], r["valid_run"]),
            f"{r['seconds']:.1f}",
        ]
        for name, r in suite["backends"].items()
    ]
    rows = []
    for group, per_backend in suite["keywords"].items():
        cells = [f"`{group}`", str(next(iter(per_backend.values()))["cases"])]
        for name in backends:
            r = per_backend.get(name)
            cells += (
                [
                    str(r["refused"]),
                    str(r["invalid_admitted"]),
                    f"{r['valid_accepted']} / {r['valid_run']}",
                ]
                if r
                else ["–", "–", "–"]
            )
        rows.append(cells)
    header = ["group", "cases"]
    for name in backends:
        header += [f"{name} refused", f"{name} invalid admitted", f"{name} valid accepted / run"]
    return (
        f"{hashes}# Soundness and coverage: the JSON Schema Test Suite\n\n"
        + f"{suite['source']}. {suite['method']}. No model.\n\n"
        + table(
            [
                "backend",
                "schemas",
                "refused",
                "invalid instances admitted",
                "valid instances accepted / run",
                "seconds",
            ],
            totals,
        )
        + "\n\nSchemas refused, per keyword the refusal names:\n\n"
        + _by_keyword({n: r["refused_by_keyword"] for n, r in suite["backends"].items()}, backends)
        + "\n\nPer group of the suite (its file: a keyword, or format/NAME), the same "
        + "cases for both backends:\n\n"
        + table(header, rows)
        + "\n\n"
    )


def _jsonschemabench_part(report: dict, hashes: str) -> str:
    bench = report["jsonschemabench"]
    backends = list(bench["backends"])
    sets = list(next(iter(bench["backends"].values()))["by_set"])
    coverage = [
        [
            name,
            str(next(iter(bench["backends"].values()))["by_set"][name]["schemas"]),
            *(str(bench["backends"][b]["by_set"][name]["compiled"]) for b in backends),
        ]
        for name in sets
    ]
    coverage.append(
        [
            "**all**",
            str(bench["schemas"]),
            *(
                f"**{_rate(bench['backends'][b]['compiled'], bench['backends'][b]['schemas'])}**"
                for b in backends
            ),
        ]
    )
    times = [
        [
            name,
            f"{r['compile_ms']['median']:.1f}",
            f"{r['compile_ms']['p90']:.1f}",
            f"{r['compile_ms']['max']:.0f} ({r['compile_ms']['slowest']})",
        ]
        for name, r in bench["backends"].items()
    ]
    return (
        f"{hashes}# Real-world schemas: JSONSchemaBench\n\n"
        + f"{bench['source']}. {bench['method']}. No model.\n\n"
        + table(["set", "schemas", *(f"{b} compiled" for b in backends)], coverage)
        + "\n\n"
        + table(["backend", "compile ms, median", "p90", "max (schema)"], times)
        + "\n\nSchemas refused, per keyword the refusal names:\n\n"
        + _by_keyword({n: r["refused_by_keyword"] for n, r in bench["backends"].items()}, backends)
        + "\n\n"
    )


def _model_part(report: dict, hashes: str) -> str:
    answers = report["jsonschemabench_model"]
    rows = [
        [
            name,
            str(r["requests"]),
            f"**{_rate(r['valid_and_stop'], r['requests'])}**",
            f"{r['valid_rate']:.0%}" if r["valid_rate"] is not None else "–",
            _finish_reasons(r["finish_reasons"]),
            str(len(r["stop_but_invalid"])),
            _us(r["stopped_tokens_median"], ".0f") + " / " + _us(r["stopped_tokens_max"], ".0f"),
            f"{r['wall_s']:.0f}",
        ]
        for name, r in answers["backends"].items()
    ]
    cap = f" The schemas are {answers['cap']}." if answers.get("capped") else ""
    prompt = answers["prompt"].replace("\n", " ").replace("{schema}", "<the schema>")
    return (
        f"{hashes}# JSONSchemaBench schemas with the model\n\n"
        + f'One answer per schema, prompt "{prompt}" (as a chat message); {answers["sampling"]}; '
        + f"{answers['batching']}. Valid: {answers['validity']}.{cap}\n\n"
        + table(
            [
                "backend",
                "answers",
                "valid and finished stop",
                "schema-valid",
                "finish reasons",
                "stopped yet invalid",
                "tokens of a stopped answer, median / max",
                "seconds",
            ],
            rows,
        )
        + "\n\n"
    )


def _layout_part(report: dict, hashes: str) -> str:
    layouts = report["layouts"]
    rows = [
        [f"{run['max_whitespace']}", f"refused: {run['refused']}", "–", "–", "–", "–", "–"]
        if "refused" in run
        else [
            f"{run['max_whitespace']}" + (" (the engine's)" if run["engine"] else ""),
            f"{run['stop_rate']:.0%}",
            f"{run['schema_valid_rate']:.0%}",
            f"{run['valid_json_rate']:.0%}",
            f"{run['completion_tokens_per_request']:.1f}",
            f"{run['whitespace_per_answer']:.1f}",
            _finish_reasons(run["finish_reasons"]),
        ]
        for run in layouts["runs"]
    ]
    return (
        f"{hashes}# The JSON layout\n\n"
        + "At most N whitespace characters wherever JSON allows whitespace "
        + f"(`MAX_JSON_WHITESPACE`), backend {layouts['backend']}, the {report['prompts']} "
        + f"prompts below: {layouts['method']}; max_tokens {layouts['max_tokens']}, bar: at "
        + f"least {layouts['stop_bar']:.0%} finish stop with the engine's layout.\n\n"
        + table(
            [
                "max whitespace",
                "finished stop",
                "schema-valid",
                "valid JSON",
                "tokens per answer",
                "whitespace per answer",
                "finish reasons",
            ],
            rows,
        )
        + "\n\n"
    )


def structured_section(report: dict | None, level: int = 2, link: bool = True) -> str:
    """Structured outputs: each backend's soundness and coverage (the JSON Schema Test
    Suite, JSONSchemaBench, the model's answers to its schemas), the JSON layout, valid
    rates unconstrained and constrained, decode speed, the mask's cost per token, and
    xgrammar against llguidance on the same tokens. `level` is the heading's level;
    `link` points to the structured-outputs page."""
    hashes = "#" * level
    heading = f"{hashes} Structured outputs on a CPU\n\n"
    if report is None:
        return heading + not_measured(STRUCTURED_FILE, "make bench-structured").replace(
            " on a GPU", ""
        )
    modes = [("unconstrained", report["unconstrained"]), ("constrained", report["constrained"])]
    validity = [
        [
            name,
            f"{m['valid_json_rate']:.0%}",
            f"{m['schema_valid_rate']:.0%}",
            f"{m['valid_json_rate_with_fenced']:.0%} / {m['schema_valid_rate_with_fenced']:.0%}",
            _finish_reasons(m["finish_reasons"]),
            f"{m['completion_tokens_per_request']:.0f}",
            _us(m["decode_tokens_per_s"]),
            _us(m["end_to_end_tokens_per_s"]),
        ]
        for name, m in modes
    ]
    by_schema = [
        [
            name,
            str(report["constrained"]["by_schema"][name]["prompts"]),
            f"{report['unconstrained']['by_schema'][name]['schema']:.0%}",
            f"{report['constrained']['by_schema'][name]['schema']:.0%}",
        ]
        for name in report["constrained"]["by_schema"]
    ]
    cost = report["mask_overhead"]
    constrained = report["constrained"]
    matchers = report["matchers"]
    libraries = ("xgrammar", "llguidance")
    schemas = list(matchers["compile_ms"])
    peer_rows = []

    def fills(figures: dict | None) -> str:
        keys = ("mean_us", "median_us", "p99_us", "max_us")
        return " / ".join(
            _us((figures or {}).get(k), ".0f" if k == "max_us" else ".1f") for k in keys
        )

    def compile_ms(name: str, suffix: str) -> str:
        """Each schema's compile time, or "refused" (xgrammar refuses length bounds)."""
        times = [matchers["compile_ms"][s].get(f"{name}_compile_ms{suffix}") for s in schemas]
        return " / ".join("refused" if t is None else f"{t:.1f}" for t in times)

    for name in libraries:
        lib = matchers[name]
        peer_rows.append(
            [
                f"{name} {lib['version']}",
                f"{lib['tables_ms']:.0f}",
                compile_ms(name, ""),
                compile_ms(name, "_without_maxLength"),
                fills(lib["fill"]),
                fills(lib.get("fill_without_maxLength")),
                str(lib["rejected_tokens"]),
            ]
        )
    anchor = report["anchor"]
    link_text = (
        "The feature, its interfaces and the choice of llguidance: "
        "[Structured outputs](structured.md).\n\n"
        if link
        else ""
    )
    backend = report["grammar_backend"]
    return (
        heading
        + smoke_warning(report)
        + _soundness_alarm(report)
        + f"{measured_on(cpu_environment(report), report['command'])} "
        + "**Load average** (1, 5, 15 minutes, before / after): "
        + f"{' '.join(str(x) for x in report['load_average'][:3])} / "
        + f"{' '.join(str(x) for x in report['load_average'][3:])}: a shared machine, "
        + "so the timings are noisy. "
        + f"The whole bench took {report['bench_wall_s'] / 60:.1f} minutes.\n\n"
        + link_text
        + _test_suite_part(report, hashes)
        + _jsonschemabench_part(report, hashes)
        + _model_part(report, hashes)
        + _layout_part(report, hashes)
        + f"{hashes}# Fifty prompts, unconstrained and constrained\n\n"
        + f"Model: {report['model']}, backend `{report['backend']}`, grammar backend "
        + f"{backend}. {report['prompts']} "
        + "prompts asking for a JSON object of one of four schemas (its keys named in "
        + "words), each run unconstrained and constrained by its schema; "
        + f"{report['sampling']}; {report['batching']}. Strict: the whole text parses as "
        + "JSON (and fits the schema, checked with `jsonschema`); lenient: else the first "
        + "fenced ```` ```json ```` block does. Decode tok/s: the tokens of the steps after "
        + "every request has its first token, over their wall time.\n\n"
        + table(
            [
                "mode",
                "valid JSON",
                "schema-valid",
                "lenient: JSON / schema",
                "finish reasons",
                "tokens per answer",
                "decode tok/s",
                "end-to-end tok/s",
            ],
            validity,
        )
        + f"\n\nAdding the {report['prompts']} requests took "
        + f"{report['constrained']['add_requests_s']:.2f} s constrained (each request's "
        + "schema is compiled when it is added) and "
        + f"{report['unconstrained']['add_requests_s']:.2f} s unconstrained. "
        + (f"Note: {report['speed_note']}.\n\n" if report.get("speed_note") else "\n\n")
        + table(["schema", "prompts", "schema-valid, unconstrained", "constrained"], by_schema)
        + '\n\n??? note "The schemas, and a prompt of each"\n\n'
        + "".join(
            f'    - **{name}**: `{json.dumps(schema)}`; "{report["prompt_examples"][name]}"\n'
            for name, schema in report["schemas"].items()
        )
        + f"\n\n{hashes}# The mask's cost per token\n\n"
        + "Timed from outside the engine: the matcher filling each constrained row's mask "
        + "(`LogitsState.fill_bitmask`), and each masked sampling call against the same "
        + "call on the same logits without the mask.\n\n"
        + table(
            ["", "µs per token"],
            [
                [
                    f"mask fill ({backend}, in the engine; median "
                    f"{_us(constrained['fill_us_median'])}, "
                    f"max {_us(constrained['fill_us_max'], '.0f')})",
                    _us(cost["fill_us_per_token"]),
                ],
                [
                    "sampling with the mask − without it "
                    f"({_us(cost['masked_sample_us_per_token'], '.0f')} − "
                    f"{_us(cost['unmasked_sample_us_per_token'], '.0f')})",
                    _us(cost["masked_minus_unmasked_sampling_us_per_token"]),
                ],
                ["**the mask, in all**", f"**{_us(cost['mask_us_per_token'])}**"],
                ["decode time per token, constrained", _us(cost["decode_us_per_token"], ".0f")],
                [
                    "the mask's share of decode time (bar: under 10%)",
                    "–"
                    if cost["percent_of_decode"] is None
                    else f"{cost['percent_of_decode']:.2f}%",
                ],
            ],
        )
        + f"\n\n{hashes}# xgrammar and llguidance on the same tokens\n\n"
        + "The constrained answers' tokens replayed through both backends on "
        + f"{matchers['threads']} thread, one after the other at each token, same schemas "
        + f"({matchers['json_options']}); {matchers['statistic']}. Compile times per schema "
        + f"in the order {' / '.join(schemas)}. Anchor: {anchor['source']} states "
        + f"{anchor['statement']}; this vocabulary has {matchers['vocab_size']:,} tokens.\n\n"
        + table(
            [
                "matcher",
                "tokenizer tables ms",
                "compile ms",
                "compile ms without maxLength",
                "fill µs mean / median / p99 / max",
                "the same without maxLength",
                "tokens rejected",
            ],
            peer_rows,
        )
        + f"\n\n{matchers['masks_compared']} masks compared; the two differed on "
        + f"{matchers['masks_differing']}, by "
        + f"{_us(matchers.get('mean_tokens_differing'))} tokens a mask on average "
        + "(mean allowed tokens: xgrammar "
        + f"{_us(matchers['xgrammar']['mean_allowed_tokens'], '.0f')}, llguidance "
        + f"{_us(matchers['llguidance']['mean_allowed_tokens'], '.0f')}).\n\n"
        + f"{hashes}# Targets\n\n"
        + targets_list(report["targets"])
        + "\nSoundness and layout checks:\n\n"
        + targets_list([{"target": c["check"], "met": c["met"]} for c in report["checks"]])
    )


# ---------------------------------------------------------------- GPU kernels


def attention_section(report: dict | None) -> str:
    """The paged attention kernel's bandwidth against the copy limit and its peers."""
    heading = "## Paged attention on a GPU\n\n"
    if report is None:
        return heading + not_measured(ATTENTION_FILE, "make bench-attention")
    peers = list(report["shapes"][0]["peers"])
    rows = [
        [
            result["name"],
            f"{result['ours']['median_ms']:.3f}",
            f"{result['ours']['GBps']:.1f}",
            f"{result['ours']['percent_of_copy_bandwidth']:.0f}%",
            *(peer_cell(result["peers"][peer]) for peer in peers),
        ]
        for result in report["shapes"]
    ]
    return (
        heading
        + smoke_warning(report)
        + f"{measured_on(report['environment'], report['command'])} "
        + f"Statistic: {report['statistic']}.\n\n"
        + f"Copy bandwidth (the limit): {report['copy_bandwidth']['GBps']:.1f} GB/s.\n\n"
        + f"![Attention bandwidth as a share of copy bandwidth]({ATTENTION_FIGURE})\n\n"
        + table(["shape", "ours ms", "ours GB/s", "of copy bandwidth", *peers], rows)
        + "\n\nPeers: median time (their time over ours; above 1, ours is faster).\n\n"
        + unavailable_peers(report["shapes"])
        + "### Targets\n\n"
        + targets_list(report["targets"])
    )


def sampling_section(report: dict | None) -> str:
    """The sampling kernels' time against one read of the logits and their peers."""
    heading = "## Sampling on a GPU\n\n"
    if report is None:
        return heading + not_measured(SAMPLING_FILE, "make bench-sampling")
    peers = list(report["cases"][0]["peers"])
    rows = [
        [
            result["name"],
            f"{result['ours']['median_ms']:.3f}",
            f"{result['ours']['one_read_ms']:.3f}",
            f"{result['ours']['ratio_to_one_read']:.2f}",
            f"{result['ours']['fraction_equal_to_spec']:.3f}",
            *(peer_cell(result["peers"][peer]) for peer in peers),
        ]
        for result in report["cases"]
    ]
    return (
        heading
        + smoke_warning(report)
        + f"{measured_on(report['environment'], report['command'])} "
        + f"Statistic: {report['statistic']}.\n\n"
        + f"Copy bandwidth: {report['copy_bandwidth']['GBps']:.1f} GB/s; one read of the "
        + "logits at that bandwidth is the floor.\n\n"
        + f"![Sampling time over one read of the logits]({SAMPLING_FIGURE})\n\n"
        + table(
            ["case", "ours ms", "one read ms", "ours / one read", "equal to spec", *peers], rows
        )
        + "\n\nPeers: median time (their time over ours; above 1, ours is faster).\n\n"
        + unavailable_peers(report["cases"])
        + "### Targets\n\n"
        + targets_list(report["targets"])
    )


def performance_page(results_dir: Path = RESULTS_DIR) -> str:
    """The Markdown of `performance.md` from the results files present."""
    from docs.tools.chunked import CHUNKED_FILE, chunked_section  # they import this module
    from docs.tools.quant import QUANT_FILE, quant_section

    sections = [
        cpu_section(read_json(results_dir / CPU_FILE)),
        speculative_section(read_json(results_dir / SPECULATIVE_FILE)),
        serve_section(read_json(results_dir / SERVE_FILE)),
        chunked_section(read_json(results_dir / CHUNKED_FILE)),
        versus_llama_sections(
            [read_json(path) for path in sorted(results_dir.glob(VERSUS_LLAMA_FILES))]
        ),
        prefix_section(read_json(results_dir / PREFIX_FILE)),
        structured_section(read_json(results_dir / STRUCTURED_FILE)),
        quant_section(read_json(results_dir / QUANT_FILE), link=True),
        attention_section(read_json(results_dir / ATTENTION_FILE)),
        sampling_section(read_json(results_dir / SAMPLING_FILE)),
    ]
    return "\n".join([INTRO, *sections])


def performance_figures(results_dir: Path = RESULTS_DIR) -> dict[str, str]:
    """The GPU figures of the performance page, for the results files present."""
    figures = {}
    attention = read_json(results_dir / ATTENTION_FILE)
    if attention is not None:
        shapes = attention["shapes"]
        figures[ATTENTION_FIGURE] = svg.bar_chart(
            [s["name"] for s in shapes],
            [s["ours"]["percent_of_copy_bandwidth"] for s in shapes],
            title="Paged attention: bandwidth as a share of the copy limit",
            value_label="% of measured copy bandwidth (100 = the limit)",
            value_format="{:.0f}%",
            value_max=100,
        )
    sampling = read_json(results_dir / SAMPLING_FILE)
    if sampling is not None:
        cases = sampling["cases"]
        figures[SAMPLING_FIGURE] = svg.bar_chart(
            [c["name"] for c in cases],
            [c["ours"]["ratio_to_one_read"] for c in cases],
            title="Sampling: time over one read of the logits",
            value_label="our time / one read of the logits (1 = a single pass at copy speed)",
            value_format="{:.2f}",
        )
    return figures
