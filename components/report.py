"""The HTML report a KFP task shows in the UI: the page a pipeline user reads first.

Top to bottom: the gate verdict (evaluate) and a link to the task's MLflow run; the headline
metrics (reward, KL, loss, accuracy, win rate) as large numbers; curves of reward, loss, KL,
completion length, entropy and accuracy over training steps; sample completions as chat text,
one column per reward function; every final metric, folded away.

One self-contained file: inline CSS and SVG, no script and nothing fetched (clusters are
offline, and the KFP UI shows the page in a sandboxed frame).
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The headline numbers, in the order a reader looks for them; each (metric, label) present is shown.
HEADLINE = [("reward", "reward"), ("eval_reward", "eval reward"), ("objective/scores", "score"),
            ("rewards/margins", "reward margin"), ("rm_score", "reward-model score"),
            ("kl", "KL"), ("objective/kl", "KL"), ("loss", "loss"), ("eval_loss", "eval loss"),
            ("accuracy", "accuracy"), ("rewards/accuracies", "preference accuracy"),
            ("mean_token_accuracy", "token accuracy"), ("win_rate", "win rate")]

# The curves: title -> the history keys drawn in it (those present), as separate lines. A reward
# chart also draws every `rewards/<fn>/mean`.
CURVES = [("Reward", ["reward", "objective/scores", "rewards/margins", "eval_reward"]),
          ("Loss", ["loss", "eval_loss"]),
          ("KL", ["kl", "objective/kl"]),
          ("Completion length (tokens)", ["completions/mean_length"]),
          ("Entropy", ["entropy"]),
          ("Accuracy", ["accuracy", "rewards/accuracies", "mean_token_accuracy"])]

# The page may load nothing and run nothing: a browser blocks (and logs) any fetch or script.
CSP = "default-src 'none'; style-src 'unsafe-inline'"

COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#be185d", "#4b5563"]

CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#1f2937;margin:0;padding:16px 20px;
background:#f9fafb}
h1{font-size:20px;margin:0 0 2px}h2{font-size:15px;margin:22px 0 8px;color:#374151}
.sub{color:#6b7280;margin-bottom:12px}
.banner{padding:10px 14px;border-radius:6px;margin:10px 0;font-weight:600}
.pass{background:#dcfce7;color:#14532d;border:1px solid #86efac}
.fail{background:#fee2e2;color:#7f1d1d;border:1px solid #fca5a5}
.info{background:#e0e7ff;color:#1e3a8a;border:1px solid #a5b4fc}
.banner span{font-weight:400}
.cards{display:flex;flex-wrap:wrap;gap:10px}
.card{background:#fff;border:1px solid #e5e7eb;border-radius:6px;padding:8px 14px;min-width:110px}
.card .v{font-size:22px;font-weight:600}.card .k{color:#6b7280;font-size:12px}
.charts{display:flex;flex-wrap:wrap;gap:12px}
.chart{background:#fff;border:1px solid #e5e7eb;border-radius:6px;padding:6px}
table{border-collapse:collapse;background:#fff;width:100%}
th,td{border:1px solid #e5e7eb;padding:5px 8px;text-align:left;vertical-align:top}
th{background:#f3f4f6;font-weight:600;font-size:12px}
td.n{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
.text{white-space:pre-wrap;word-break:break-word;max-height:14em;overflow:auto;font-size:13px}
.msg{margin:0 0 4px}.role{font-size:11px;font-weight:600;text-transform:uppercase;color:#6b7280;margin-right:6px}
details{margin-top:18px}summary{cursor:pointer;color:#374151;font-weight:600}
a{color:#1d4ed8}
"""


@dataclass
class Gate:
    """The evaluate step's verdict on promotion."""

    passed: bool
    reason: str


@dataclass
class Report:
    """What one task's page shows; every part is optional except the title."""

    title: str
    subtitle: str = ""
    metrics: dict[str, float] = field(default_factory=dict)  # final values
    history: list[dict[str, Any]] = field(default_factory=list)  # metrics.jsonl records with "step"
    samples: list[dict[str, Any]] = field(default_factory=list)  # trainer.engine.completions.sample_rows rows
    gate: Gate | None = None
    mlflow_run_id: str = ""
    mlflow_url: str = ""  # a link to the run in the MLflow UI, when the tracking server has one
    notes: list[str] = field(default_factory=list)  # short lines shown under the title


def render(report: Report) -> str:
    """The report as one HTML page."""
    parts = [f"<h1>{_esc(report.title)}</h1>"]
    if report.subtitle:
        parts.append(f"<div class='sub'>{_esc(report.subtitle)}</div>")
    if report.gate is not None:
        verdict = "Gate passed" if report.gate.passed else "Gate not passed"
        parts.append(f"<div class='banner {'pass' if report.gate.passed else 'fail'}'>{verdict}: "
                     f"<span>{_esc(report.gate.reason)}</span></div>")
    parts += [f"<div class='banner info'><span>{_esc(note)}</span></div>" for note in report.notes]
    parts.append(_mlflow_line(report.mlflow_run_id, report.mlflow_url))
    parts.append(_headline(report.metrics))
    charts = [chart for title, keys in CURVES if (chart := _chart(title, keys, report.history))]
    if charts:
        parts += ["<h2>Training curves</h2>", f"<div class='charts'>{''.join(charts)}</div>"]
    if report.samples:
        parts += [f"<h2>Sample completions ({len(report.samples)})</h2>", samples_table(report.samples)]
    if report.metrics:
        rows = "".join(f"<tr><td>{_esc(k)}</td><td class='n'>{_fmt(v)}</td></tr>" for k, v in sorted(report.metrics.items()))
        parts.append(f"<details><summary>All final metrics ({len(report.metrics)})</summary>"
                     f"<table><tr><th>metric</th><th>value</th></tr>{rows}</table></details>")
    return ("<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
            f"<meta http-equiv='Content-Security-Policy' content=\"{CSP}\">"
            f"<title>{_esc(report.title)}</title><style>{CSS}</style></head><body>{''.join(parts)}</body></html>")


def _mlflow_line(run_id: str, url: str) -> str:
    if url:
        return f"<div class='sub'>MLflow run: <a href='{_esc(url)}' target='_blank'>{_esc(run_id or url)}</a></div>"
    if run_id:
        return f"<div class='sub'>MLflow run: <code>{_esc(run_id)}</code></div>"
    return ""


def headline_metrics(metrics: dict[str, float]) -> list[tuple[str, str, float]]:
    """(metric, label, value) of the headline metrics present; without any, the first four metrics."""
    picked = [(key, label, metrics[key]) for key, label in HEADLINE if _is_number(metrics.get(key))]
    if not picked:
        picked = [(key, key, value) for key, value in sorted(metrics.items()) if _is_number(value)][:4]
    return picked


def _headline(metrics: dict[str, float]) -> str:
    cards = "".join(f"<div class='card' title='{_esc(key)}'><div class='v'>{_fmt(value)}</div>"
                    f"<div class='k'>{_esc(label)}</div></div>" for key, label, value in headline_metrics(metrics))
    return f"<div class='cards'>{cards}</div>" if cards else ""


def _series(keys: list[str], history: list[dict[str, Any]]) -> dict[str, list[tuple[float, float]]]:
    """The (step, value) points of each key present in `history` (two points at least)."""
    if "reward" in keys:
        keys = keys + sorted({k for r in history for k in r if k.startswith("rewards/") and k.endswith("/mean")})
    out = {}
    for key in keys:
        points = [(float(r["step"]), float(r[key])) for r in history
                  if "step" in r and _is_number(r.get(key)) and math.isfinite(float(r[key]))]
        if len(points) >= 2:
            out[key] = points
    return out


def _chart(title: str, keys: list[str], history: list[dict[str, Any]]) -> str:
    series = _series(keys, history)
    return f"<div class='chart'>{svg_chart(title, series)}</div>" if series else ""


def svg_chart(title: str, series: dict[str, list[tuple[float, float]]], width: int = 420, height: int = 230) -> str:
    """A line chart of named (x, y) series as an inline SVG element, with axes, ticks and a legend."""
    points = [p for pts in series.values() for p in pts]
    if not points:
        return ""
    left, right, top, bottom = 52, 12, 26, 36 + 14 * len(series)
    x0, x1 = min(p[0] for p in points), max(p[0] for p in points)
    y0, y1 = min(p[1] for p in points), max(p[1] for p in points)
    if y1 - y0 < 1e-12:
        y0, y1 = y0 - 0.5 * (abs(y0) or 1), y1 + 0.5 * (abs(y1) or 1)
    plot_w, plot_h = width - left - right, height - top - bottom

    def sx(x: float) -> float:
        return left + (x - x0) / ((x1 - x0) or 1) * plot_w

    def sy(y: float) -> float:
        return top + (y1 - y) / (y1 - y0) * plot_h

    out = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' role='img' "
           f"font-family='system-ui,sans-serif' font-size='10'><title>{_esc(title)}</title>",
           f"<text x='{left}' y='16' font-size='13' font-weight='600' fill='#111827'>{_esc(title)}</text>"]
    for i in range(5):  # horizontal grid lines with y labels
        y = y0 + (y1 - y0) * i / 4
        out.append(f"<line x1='{left}' x2='{width - right}' y1='{sy(y):.1f}' y2='{sy(y):.1f}' stroke='#e5e7eb'/>"
                   f"<text x='{left - 4}' y='{sy(y) + 3:.1f}' text-anchor='end' fill='#6b7280'>{y:.3g}</text>")
    for x in (x0, (x0 + x1) / 2, x1):
        out.append(f"<text x='{sx(x):.1f}' y='{top + plot_h + 13}' text-anchor='middle' fill='#6b7280'>{x:.0f}</text>")
    out.append(f"<text x='{left + plot_w / 2:.1f}' y='{top + plot_h + 26}' text-anchor='middle' "
               "fill='#6b7280'>step</text>")
    for i, (name, pts) in enumerate(series.items()):
        color = COLORS[i % len(COLORS)]
        coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
        out.append(f"<polyline fill='none' stroke='{color}' stroke-width='1.8' points='{coords}'/>")
        lx, ly = left, top + plot_h + 44 + 14 * i  # one legend line per series
        out.append(f"<rect x='{lx:.1f}' y='{ly - 8}' width='10' height='3' fill='{color}'/>"
                   f"<text x='{lx + 14:.1f}' y='{ly - 4}' fill='#374151'>{_esc(name)} "
                   f"(last {pts[-1][1]:.4g})</text>")
    out.append("</svg>")
    return "".join(out)


def samples_table(samples: list[dict[str, Any]]) -> str:
    """Sample completions: prompt and completion as chat text, then one column per number (each reward
    function's `rewards/<name>`, the weighted reward, the advantage, ...)."""
    text_cols = [c for c in ("prompt", "completion", "baseline_completion") if any(c in r for r in samples)]
    columns = list(dict.fromkeys(k for r in samples for k in r))
    lead = [c for c in ("step",) if c in columns]
    # Each reward function's score first, then what they add up to, then anything else (dataset columns, ...).
    order = {"reward": 1, "score": 1, "advantage": 2}
    rest = sorted((c for c in columns if c not in text_cols and c not in lead),
                  key=lambda c: 0 if c.startswith("rewards/") else order.get(c, 3))
    head = "".join(f"<th>{_esc(c)}</th>" for c in lead + text_cols + rest)
    body = []
    for row in samples:
        cells = [f"<td class='n'>{_fmt(row.get(c))}</td>" for c in lead]
        cells += [f"<td><div class='text'>{chat_html(row.get(c))}</div></td>" for c in text_cols]
        cells += [f"<td class='n'>{_fmt(row.get(c))}</td>" if _is_number(row.get(c)) or row.get(c) is None
                  else f"<td><div class='text'>{chat_html(row.get(c))}</div></td>" for c in rest]
        body.append(f"<tr>{''.join(cells)}</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def chat_html(value: Any) -> str:
    """Text as escaped text; chat messages ([{role, content}]) as one labelled block per message."""
    if isinstance(value, list) and value and all(isinstance(m, dict) and "role" in m for m in value):
        return "".join(f"<div class='msg'><span class='role'>{_esc(m['role'])}</span>{_esc(m.get('content', ''))}</div>"
                       for m in value)
    return "" if value is None else _esc(value if isinstance(value, str) else str(value))


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _fmt(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    return _esc(str(value))


def _esc(text: Any) -> str:
    return html.escape(str(text), quote=True)


def write(path: str, text: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text, encoding="utf-8")
