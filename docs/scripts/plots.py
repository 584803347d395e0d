"""The results pages' pictures, drawn at build time from the committed run records (metrics/): SVG written
here by hand, so the site needs no plotting library and the files are the same bytes on every build."""

from __future__ import annotations

import csv
import json
import math
from html import escape
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WIDTH, HEIGHT = 640, 300
LEFT, RIGHT, TOP, BOTTOM = 56, 16, 36, 44  # margins around the plot area, in px
COLORS = ("#3f51b5", "#e65100", "#2e7d32", "#6a1b9a")
FONT = 'font-family="sans-serif" font-size="12"'


def read_curve(path: Path) -> list[tuple[float, float]]:
    """(step, value) rows of a `dvc plots` CSV (`step,value` header), as `alignflow run --plots` writes them."""
    with path.open(newline="") as f:
        return [(float(row["step"]), float(row["value"])) for row in csv.DictReader(f)]


def ticks(low: float, high: float, count: int = 5) -> list[float]:
    """Round tick values covering [low, high]: steps of 1, 2 or 5 times a power of ten."""
    if high <= low:
        high = low + 1.0
    raw = (high - low) / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.floor(low / step) * step
    return [round(first + i * step, 10) for i in range(int(math.ceil((high - first) / step)) + 1)]


def _label(value: float) -> str:
    return f"{value:g}"


class Frame:
    """A plot area mapping data coordinates to pixels, with its axes, ticks and labels drawn."""

    def __init__(self, x_ticks: list[float], y_ticks: list[float]):
        self.x0, self.x1, self.y0, self.y1 = x_ticks[0], x_ticks[-1], y_ticks[0], y_ticks[-1]
        self.x_ticks, self.y_ticks = x_ticks, y_ticks

    def x(self, value: float) -> float:
        return LEFT + (value - self.x0) / (self.x1 - self.x0) * (WIDTH - LEFT - RIGHT)

    def y(self, value: float) -> float:
        return HEIGHT - BOTTOM - (value - self.y0) / (self.y1 - self.y0) * (HEIGHT - TOP - BOTTOM)

    def axes(self, x_label: str, y_label: str, x_names: dict[float, str] | None = None) -> list[str]:
        out = []
        for t in self.y_ticks:
            y = self.y(t)
            out.append(f'<line x1="{LEFT}" y1="{y:.1f}" x2="{WIDTH - RIGHT}" y2="{y:.1f}" stroke="#e0e0e0"/>')
            out.append(f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end" {FONT}>{_label(t)}</text>')
        for t in self.x_ticks:
            x = self.x(t)
            name = (x_names or {}).get(t, _label(t) if x_names is None else "")
            out.append(f'<text x="{x:.1f}" y="{HEIGHT - BOTTOM + 16}" text-anchor="middle" {FONT}>'
                       f'{escape(name)}</text>')
        bottom = HEIGHT - BOTTOM
        out.append(f'<line x1="{LEFT}" y1="{bottom}" x2="{WIDTH - RIGHT}" y2="{bottom}" stroke="#616161"/>')
        out.append(f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{bottom}" stroke="#616161"/>')
        out.append(f'<text x="{(LEFT + WIDTH - RIGHT) / 2:.0f}" y="{HEIGHT - 8}" text-anchor="middle" {FONT}>'
                   f'{escape(x_label)}</text>')
        out.append(f'<text x="14" y="{(TOP + bottom) / 2:.0f}" text-anchor="middle" {FONT} '
                   f'transform="rotate(-90 14 {(TOP + bottom) / 2:.0f})">{escape(y_label)}</text>')
        return out


def _svg(title: str, body: list[str]) -> str:
    return "\n".join([f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" '
                      f'height="{HEIGHT}" role="img" aria-label="{escape(title)}">', f"<title>{escape(title)}</title>",
                      '<rect width="100%" height="100%" fill="white"/>',
                      f'<text x="{LEFT}" y="20" {FONT} font-weight="bold">{escape(title)}</text>', *body, "</svg>", ""])


def line_chart(title: str, series: list[tuple[str, list[tuple[float, float]]]], x_label: str, y_label: str,
               y_range: tuple[float, float] | None = None) -> str:
    """One polyline per (label, points), a legend at the top right."""
    xs = [x for _, points in series for x, _ in points]
    ys = [y for _, points in series for _, y in points]
    low, high = y_range or (min(ys), max(ys))
    frame = Frame(ticks(min(xs), max(xs)), ticks(low, high))
    body = frame.axes(x_label, y_label)
    for i, (label, points) in enumerate(series):
        color = COLORS[i % len(COLORS)]
        path = " ".join(f"{frame.x(x):.1f},{frame.y(y):.1f}" for x, y in points)
        dash = ' stroke-dasharray="6 3"' if i else ""  # curves that coincide stay told apart
        body.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"{dash}/>')
        lx, ly = WIDTH - RIGHT - 170, TOP + 4 + 16 * i
        body.append(f'<line x1="{lx}" y1="{ly}" x2="{lx + 20}" y2="{ly}" stroke="{color}" stroke-width="2"{dash}/>')
        body.append(f'<text x="{lx + 26}" y="{ly + 4}" {FONT}>{escape(label)}</text>')
    return _svg(title, body)


def seed_chart(title: str, groups: list[tuple[str, dict]], y_label: str, y_range: tuple[float, float]) -> str:
    """Per group (label, a record's band: mean, se, values): each seed's value as a dot, the mean as a bar and
    the band mean +- 1 standard error as a shaded box."""
    frame = Frame(list(range(len(groups) + 1)), ticks(*y_range))
    names = {float(i): "" for i in range(len(groups) + 1)}
    body = frame.axes("", y_label, names)
    for i, (label, band) in enumerate(groups):
        center, half = frame.x(i + 0.5), 0.18 * (frame.x(1) - frame.x(0))
        top, bottom = frame.y(band["mean"] + band["se"]), frame.y(band["mean"] - band["se"])
        color = COLORS[i % len(COLORS)]
        body.append(f'<rect x="{center - half:.1f}" y="{top:.1f}" width="{2 * half:.1f}" height="{bottom - top:.1f}" '
                    f'fill="{color}" fill-opacity="0.18"/>')
        y = frame.y(band["mean"])
        body.append(f'<line x1="{center - half:.1f}" y1="{y:.1f}" x2="{center + half:.1f}" y2="{y:.1f}" '
                    f'stroke="{color}" stroke-width="2"/>')
        for j, value in enumerate(band["values"]):
            dx = (j - (len(band["values"]) - 1) / 2) * 10
            body.append(f'<circle cx="{center + dx:.1f}" cy="{frame.y(value):.1f}" r="4" fill="{color}"/>')
        body.append(f'<text x="{center:.1f}" y="{HEIGHT - BOTTOM + 16}" text-anchor="middle" {FONT}>'
                    f'{escape(label)}</text>')
        body.append(f'<text x="{center + half + 6:.1f}" y="{y + 4:.1f}" {FONT}>{band["mean"]:.3f}</text>')
    return _svg(title, body)


def all_plots() -> dict[str, str]:
    """{path under docs/: SVG} for each record with per-step or per-seed metrics."""
    curves = ROOT / "metrics" / "plots" / "r1-tiny"
    agent = json.loads((ROOT / "metrics" / "bands" / "agent-tiny.json").read_text())["bands"]
    return {
        "results/plots/r1-tiny-grpo.svg": line_chart(
            "r1-tiny, GRPO: the rollouts' reward and accuracy per step (seed 0)",
            [("reward (math_accuracy)", read_curve(curves / "grpo" / "reward_total_mean.csv")),
             ("accuracy", read_curve(curves / "grpo" / "accuracy.csv"))],
            "GRPO step (64 prompts x 8 samples)", "mean over the rollout", (0.0, 1.0)),
        "results/plots/r1-tiny-cold-start.svg": line_chart(
            "r1-tiny, cold start: SFT loss per logged step (seed 0)",
            [("train loss", read_curve(curves / "cold_start" / "loss.csv"))], "SFT step", "loss"),
        "results/plots/agent-tiny.svg": seed_chart(
            "agent-tiny: held-out reward through the endpoint, 3 seeds (band: mean +- 1 SE)",
            [("cold start (eval_sft)", agent["eval_sft"]["reward/total/mean"]),
             ("after GRPO (eval_grpo)", agent["eval_grpo"]["reward/total/mean"])], "greedy reward", (0.0, 1.0)),
    }
