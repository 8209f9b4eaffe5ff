"""The site's figures, drawn from measured data with `docs.tools.svg`.

`all_figures` maps each figure's path under `docs/` to its SVG; the
`results_pages` hook adds them to the site at build time, so a figure always
shows the data files it was built with.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from docs.tools import svg
from docs.tools.svg import Series

ROOT = Path(__file__).resolve().parents[2]
DATA_DIR = ROOT / "docs" / "data"
RESULTS_DIR = ROOT / "results"
FIGURES = "assets/figures"
LOOP_STAGES = ["forward pass", "logits", "softmax", "sample", "append", "stop?"]
# `<!-- measured: NAME -->` in a page becomes the caption of the data file NAME.
CAPTION_MARKER = re.compile(r"<!-- measured: ([a-z-]+) -->")
CAPTION_SOURCES = {
    "cpu-engine": (RESULTS_DIR / "cpu-engine.json", "make bench-cpu"),
    "engine-timing": (DATA_DIR / "engine-timing.json", "make docs-data"),
    "sampling": (DATA_DIR / "sampling.json", "make docs-data"),
    "prefix-cpu": (RESULTS_DIR / "prefix-cpu.json", "make bench-prefix"),
}


def read_json(path: Path) -> dict | None:
    """The JSON object in `path`, or None when the file does not exist."""
    return json.loads(path.read_text()) if path.exists() else None


def token_label(token: dict) -> str:
    """A token's text made visible: spaces as ␣, newlines as ⏎; an end token as ⟨end⟩."""
    if token.get("eos"):
        return "⟨end⟩"
    return token["text"].replace(" ", "␣").replace("\n", "⏎") or "∅"


def measured_caption(data: dict) -> str:
    """Device, threads, date, torch and command of a data file, as a figure caption."""
    threads = data.get("threads")
    where = data["device"] + (f", {threads} threads" if threads else "")
    if "cores" in data and not threads:
        where += f", {data['cores']} cores"
    torch_version = data.get("torch") or data.get("software", {}).get("torch")
    load = f", load average {data['load_average']}" if "load_average" in data else ""
    return (
        f"*Measured with this project's engine on {where}{load}; {data['date']}; "
        f"torch {torch_version}; command: `{data['command']}`.*"
    )


def fill_captions(markdown: str) -> str:
    """Replace each `<!-- measured: NAME -->` marker with that data file's caption."""

    def caption(match: re.Match) -> str:
        path, command = CAPTION_SOURCES[match.group(1)]
        data = read_json(path)
        if data is None:
            return f"*Not measured yet: run `{command}`.*"
        return measured_caption(data)

    return CAPTION_MARKER.sub(caption, markdown)


# ---------------------------------------------------------------- the loop


def loop_figure() -> str:
    """The decode loop as six boxes on a ring, with `repeat` and `done` exits."""
    width, height = 680, 300
    cx, cy, rx, ry = width / 2 + 20, 150, 230, 95
    box_w, box_h = 120, 34
    elements = [svg.text(cx, cy + 5, "one token per turn", size=13, anchor="middle")]
    centers = []
    for index in range(len(LOOP_STAGES)):
        angle = -math.pi / 2 + 2 * math.pi * index / len(LOOP_STAGES)
        centers.append((cx + rx * math.cos(angle), cy + ry * math.sin(angle)))
    for index, (x, y) in enumerate(centers):
        nx, ny = centers[(index + 1) % len(centers)]
        elements.append(_arrow(x, y, nx, ny, box_w, box_h))
    for stage, (x, y) in zip(LOOP_STAGES, centers, strict=True):
        fill = "#fbe3da" if stage == "stop?" else "#e3ecf8"
        elements.append(
            svg.rect(x - box_w / 2, y - box_h / 2, box_w, box_h, rx=8, fill=fill, stroke=svg.INK)
        )
        elements.append(svg.text(x, y + 5, stage, size=14, anchor="middle"))
    stop_x, stop_y = centers[-1]
    exit_x = stop_x - box_w / 2
    elements.append(
        svg.line(exit_x, stop_y, exit_x - 30, stop_y, stroke=svg.INK, marker_end="url(#head)")
    )
    elements.append(svg.text(exit_x - 34, stop_y + 5, "yes: done", size=12, anchor="end"))
    elements.append(
        svg.text(stop_x + 20, stop_y - box_h / 2 - 18, "no: repeat", size=12, fill=svg.MUTED)
    )
    defs = (
        '<defs><marker id="head" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" '
        'markerHeight="7" orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="#222222"/>'
        "</marker></defs>"
    )
    return svg.document(width, height, [defs, *elements], "The decode loop")


def _arrow(x1: float, y1: float, x2: float, y2: float, box_w: float, box_h: float) -> str:
    """An arrow between two box centers, clipped to the boxes' edges."""
    dx, dy = x2 - x1, y2 - y1
    # The fraction of the center-to-center segment inside a box of this size.
    inside = 0.5 * min(box_w / abs(dx) if dx else math.inf, box_h / abs(dy) if dy else math.inf)
    start = (x1 + dx * inside, y1 + dy * inside)
    end = (x2 - dx * (inside + 0.02), y2 - dy * (inside + 0.02))
    return svg.line(*start, *end, stroke=svg.INK, stroke_width=1.5, marker_end="url(#head)")


# ---------------------------------------------------------------- engine timing


def cost_per_token_figure(cpu: dict) -> str:
    """Milliseconds per token of prefill and of decode at each thread count."""
    labels, values = [], []
    for run in cpu["runs"]:
        threads = f"{run['threads']} thread{'s' if run['threads'] > 1 else ''}"
        labels += [f"prefill, {threads}", f"decode, {threads}"]
        values += [1e3 / run["ours_prefill_tokens_per_s"], 1e3 / run["ours_decode_tokens_per_s"]]
    return svg.bar_chart(
        labels,
        values,
        title="Cost of one token: prompt (prefill) vs output (decode)",
        value_label="milliseconds per token (lower is cheaper)",
        value_format="{:.1f} ms",
        highlight=["decode" in label for label in labels],
        bar_height=30,
    )


def naive_vs_cached_figure(cpu: dict) -> str:
    """Per-token decode time with and without the KV cache as the sequence grows."""
    rows = cpu["naive_vs_cached"]
    lengths = [row["length"] for row in rows]
    return svg.line_chart(
        [
            Series("naive (recompute everything)", lengths, [r["naive_ms"] for r in rows]),
            Series("cached (one new token)", lengths, [r["cached_ms"] for r in rows]),
        ],
        title="Time per generated token, without and with the KV cache",
        x_label="sequence length (tokens)",
        y_label="ms per token",
    )


def cached_decode_figure(timing: dict) -> str:
    """Cached decode time per token as the context grows."""
    rows = timing["prompt_lengths"]
    return svg.line_chart(
        [
            Series(
                "cached decode",
                [r["prompt_tokens"] for r in rows],
                [r["decode_ms_per_token"] for r in rows],
            )
        ],
        title="Cached decode: time per token as the context grows",
        x_label="tokens already in the cache",
        y_label="ms per token",
    )


def ttft_figure(timing: dict) -> str:
    """Time to first token as the prompt grows."""
    rows = timing["prompt_lengths"]
    return svg.line_chart(
        [
            Series(
                "time to first token",
                [r["prompt_tokens"] for r in rows],
                [r["ttft_ms"] for r in rows],
            )
        ],
        title="Time to first token (prefill) vs prompt length",
        x_label="prompt tokens",
        y_label="ms",
    )


def prefix_cache_figure(prefix: dict) -> str:
    """Warm questions' TTFT against the system prompt's length, prefix caching off and on."""
    rows = prefix["lengths"]
    lengths = [r["system_tokens"] for r in rows]
    return svg.line_chart(
        [
            Series(label, lengths, [r[setting]["warm_ttft_ms"] for r in rows])
            for label, setting in (("cache off", "cache_off"), ("cache on", "cache_on"))
        ],
        title="Time to first token of a question after a repeated system prompt",
        x_label="system prompt tokens",
        y_label="ms",
    )


def timeline_figure(timing: dict) -> str:
    """Tokens received over time by one request: a wait (TTFT), then a steady rate."""
    times = timing["timeline"]["token_times_ms"]
    return svg.line_chart(
        # Nothing arrives until the first token; then one token per decode step.
        [Series("tokens received", [0.0, times[0], *times], [0, 0, *range(1, len(times) + 1)])],
        title=f"One request ({timing['timeline']['prompt_tokens']}-token prompt): tokens over time",
        x_label="ms since the request arrived",
        y_label="output tokens",
        annotate_last=False,
    )


# ---------------------------------------------------------------- sampling


def distribution_figure(sampling: dict, view: dict) -> str:
    """Bars of the top tokens' probabilities under one view; removed tokens greyed."""
    tokens = sampling["distribution"]["tokens"]
    labels = [token_label(t) for t in tokens]
    probs = view["probs"]
    value_max = max(max(v["probs"]) for v in sampling["distribution"]["views"])
    return svg.bar_chart(
        labels,
        probs,
        title=view["label"].capitalize(),
        subtitle=f"{view['kept']:,} tokens kept; {max(view['rest'], 0):.1%} of the probability "
        f"outside the {len(tokens)} shown",
        value_label="probability of the first answer token",
        value_max=value_max,
        dimmed=[p == 0 for p in probs],
    )


def generation_figure(sampling: dict) -> str:
    """A grid: one row per step, its top candidates by probability, the chosen one marked."""
    steps = sampling["generation"]["steps"]
    columns = len(steps[0]["candidates"])
    cell_w, cell_h, left, top = 104, 24, 150, 54
    width = left + cell_w * columns + 10
    height = top + cell_h * len(steps) + 12
    elements = [
        svg.text(
            width / 2,
            20,
            "Each step's top candidates; the chosen token in orange",
            size=14,
            anchor="middle",
            font_weight="bold",
        ),
        svg.text(8, top - 10, "step: chosen (p)", size=11, fill=svg.MUTED),
    ]
    for rank in range(columns):
        x = left + cell_w * (rank + 0.5)
        elements.append(
            svg.text(x, top - 10, f"rank {rank + 1}", size=11, anchor="middle", fill=svg.MUTED)
        )
    for index, step in enumerate(steps):
        elements += _generation_row(step, index, top + cell_h * index, left, cell_w, cell_h)
    return svg.document(width, height, elements, "Token probabilities of a greedy generation")


def _generation_row(
    step: dict, index: int, y: float, left: float, cell_w: float, cell_h: float
) -> list[str]:
    """One step of the generation grid: the chosen token, then shaded candidate cells."""
    chosen = step["token"]
    label = f"{index + 1}: {token_label(chosen)} ({step['prob']:.2f})"
    elements = [svg.text(8, y + cell_h - 8, label, size=12)]
    for rank, candidate in enumerate(step["candidates"]):
        x = left + cell_w * rank
        is_chosen = candidate["id"] == chosen["id"]
        shade = f"rgba(63, 111, 181, {0.08 + 0.5 * candidate['prob']:.2f})"
        elements.append(
            svg.rect(
                x + 1,
                y + 1,
                cell_w - 2,
                cell_h - 2,
                fill=shade,
                stroke=svg.HIGHLIGHT if is_chosen else "none",
                stroke_width=2.5 if is_chosen else None,
            )
        )
        content = f"{token_label(candidate)} {candidate['prob']:.2f}"
        weight = "bold" if is_chosen else None
        elements.append(
            svg.text(
                x + cell_w / 2,
                y + cell_h - 8,
                content,
                size=11,
                anchor="middle",
                font_weight=weight,
            )
        )
    return elements


# ---------------------------------------------------------------- all of them


def all_figures(data_dir: Path = DATA_DIR, results_dir: Path = RESULTS_DIR) -> dict[str, str]:
    """Each figure's path under `docs/` and its SVG, for every data file present."""
    figures = {f"{FIGURES}/decode-loop.svg": loop_figure()}
    cpu = read_json(results_dir / "cpu-engine.json")
    if cpu is not None:
        figures[f"{FIGURES}/cost-per-token.svg"] = cost_per_token_figure(cpu)
        figures[f"{FIGURES}/naive-vs-cached.svg"] = naive_vs_cached_figure(cpu)
    timing = read_json(data_dir / "engine-timing.json")
    if timing is not None:
        figures[f"{FIGURES}/cached-decode-vs-context.svg"] = cached_decode_figure(timing)
        figures[f"{FIGURES}/ttft-vs-prompt.svg"] = ttft_figure(timing)
        figures[f"{FIGURES}/token-timeline.svg"] = timeline_figure(timing)
    prefix = read_json(results_dir / "prefix-cpu.json")
    if prefix is not None:
        figures[f"{FIGURES}/ttft-prefix-cache.svg"] = prefix_cache_figure(prefix)
    sampling = read_json(data_dir / "sampling.json")
    if sampling is not None:
        for view in sampling["distribution"]["views"]:
            figures[f"{FIGURES}/distribution-{view['name']}.svg"] = distribution_figure(
                sampling, view
            )
        figures[f"{FIGURES}/generation.svg"] = generation_figure(sampling)
    return figures
