"""The dashboard's comparison panels (framework/report/dashboard.py draws the page): where
each job's step goes, memory against throughput with the Pareto front, tokens/s over the
steps with each job's spread, and throughput bars with their spread.

- **Step-time breakdown**: summary.json's `time_<part>_s` (medians over the measured steps,
  means over ranks: framework/metrics/breakdown.py) stacked per job, exposed communication
  per dimension beside compute, bubble, host, optimizer and data. Parts every job has at 0
  are left out; a job without the keys (an older summary) has no bar.
- **Memory against throughput**: x = the fullest rank's tensor memory (model states measured
  + the activation peak: `model_state_bytes` + `activation_peak_bytes` of summary.json's
  ranks, the memory the layout itself needs; not RSS, which adds the framework, allocator
  and libraries), y = tokens/s. A job is on the Pareto front when no other job is both
  faster and lighter; the front is drawn as a line through those jobs.
- **Tokens/s over the steps**: each job's per-step tokens/s (metrics.jsonl) as a line, and
  a band from its p10 to its p90 step (summary.json's `step_time_p90_s` / `p10`: the spread
  over the measured steps) behind it.
- **Throughput bars** carry error bars from the same p10 / p90, their numbers above the
  error bar's top (`labels_above`: on the bar, the error bar struck them through).
"""

from __future__ import annotations

from framework.metrics.breakdown import PARTS
from framework.report.dashboard_parts import JOB_COLOURS, Job, _layout, byte_unit, fmt_number, rgba

PART_COLOURS = {"compute": "#3182bd", "comm_dp": "#e6550d", "comm_tp": "#fd8d3c", "comm_pp": "#fdae6b",
                "comm_ep": "#a63603", "comm_cp": "#fdd0a2", "bubble": "#bdbdbd", "host": "#756bb1",
                "optimizer": "#31a354", "data": "#969696"}
PART_NAMES = {"compute": "compute", "bubble": "pipeline bubble", "host": "host (between actions, bookkeeping)",
              "optimizer": "optimizer", "data": "data loading",
              **{f"comm_{d}": f"{d} communication (exposed)" for d in ("dp", "tp", "pp", "ep", "cp")}}


def breakdown_figure(jobs: list[Job]):
    """None when no job has a breakdown."""
    import plotly.graph_objects as go

    have = [j for j in jobs if j.summary.get("time_compute_s") is not None]
    if not have:
        return None
    names = [j.label for j in have]
    fig = go.Figure()
    for part in PARTS:
        values = [(j.summary.get(f"time_{part}_s") or 0.0) * 1e3 for j in have]
        if not any(values):
            continue
        fig.add_trace(go.Bar(x=names, y=values, name=PART_NAMES[part], marker_color=PART_COLOURS[part],
                             hovertemplate="%{x}<br>" + PART_NAMES[part] + ": %{y:.1f} ms<extra></extra>"))
    return _layout(fig, "Where each job's step goes (ms per step: medians, means over ranks)", barmode="stack",
                   yaxis_title="ms per step", height=480)


def tensor_memory(job: Job):
    """The fullest rank's model states + activation peak (bytes), None when unknown."""
    ranks = [r for r in job.summary.get("ranks", []) if r.get("model_state_bytes") is not None]
    if not ranks:
        return None
    return max(r["model_state_bytes"] + (r.get("activation_peak_bytes") or 0) for r in ranks)


def pareto(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points (memory, tokens/s) no other point beats in both (lighter or
    equal and faster or equal, one strictly), by increasing memory."""
    front = [i for i, (m, t) in enumerate(points)
             if not any(m2 <= m and t2 >= t and (m2, t2) != (m, t) for m2, t2 in points)]
    return sorted(front, key=lambda i: points[i][0])


def pareto_figure(jobs: list[Job]):
    """None with fewer than two jobs that have both numbers."""
    import plotly.graph_objects as go

    have = [(j, tensor_memory(j), j.summary.get("tokens_per_s")) for j in jobs]
    have = [(j, m, t) for j, m, t in have if m is not None and t is not None]
    if len(have) < 2:
        return None
    unit, size = byte_unit(max(m for _, m, _ in have))
    front = pareto([(m, t) for _, m, t in have])
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=[m / size for _, m, _ in have], y=[t for _, _, t in have], mode="markers+text",
                             text=[j.row["job"] for j, _, _ in have], textposition="top center",
                             hovertext=[j.label for j, _, _ in have], name="jobs",
                             hovertemplate="%{hovertext}<br>%{x:.2f} " + unit + ", %{y:,.0f} tokens/s<extra></extra>",
                             marker=dict(size=12, color="#3182bd")))
    fig.add_trace(go.Scatter(x=[have[i][1] / size for i in front], y=[have[i][2] for i in front],
                             mode="lines+markers", name="Pareto front (no job both faster and lighter)",
                             line=dict(color="#de2d26", dash="dash"), marker=dict(size=16, symbol="circle-open")))
    return _layout(fig, "Memory against throughput (tensor memory of the fullest rank; Pareto front marked)",
                   xaxis_title=f"model states + activation peak, fullest rank ({unit})",
                   yaxis_title="tokens/s", yaxis_tickformat=",", height=480)


def spread(job: Job) -> tuple:
    """(tokens/s at the p90 step time, at the p10 one): the job's spread, or (None, None)."""
    s = job.summary
    p10, p90, tokens = s.get("step_time_p10_s"), s.get("step_time_p90_s"), s.get("tokens_per_step")
    if not (p10 and p90 and tokens):
        return None, None
    return tokens / p90, tokens / p10


def steps_figure(jobs: list[Job]):
    """None when no job has per-step rows."""
    import plotly.graph_objects as go

    have = [j for j in jobs if any(r.get("tokens_per_s") is not None for r in j.metrics)]
    if not have:
        return None
    fig = go.Figure()
    for i, j in enumerate(have):
        rows = [r for r in j.metrics if r.get("tokens_per_s") is not None]
        steps = [r["step"] for r in rows]
        lo, hi = spread(j)
        colour = JOB_COLOURS[i % len(JOB_COLOURS)]  # the line's and its band's (the page checks: dashboard_checks.py)
        if lo is not None:
            fig.add_trace(go.Scatter(x=[steps[0], steps[-1], steps[-1], steps[0]], y=[lo, lo, hi, hi], fill="toself",
                                     mode="lines", line=dict(width=0, color=colour), fillcolor=rgba(colour, 0.2),
                                     legendgroup=j.label, name=f"{j.label} (p10-p90)", hoverinfo="skip"))
        fig.add_trace(go.Scatter(x=steps, y=[r["tokens_per_s"] for r in rows], mode="lines+markers", name=j.label,
                                 legendgroup=j.label, line=dict(color=colour), marker=dict(color=colour)))
    return _layout(fig, "Tokens/s over the steps (bands: each job's p10-p90 over its measured steps)",
                   xaxis_title="step", yaxis_title="tokens/s", yaxis_tickformat=",", height=460)


def throughput_error(jobs: list[Job]) -> dict:
    """plotly error_y of the throughput bars: down to the p90 step's tokens/s, up to the p10's."""
    lows, highs = [], []
    for j in jobs:
        lo, hi = spread(j)
        t = j.summary.get("tokens_per_s")
        lows.append(None if lo is None or t is None else max(0.0, t - lo))
        highs.append(None if hi is None or t is None else max(0.0, hi - t))
    return dict(type="data", symmetric=False, array=highs, arrayminus=lows, color="#252525")


def labels_above(x: list, values: list, error: dict, texts: list[str]):
    """The bars' numbers as a text trace just above each error bar's top, and the y range
    that leaves them room: a bar's own text sits where its error bar crosses it (report.html
    checks that no label is crossed: dashboard_checks.py)."""
    import plotly.graph_objects as go

    tops = [None if v is None else v + (up or 0.0) for v, up in zip(values, error["array"], strict=True)]
    trace = go.Scatter(x=x, y=tops, mode="text", text=texts, textposition="top center", cliponaxis=False,
                       showlegend=False, hoverinfo="skip")
    return trace, [0, 1.15 * max([t for t in tops if t is not None] or [1.0])]


def interval_text(job: Job) -> str:
    """The bar's label: tokens/s and its p10-p90 range."""
    lo, hi = spread(job)
    t = fmt_number(job.summary.get("tokens_per_s"))
    return t if lo is None else f"{t} ({fmt_number(lo)}-{fmt_number(hi)})"


def repeats_figure(sweep, done_rows: list[dict]):
    """sweep.repeats: each configuration's median tokens/s with its interval and each
    repeat's median as a point; a pair the interval cannot tell apart is named under the
    title. None without repeats (framework/report/repeats.py)."""
    import plotly.graph_objects as go

    from framework.report.repeats import LEVEL, summarise

    configs, pairs = summarise(sweep, done_rows)
    if not configs:
        return None
    names = [c.name for c in configs]
    error = dict(type="data", symmetric=False, array=[c.high - c.median for c in configs],
                 arrayminus=[c.median - c.low for c in configs], color="#252525")
    fig = go.Figure(go.Bar(x=names, y=[c.median for c in configs], name=f"median ({LEVEL:.0%} interval)",
                           marker_color="#9ecae1", error_y=error))
    fig.add_trace(go.Scatter(x=[c.name for c in configs for _ in c.repeats], y=[m for c in configs for m in c.repeats],
                             mode="markers", name="each repeat's median", marker=dict(color="#08519c", size=9)))
    labels, top = labels_above(names, [c.median for c in configs], error, [fmt_number(c.median) for c in configs])
    fig.add_trace(labels)
    fig.update_yaxes(range=[0, max([top[1], *(1.05 * m for c in configs for m in c.repeats)])])
    same = [f"{p.faster} ~ {p.slower}" for p in pairs if not p.distinguishable]
    title = "Repeats: tokens/s per configuration (median over every repeat's steps, interval bars)" + (
        f"; not distinguishable: {'; '.join(same)}" if same else "")
    return _layout(fig, title, yaxis_title="tokens/s", yaxis_tickformat=",", height=480)
