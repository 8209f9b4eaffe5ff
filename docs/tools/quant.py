"""The weight formats' measured trade-off, rendered from `results/quant-cpu.json`.

`make bench-quant` (tests/benchmarks/quant.py) measures, in one run on the
bundled GGUF, each `--weights` format's decode speed beside llama.cpp's on the
same file, the memory its weights hold and its quality against float32
(`decodespec perplexity`). `quant_section` renders that file as Markdown (the
`<!-- quant-results -->` marker of `quantization.md` and a section of the
performance page), `quant_figure` draws speed against KL divergence, and
`quant_figures` maps the figure's path to its SVG when the file exists.
"""

from __future__ import annotations

from pathlib import Path

from docs.tools import svg
from docs.tools.figures import FIGURES, RESULTS_DIR, measured_caption, read_json
from docs.tools.performance import (
    cpu_environment,
    measured_on,
    not_measured,
    smoke_warning,
    table,
)

QUANT_FILE = "quant-cpu.json"
QUANT_COMMAND = "make bench-quant"
QUANT_FIGURE = f"{FIGURES}/quant-tradeoff.svg"
QUANT_MARKER = "<!-- quant-results -->"
FIGURE_TITLE = "Decode tokens/s against KL divergence to float32, per weight format"
LLAMA_CPP_LABEL = "llama.cpp (same GGUF)"


def _kl(value: float) -> str:
    """A KL divergence in nats: three significant digits, plain 0 for none."""
    return "0" if value == 0 else f"{value:.3g}"


def _quality_by_format(report: dict) -> dict[str, dict]:
    return {row["weights"]: row for row in report["quality"]["formats"]}


def speed_table(report: dict) -> str:
    """Decode speed and memory, one row per format, then llama.cpp's speed."""
    speed = report["speed"]
    rows = [
        [
            f"`{name}`",
            f"{row['decode_tokens_per_s']:.1f}",
            f"{row['over_llama_cpp']:.2f}×",
            f"{row['weight_bytes'] / 1e6:.1f}",
            f"{row['greedy_tokens_equal_to_float32']} / {speed['decode_tokens']}",
        ]
        for name, row in speed["formats"].items()
    ]
    llama = speed["llama_cpp"]
    rows.append(
        [f"llama.cpp {llama['version']}", f"{llama['decode_tokens_per_s']:.1f}", "1.00×", "–", "–"]
    )
    header = ["weights", "decode tok/s", "× llama.cpp", "weights MB", "greedy tokens = float32's"]
    return table(header, rows)


def quality_table(report: dict) -> str:
    """Perplexity, its change from float32, KL divergence to float32 and top-1 agreement."""
    quality = _quality_by_format(report)
    base = quality["float32"]["perplexity"] if "float32" in quality else None
    rows = [
        [
            f"`{name}`",
            f"{score['perplexity']:.3f}",
            "reference"
            if name == "float32" or base is None
            else (f"{score['perplexity'] - base:+.3f}"),
            *(_kl(score[key]) for key in ("kl_mean", "kl_median", "kl_p99", "kl_max")),
            f"{score['top1_agreement']:.2%}",
        ]
        for name, score in quality.items()
    ]
    header = ["weights", "perplexity", "ΔPPL vs float32", "KL mean", "KL median", "KL p99"]
    return table([*header, "KL max", "top-1 agreement"], rows)


def targets_with_values(targets: list[dict]) -> str:
    """The targets as a list: met or NOT met, with the measured value."""
    verdict = {True: "met", False: "**NOT met**", None: "not measured"}
    return (
        "\n".join(
            f"- {t['target']}: {verdict[t['met']]} (measured {t['measured']:.2f})" for t in targets
        )
        + "\n"
    )


def text_scored(quality: dict) -> str:
    """The text the quality figures were computed on, and how it was cut."""
    scored = quality["formats"][0]["scored_tokens"] if quality["formats"] else 0
    return (
        f"Text: {quality['text']}: its first {quality['tokens']:,} tokens in "
        f"{quality['windows']} window{'s' if quality['windows'] != 1 else ''} of "
        f"{quality['context']} tokens, the second half of "
        f"each scored ({scored:,} positions); sha256 of the text `{quality['text_sha256']}`."
    )


def quant_section(report: dict | None, level: int = 2, link: bool = False) -> str:
    """The weight formats' speed, memory and quality against float32 and llama.cpp.

    `level` is the heading's level; `link` points to the weight formats page."""
    hashes = "#" * level
    heading = f"{hashes} Weight formats on a CPU\n\n"
    if report is None:
        return heading + not_measured(QUANT_FILE, QUANT_COMMAND).replace(" on a GPU", "")
    speed = report["speed"]
    link_text = (
        "The formats, how quality is scored and the spec: "
        "[Weight formats and quantization](quantization.md).\n\n"
        if link
        else ""
    )
    return (
        heading
        + smoke_warning(report)
        + f"{measured_on(cpu_environment(report), report['command'])}\n\n"
        + link_text
        + f"Model: {report['model']}. Speed: one greedy request of {speed['prompt_tokens']} "
        + f"prompt tokens, then {speed['decode_tokens']} decoded tokens, on the torch backend "
        + f"and on llama.cpp (llama-cpp-python {speed['llama_cpp']['version']}, the same "
        + f"file, prompt ids and threads); rounds interleaved, best of {speed['rounds']} "
        + "each. Decode tok/s counts the tokens after the first over their wall time. "
        + "Quality: `decodespec perplexity`, KL(P_float32 ‖ P_format) per scored position; "
        + "top-1 agreement: the format ranks first the token float32 ranks first.\n\n"
        + f"![{FIGURE_TITLE}]({QUANT_FIGURE})\n\n"
        + f"{measured_caption(report)}\n\n"
        + f"{hashes}# Speed and memory\n\n"
        + speed_table(report)
        + "\n\n"
        + "".join(f"- `{name}`: {row['layout']}\n" for name, row in speed["formats"].items())
        + "\n"
        + f"{hashes}# Quality against float32\n\n"
        + quality_table(report)
        + "\n\nKL divergences in nats. "
        + text_scored(report["quality"])
        + f"\n\n{hashes}# Targets\n\n"
        + targets_with_values(report["targets"])
    )


def _label_positions(
    points: list[tuple[str, float, float]], right: float, line_y: float
) -> list[tuple[float, float, str]]:
    """(x, y, anchor) of each point's label: beside the point (left of it near the right
    edge `right`), above it, or below it when it would overlap an earlier label or
    the reference line at `line_y`."""
    placed: list[tuple[float, float, str]] = []
    for _, x, y in points:
        dx, anchor = (-8, "end") if x > right - 90 else (8, "start")
        candidates = [(x + dx, y - 8), (x + dx, y + 16), (x + dx, y - 22)]
        chosen = next(
            (
                c
                for c in candidates
                # text baseline c[1]: its glyphs span about c[1] - 11 .. c[1] + 3
                if not -5 < c[1] - line_y < 13
                and all(abs(c[0] - px) > 70 or abs(c[1] - py) > 14 for px, py, _ in placed)
            ),
            candidates[0],
        )
        placed.append((*chosen, anchor))
    return placed


def quant_figure(report: dict) -> str:
    """Decode tokens/s (y) against mean KL divergence to float32 (x), one point per
    format, and llama.cpp's tokens/s on the same file as a dashed horizontal line."""
    quality = _quality_by_format(report)
    speed = report["speed"]
    llama = speed["llama_cpp"]["decode_tokens_per_s"]
    points = [
        (name, quality[name]["kl_mean"], row["decode_tokens_per_s"])
        for name, row in speed["formats"].items()
        if name in quality
    ]
    width, height = 640, 380
    x_ticks = svg.nice_ticks(max(kl for _, kl, _ in points))
    y_ticks = svg.nice_ticks(max(llama, *(tps for _, _, tps in points)) * 1.08)
    top = 62 if report.get("smoke") else 48
    frame = svg.Frame(70, top, width - 110, height - top - 55, x_ticks[-1], y_ticks[-1])
    subtitle = (
        "SMOKE RUN: not measurements"
        if report.get("smoke")
        else f"{report['device']}, {report['threads']} threads; {report['date'][:10]}"
    )
    elements = [
        svg.text(width / 2, 22, FIGURE_TITLE, size=14, anchor="middle", font_weight="bold"),
        svg.text(
            width / 2,
            40,
            subtitle,
            size=12,
            anchor="middle",
            fill=svg.HIGHLIGHT if report.get("smoke") else svg.MUTED,
        ),
    ]
    elements += svg.axes(frame, x_ticks, y_ticks)
    elements += svg.axis_labels(
        frame, "mean KL divergence to float32 (nats; lower is closer)", "decode tokens/s"
    )
    y_llama = frame.y(llama)
    elements.append(
        svg.line(
            frame.left,
            y_llama,
            frame.left + frame.width,
            y_llama,
            stroke=svg.MUTED,
            stroke_width=1.5,
            stroke_dasharray="6 4",
        )
    )
    elements.append(
        svg.text(
            frame.left + 6,
            y_llama - 6,
            f"{LLAMA_CPP_LABEL}: {llama:.1f} tok/s",
            size=11,
            fill=svg.MUTED,
        )
    )
    screen = [(name, frame.x(kl), frame.y(tps)) for name, kl, tps in points]
    for index, ((name, x, y), (lx, ly, anchor)) in enumerate(
        zip(screen, _label_positions(screen, frame.left + frame.width, y_llama), strict=True)
    ):
        color = svg.PALETTE[index % len(svg.PALETTE)]
        elements.append(svg.circle(x, y, 5, fill=color))
        tps = points[index][2]
        elements.append(svg.text(lx, ly, f"{name} {tps:.1f}", size=12, anchor=anchor, fill=color))
    return svg.document(width, height, elements, FIGURE_TITLE)


def quant_figures(results_dir: Path = RESULTS_DIR) -> dict[str, str]:
    """The trade-off figure's path under `docs/` and its SVG, when the results exist."""
    report = read_json(results_dir / QUANT_FILE)
    return {} if report is None else {QUANT_FIGURE: quant_figure(report)}
