"""The Performance page's chunked prefill section, from results/chunked-prefill-cpu.json
(`make bench-chunked`)."""

from __future__ import annotations

from docs.tools.performance import (
    cpu_environment,
    measured_on,
    not_measured,
    smoke_warning,
    table,
    targets_list,
)

CHUNKED_FILE = "chunked-prefill-cpu.json"
COLUMNS = [
    "token budget / long prompt chunk / passes between chunks",
    "one request's TTFT ms",
    "burst TTFT p50 / p99 ms",
    "burst output tok/s",
    "decode tok/s without it",
    "decode tok/s during",
    "longest wait for a token ms",
    "long prompt TTFT ms",
]


def chunked_section(report: dict | None) -> str:
    """Who waits for whom, per token budget: a burst of short prompts, and running
    requests while a long prompt arrives."""
    heading = "## Chunked prefill on a CPU\n\n"
    if report is None:
        return heading + not_measured(CHUNKED_FILE, "make bench-chunked").replace(" on a GPU", "")
    rows = [
        [
            "whole prompts"
            if row["token_budget"] is None
            else f"{row['token_budget']} / {row.get('long_prompt_chunk') or 'none'}"
            f" / {row.get('long_prompt_interval', 1)}",
            f"{row['alone_ttft_ms']:.0f}",
            f"{row['ttft_ms_p50']:.0f} / {row['ttft_ms_p99']:.0f}",
            f"{row['output_tokens_per_s']:.1f}",
            f"{row['decode_tokens_per_s_without']:.1f}",
            f"{row['decode_tokens_per_s_during']:.1f}",
            f"{row['decode_longest_wait_ms']:.0f}",
            f"{row['long_prompt_ttft_ms']:.0f}",
        ]
        for row in report["budgets"]
    ]
    burst, long = report["burst"], report["long_prompt"]
    return (
        heading
        + smoke_warning(report)
        + measured_on(cpu_environment(report), report["command"])
        + f"\n\nModel: {report['model']}; path: `{report['path']}`. The engine in-process "
        + f"(the scheduler's effect, without HTTP). **Burst:** {burst['requests']} short "
        + f"chat prompts ({min(burst['prompt_tokens'])}–{max(burst['prompt_tokens'])} "
        + f"tokens) added at once, {burst['max_tokens']} greedy tokens each. **Long "
        + f"prompt:** {long['decoding_requests']} requests decoding when a "
        + f"{long['tokens']}-token prompt arrives: their decode rate while it is "
        + "prefilled, against theirs over as many passes in an engine where it does not "
        + "arrive, their longest wait for a token meanwhile (the longest pass), and its "
        + f"own TTFT. {report['kept']}, "
        + f"of {report['rounds']} "
        + "interleaved rounds.\n\n"
        + table(COLUMNS, rows)
        + "\n\n### Targets\n\n"
        + targets_list(report["targets"])
    )
