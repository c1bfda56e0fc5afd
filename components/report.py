"""HTML reports the KFP UI shows for a stage: final metrics, a metric curve, sample completions.

Plain HTML with an inline SVG chart, so no plotting library is needed in the image."""

from __future__ import annotations

import html
import json
from pathlib import Path


def svg_curve(points: list[tuple[float, float]], title: str, width: int = 560, height: int = 200) -> str:
    """A line chart of (x, y) points as an inline SVG element."""
    if len(points) < 2:
        return ""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    pad = 30
    sx = (width - 2 * pad) / ((x1 - x0) or 1)
    sy = (height - 2 * pad) / ((y1 - y0) or 1)
    coords = " ".join(f"{pad + (x - x0) * sx:.1f},{height - pad - (y - y0) * sy:.1f}" for x, y in points)
    return (f'<svg width="{width}" height="{height}" xmlns="http://www.w3.org/2000/svg">'
            f'<text x="{pad}" y="16" font-size="13">{html.escape(title)}</text>'
            f'<polyline fill="none" stroke="#1f77b4" stroke-width="2" points="{coords}"/>'
            f'<text x="2" y="{pad + 4}" font-size="10">{y1:.4g}</text>'
            f'<text x="2" y="{height - pad}" font-size="10">{y0:.4g}</text>'
            f'<text x="{width - pad - 40}" y="{height - 8}" font-size="10">step {x1:.0f}</text></svg>')


def _table(rows: list[dict]) -> str:
    if not rows:
        return ""
    cols = list(rows[0])
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(r.get(c)))}</td>" for c in cols) + "</tr>" for r in rows)
    return f"<table border='1' cellpadding='4' style='border-collapse:collapse'><tr>{head}</tr>{body}</table>"


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return value if isinstance(value, str) else json.dumps(value)


def stage_report(title: str, metrics: dict[str, float], history: list[dict], curve_key: str,
                 samples: list[dict] | None = None) -> str:
    points = [(r["step"], r[curve_key]) for r in history if curve_key in r and "step" in r]
    parts = [f"<h2>{html.escape(title)}</h2>", "<h3>Final metrics</h3>",
             _table([{"metric": k, "value": v} for k, v in sorted(metrics.items())]),
             svg_curve(points, curve_key)]
    if samples:
        parts += ["<h3>Sample completions</h3>", _table(samples)]
    return "<html><body>" + "".join(parts) + "</body></html>"


def write(path: str, text: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text)
