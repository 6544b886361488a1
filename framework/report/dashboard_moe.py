"""The Mixture-of-Experts section of report.html (framework/report/dashboard.py).

Only for the completed jobs whose metrics.jsonl rows carry `moe_layers` (docs/metrics.md,
"Mixture-of-Experts"); a sweep without one gets no section at all, so a dense sweep's page
is what it was. The section holds:
  - the worst layer's load imbalance (`moe_load_cv_max`) against step, every MoE job overlaid;
  - the all-to-all share of the step, a2a_s / step_time_s, per job that has it (ep > 1),
    the median over the measured steps;
  - per job, the expert load over steps as heat maps, one per MoE layer (x step, y expert,
    colour the tokens routed to it). At most MAX_LAYERS layers, spread over the depth (the
    first and last included) when a model has more: the title says which were left out.
"""

from __future__ import annotations

import html
import math
import statistics
from typing import Optional

from framework.report.dashboard_parts import Job, _layout, fmt_number, fmt_percent

MAX_LAYERS = 8  # heat maps per job: 4 rows of 2 still read at a glance


def moe_jobs(jobs: list[Job]) -> list[Job]:
    return [j for j in jobs if any(r.get("moe_layers") for r in j.metrics)]


def shown_layers(layers: list[str], limit: int = MAX_LAYERS) -> list[str]:
    """All layers, or `limit` of them evenly spread from the first to the last: early and
    late layers route differently, so a prefix would hide half the picture."""
    if len(layers) <= limit:
        return layers
    return [layers[round(k * (len(layers) - 1) / (limit - 1))] for k in range(limit)]


def load_heatmap(job: Job):
    """Tokens per expert against step, one heat map per shown layer, one colour scale."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    rows = [r for r in job.metrics if r.get("moe_layers")]
    steps = [r["step"] for r in rows]
    layers = sorted({i for r in rows for i in r["moe_layers"]}, key=int)
    shown = shown_layers(layers)
    cols = 1 if len(shown) == 1 else 2
    grid = math.ceil(len(shown) / cols)
    fig = make_subplots(rows=grid, cols=cols, subplot_titles=[f"layer {i}" for i in shown],
                        vertical_spacing=min(0.12, 0.5 / grid), horizontal_spacing=0.08)
    for n, i in enumerate(shown):
        loads = [(r["moe_layers"].get(i) or {}).get("tokens_per_expert") for r in rows]
        experts = max(len(c) for c in loads if c)
        # z[expert][step]: a step missing the layer (none expected) stays a gap
        z = [[c[e] if c else None for c in loads] for e in range(experts)]
        fig.add_trace(go.Heatmap(x=steps, y=list(range(experts)), z=z, coloraxis="coloraxis",
                                 hovertemplate=f"layer {i}<br>step %{{x}}, expert %{{y}}: %{{z:,.0f}} tokens<extra></extra>"),
                      row=n // cols + 1, col=n % cols + 1)
        fig.update_yaxes(title_text="expert", dtick=1 if experts <= 16 else None, row=n // cols + 1, col=n % cols + 1)
    fig.update_xaxes(title_text="step", row=grid)
    left_out = [i for i in layers if i not in shown]
    title = f"{job.label}: tokens routed to each expert, per step and MoE layer" + (
        f" ({len(shown)} of {len(layers)} layers shown; left out: {', '.join(left_out)})" if left_out else "")
    fig.update_layout(coloraxis=dict(colorscale="Viridis", colorbar=dict(title="tokens")))
    return _layout(fig, title, height=140 + 220 * grid, showlegend=False)


def imbalance_figure(jobs: list[Job]):
    import plotly.graph_objects as go

    fig = go.Figure()
    for job in jobs:
        rows = [r for r in job.metrics if r.get("moe_load_cv_max") is not None]
        fig.add_trace(go.Scatter(x=[r["step"] for r in rows], y=[r["moe_load_cv_max"] for r in rows],
                                 mode="lines+markers", name=job.label))
    return _layout(fig, "Expert load imbalance: the worst layer's coefficient of variation of tokens per expert "
                        "(moe_load_cv_max; 0 = even)", xaxis_title="step", yaxis_title="load CV", height=440)


def a2a_share(job: Job) -> Optional[tuple[float, float, float]]:
    """(median a2a_s / step_time_s, median a2a_s, median a2a_bytes) over the measured steps
    (summary.json's `measured_steps`: the last rows), or None without all-to-all (ep = 1).
    Both times are maxima over ranks, possibly of different ranks: a share, not a split."""
    rows = [r for r in job.metrics if r.get("a2a_s") is not None and r.get("step_time_s")]
    if not rows:
        return None
    rows = rows[-job.summary["measured_steps"]:] if job.summary.get("measured_steps") else rows
    return (statistics.median(r["a2a_s"] / r["step_time_s"] for r in rows),
            statistics.median(r["a2a_s"] for r in rows), statistics.median(r["a2a_bytes"] for r in rows))


def a2a_figure(jobs: list[Job]):
    """None when no job has expert parallelism."""
    import plotly.graph_objects as go

    shares = [(j, a2a_share(j)) for j in jobs]
    shares = [(j, s) for j, s in shares if s is not None]
    if not shares:
        return None
    fig = go.Figure(go.Bar(
        x=[j.label for j, _ in shares], y=[s[0] for _, s in shares], text=[fmt_percent(s[0]) for _, s in shares],
        hovertext=[f"a2a {s[1] * 1e3:.1f} ms, {fmt_number(s[2])} bytes a step (medians)" for _, s in shares],
        hovertemplate="%{x}<br>%{text} of the step<br>%{hovertext}<extra></extra>", marker_color="#756bb1"))
    return _layout(fig, "All-to-all share of the step (a2a_s / step_time_s, median over measured steps; host seconds)",
                   yaxis_title="share of step time", yaxis_tickformat=".0%", height=440, showlegend=False)


def _figure(title: str, fig) -> str:
    return f"<h3>{html.escape(title)}</h3>" + fig.to_html(full_html=False, include_plotlyjs=False)


def moe_section(jobs: list[Job]) -> str:
    """The section's HTML; "" when no job is a MoE job."""
    moe = moe_jobs(jobs)
    if not moe:
        return ""
    parts = ['<h2 id="moe">Mixture-of-Experts</h2>',
             "<p>Routing per step from metrics.jsonl (docs/metrics.md, Mixture-of-Experts): the worst layer's load "
             "imbalance, the all-to-all share of the step under expert parallelism, and each job's tokens per "
             "expert over steps.</p>",
             _figure("Expert load imbalance", imbalance_figure(moe))]
    a2a = a2a_figure(moe)
    if a2a is not None:
        parts.append(_figure("All-to-all share of the step", a2a))
    parts += [_figure(f"Expert load: {job.label}", load_heatmap(job)) for job in moe]
    return '<div id="moe-section">' + "".join(parts) + "</div>"
