"""Line charts drawn with Pillow (the package has no matplotlib): a column of panels over one
shared x axis, each with its title, its y range as min / max labels and a few named series."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

COLORS = [(31, 119, 180), (214, 39, 40), (44, 160, 44)]
GRID = (200, 200, 200)
LEFT, RIGHT, TITLE_H, AXIS_H = 80, 16, 22, 18


@dataclass
class Panel:
    title: str
    series: dict[str, list[float | None]]  # name -> one value per x; None leaves a gap


def label(value: float) -> str:
    return f"{value:.3g}" if abs(value) < 1e4 else f"{value:.0f}"


def draw_panels(path: Path, xs: list[float], panels: list[Panel], x_name: str,
                width: int = 900, panel_height: int = 150) -> None:
    """Draw `panels` stacked, each over `xs`, into a PNG at `path`."""
    try:
        font = ImageFont.load_default(size=13)
    except TypeError:  # NOTE: Pillow < 10.1 has only the fixed bitmap font
        font = ImageFont.load_default()
    image = Image.new("RGB", (width, len(panels) * panel_height), "white")
    draw = ImageDraw.Draw(image)
    x_lo, x_hi = (min(xs), max(xs)) if xs else (0.0, 1.0)
    x_span = (x_hi - x_lo) or 1.0
    for i, panel in enumerate(panels):
        top = i * panel_height
        box = (LEFT, top + TITLE_H, width - RIGHT, top + panel_height - AXIS_H)
        values = [v for series in panel.series.values() for v in series if v is not None]
        lo, hi = (min(values), max(values)) if values else (0.0, 1.0)
        if hi == lo:  # NOTE: a flat series sits mid-panel rather than on an edge
            pad = abs(hi) * 0.1 or 1.0
            lo, hi = lo - pad, hi + pad
        draw.rectangle(box, outline=GRID)
        draw.text((LEFT, top + 4), panel.title, fill="black", font=font)
        legend_x = width - RIGHT
        for name, color in reversed(list(zip(panel.series, COLORS))):
            legend_x -= draw.textlength(name, font=font) + 24
            draw.line((legend_x, top + 11, legend_x + 14, top + 11), fill=color, width=3)
            draw.text((legend_x + 18, top + 4), name, fill=color, font=font)
        draw.text((4, box[1]), label(hi), fill="black", font=font)
        draw.text((4, box[3] - 14), label(lo), fill="black", font=font)
        draw.text((LEFT, box[3] + 2), label(x_lo), fill="black", font=font)
        end = f"{label(x_hi)} {x_name}"
        draw.text((box[2] - draw.textlength(end, font=font), box[3] + 2), end, fill="black",
                  font=font)

        def point(x: float, y: float) -> tuple[float, float]:
            return (box[0] + (x - x_lo) / x_span * (box[2] - box[0]),
                    box[3] - (y - lo) / (hi - lo) * (box[3] - box[1]))

        for (name, ys), color in zip(panel.series.items(), COLORS):
            run: list[tuple[float, float]] = []
            for x, y in [*zip(xs, ys), (x_hi, None)]:  # NOTE: the sentinel ends the last run
                if y is not None:
                    run.append(point(x, y))
                    continue
                if len(run) > 1:
                    draw.line(run, fill=color, width=2)
                elif run:
                    draw.ellipse((run[0][0] - 2, run[0][1] - 2, run[0][0] + 2, run[0][1] + 2),
                                 fill=color)
                run = []
    image.save(path)
