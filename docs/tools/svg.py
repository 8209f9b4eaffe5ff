"""A tiny SVG plotting module: shapes, text, axes, bar and line charts.

Charts are plain strings of SVG with system fonts and no scripts, so the site
needs nothing from the network to show them. Each chart function returns a
whole document (`document`); the shape functions return elements for it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from xml.sax.saxutils import escape

FONT = "system-ui, -apple-system, 'Segoe UI', Roboto, Helvetica, Arial, sans-serif"
INK = "#222222"
GRID = "#dddddd"
MUTED = "#777777"
PALETTE = ["#3f6fb5", "#d1603d", "#4c9a5b", "#8a5cb8", "#b8912f"]
HIGHLIGHT = "#d1603d"


def attrs(**values: object) -> str:
    """XML attributes from keyword arguments (`font_size` becomes `font-size`)."""
    return " ".join(
        f'{key.replace("_", "-")}="{escape(str(value), {chr(34): "&quot;"})}"'
        for key, value in values.items()
        if value is not None
    )


def document(width: float, height: float, elements: Sequence[str], title: str) -> str:
    """A standalone SVG document on a white background; `title` is its accessible name."""
    return "\n".join(
        [
            f'<svg xmlns="http://www.w3.org/2000/svg" {attrs(viewBox=f"0 0 {width} {height}")} '
            f"{attrs(width=width, height=height, role='img', font_family=FONT)}>",
            f"<title>{escape(title)}</title>",
            rect(0, 0, width, height, fill="#ffffff"),
            *elements,
            "</svg>\n",
        ]
    )


def rect(x: float, y: float, width: float, height: float, **style: object) -> str:
    return f"<rect {attrs(x=_n(x), y=_n(y), width=_n(width), height=_n(height), **style)}/>"


def line(x1: float, y1: float, x2: float, y2: float, **style: object) -> str:
    return f"<line {attrs(x1=_n(x1), y1=_n(y1), x2=_n(x2), y2=_n(y2), **style)}/>"


def circle(x: float, y: float, radius: float, **style: object) -> str:
    return f"<circle {attrs(cx=_n(x), cy=_n(y), r=_n(radius), **style)}/>"


def polyline(points: Sequence[tuple[float, float]], **style: object) -> str:
    path = " ".join(f"{_n(x)},{_n(y)}" for x, y in points)
    return f"<polyline {attrs(points=path, fill='none', **style)}/>"


def text(x: float, y: float, content: str, *, size: float = 12, **style: object) -> str:
    """A text element; `anchor` is start, middle or end."""
    anchor = style.pop("anchor", "start")
    style.setdefault("fill", INK)
    return (
        f"<text {attrs(x=_n(x), y=_n(y), font_size=size, text_anchor=anchor, **style)}>"
        f"{escape(content)}</text>"
    )


def _n(value: float) -> str:
    """A coordinate with at most two decimals."""
    return f"{value:.2f}".rstrip("0").rstrip(".")


def nice_ticks(high: float, count: int = 5) -> list[float]:
    """Round tick values from 0 up to at least `high` (about `count` of them)."""
    if high <= 0:
        return [0.0, 1.0]
    raw = high / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    return [i * step for i in range(math.ceil(high / step - 1e-9) + 1)]


def format_tick(value: float) -> str:
    """A tick label without needless decimals."""
    return f"{value:,.0f}" if value == int(value) else f"{value:g}"


@dataclass(frozen=True)
class Series:
    """One line of a line chart."""

    name: str
    xs: Sequence[float]
    ys: Sequence[float]


@dataclass(frozen=True)
class Frame:
    """The plot area of a chart and the data ranges its axes map."""

    left: float
    top: float
    width: float
    height: float
    x_max: float
    y_max: float

    def x(self, value: float) -> float:
        return self.left + self.width * value / self.x_max

    def y(self, value: float) -> float:
        return self.top + self.height * (1 - value / self.y_max)


def axes(frame: Frame, x_ticks: Sequence[float], y_ticks: Sequence[float]) -> list[str]:
    """Grid lines, tick labels and the two axis lines of `frame`."""
    bottom = frame.top + frame.height
    elements = []
    for tick in y_ticks:
        y = frame.y(tick)
        elements.append(line(frame.left, y, frame.left + frame.width, y, stroke=GRID))
        elements.append(text(frame.left - 6, y + 4, format_tick(tick), size=11, anchor="end"))
    for tick in x_ticks:
        x = frame.x(tick)
        elements.append(line(x, bottom, x, bottom + 4, stroke=INK))
        elements.append(text(x, bottom + 17, format_tick(tick), size=11, anchor="middle"))
    elements.append(line(frame.left, bottom, frame.left + frame.width, bottom, stroke=INK))
    elements.append(line(frame.left, frame.top, frame.left, bottom, stroke=INK))
    return elements


def axis_labels(frame: Frame, x_label: str, y_label: str) -> list[str]:
    """The x label under the axis and the y label rotated along it."""
    x_mid = frame.left + frame.width / 2
    y_mid = frame.top + frame.height / 2
    return [
        text(x_mid, frame.top + frame.height + 38, x_label, size=12, anchor="middle"),
        text(16, y_mid, y_label, size=12, anchor="middle", transform=f"rotate(-90 16 {_n(y_mid)})"),
    ]


def legend(names: Sequence[str], x: float, y: float) -> list[str]:
    """A color key, one row per series."""
    elements = []
    for index, name in enumerate(names):
        row = y + 18 * index
        color = PALETTE[index % len(PALETTE)]
        elements.append(rect(x, row - 9, 14, 10, fill=color))
        elements.append(text(x + 20, row, name, size=12))
    return elements


def line_chart(
    series: Sequence[Series],
    *,
    title: str,
    x_label: str,
    y_label: str,
    width: float = 640,
    height: float = 360,
    annotate_last: bool = True,
) -> str:
    """Lines with point markers over linear axes starting at 0, a legend at the top left."""
    x_ticks = nice_ticks(max(max(s.xs) for s in series))
    y_ticks = nice_ticks(max(max(s.ys) for s in series))
    frame = Frame(70, 40, width - 110, height - 95, x_ticks[-1], y_ticks[-1])
    elements = [text(width / 2, 22, title, size=14, anchor="middle", font_weight="bold")]
    elements += axes(frame, x_ticks, y_ticks) + axis_labels(frame, x_label, y_label)
    for index, one in enumerate(series):
        color = PALETTE[index % len(PALETTE)]
        points = [(frame.x(x), frame.y(y)) for x, y in zip(one.xs, one.ys, strict=True)]
        elements.append(polyline(points, stroke=color, stroke_width=2))
        elements += [circle(x, y, 3, fill=color) for x, y in points]
        if annotate_last:
            x, y = points[-1]
            label = f"{one.ys[-1]:,.0f}" if one.ys[-1] >= 10 else f"{one.ys[-1]:.2g}"
            elements.append(text(x - 6, y - 8, label, size=11, anchor="end", fill=color))
    elements += legend([s.name for s in series], frame.left + 12, frame.top + 12)
    return document(width, height, elements, title)


def bar_chart(
    labels: Sequence[str],
    values: Sequence[float],
    *,
    title: str,
    value_label: str,
    subtitle: str = "",
    value_format: str = "{:.3f}",
    value_max: float | None = None,
    highlight: Sequence[bool] | None = None,
    dimmed: Sequence[bool] | None = None,
    width: float = 640,
    bar_height: float = 18,
) -> str:
    """Horizontal bars, one per label, each with its value printed at its end.

    `subtitle` is a line under the title. `highlight` colors some bars (the
    chosen token, say); `dimmed` greys out others (tokens a filter removed).
    `value_max` fixes the scale, so charts of several views compare at a glance.
    """
    ticks = nice_ticks(value_max if value_max is not None else max(values))
    label_width = 130
    top = 58 if subtitle else 40
    frame = Frame(
        label_width, top, width - label_width - 70, bar_height * len(labels), ticks[-1], 1
    )
    height = frame.top + frame.height + 52
    elements = [text(width / 2, 22, title, size=14, anchor="middle", font_weight="bold")]
    if subtitle:
        elements.append(text(width / 2, 41, subtitle, size=12, anchor="middle", fill=MUTED))
    elements += _vertical_grid(frame, ticks)
    for index, (label, value) in enumerate(zip(labels, values, strict=True)):
        y = frame.top + bar_height * index
        color = PALETTE[0]
        if highlight is not None and highlight[index]:
            color = HIGHLIGHT
        if dimmed is not None and dimmed[index]:
            color = GRID
        bar_end = frame.x(min(value, frame.x_max))
        elements.append(rect(frame.left, y + 2, bar_end - frame.left, bar_height - 4, fill=color))
        elements.append(text(frame.left - 6, y + bar_height - 5, label, size=12, anchor="end"))
        shown = value_format.format(value)
        elements.append(text(bar_end + 4, y + bar_height - 5, shown, size=11, fill=MUTED))
    elements.append(
        text(frame.left + frame.width / 2, height - 10, value_label, size=12, anchor="middle")
    )
    return document(width, height, elements, title)


def _vertical_grid(frame: Frame, ticks: Sequence[float]) -> list[str]:
    """Vertical grid lines with labels under the bars of a horizontal bar chart."""
    bottom = frame.top + frame.height
    elements = []
    for tick in ticks:
        x = frame.x(tick)
        elements.append(line(x, frame.top, x, bottom, stroke=GRID))
        elements.append(text(x, bottom + 15, format_tick(tick), size=11, anchor="middle"))
    elements.append(line(frame.left, frame.top, frame.left, bottom, stroke=INK))
    return elements
