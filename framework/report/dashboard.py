"""The comparison dashboard of a sweep: `report.html`, one self-contained page.

Written by `python -m framework.report <sweep dir>` beside report.md. plotly's JavaScript is
embedded once in the page, so it opens offline (a laptop, a cluster's login node, an e-mail
attachment) and needs no server. It holds, for the jobs of the sweep:
  - the table of every job (status and reason of those that did not complete), in readable
    units, under the report's headline (framework.report.compare's fairness warnings: jobs that differ
    in work per step, model config or parameter count; then the best job);
  - loss against step, every completed job overlaid (held-out val_loss as markers);
  - tokens/s (p10-p90 error bars) and MFU per job; tokens/s over the steps with each job's
    p10-p90 band; the step-time breakdown stacked per job; memory against throughput with
    the Pareto front (framework/report/dashboard_compare.py);
  - measured pipeline bubble per job, beside the simulator's replay of the run's own durations
    and the schedule's declared bubble (a closed form, or its schedule model: a simulation);
  - per-rank memory, stacked: parameters, gradients, optimizer states, activations (the peak
    of saved activations), with the ZeRO paper's formula for the rank's model states marked;
  - each pipeline job's timeline: the step `timeline_step` of summary.json (the measured
    step with the median time), from trace.json, one row per rank, and its replay under it;
  - MoE jobs only: expert load heat maps, load imbalance, all-to-all share (dashboard_moe.py).
Only completed jobs are plotted; every job is in the table; a panel without data is left
out. The page checks its own layout in the browser (dashboard_checks.py). Each job has one label
everywhere: its number and overrides.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

from framework.metrics.bubble import analytic_label
from framework.schedules import CLOSED_FORM, SCHEDULE_MODEL
from framework.report.dashboard_compare import (breakdown_figure, interval_text, labels_above, pareto_figure,
                                                repeats_figure, steps_figure, throughput_error)
from framework.report.dashboard_checks import CHECKS
from framework.report.dashboard_moe import moe_section
from framework.report.dashboard_table import common_overrides, table_html  # noqa: F401 (tests import it here)
from framework.report.dashboard_parts import Job, _layout, byte_unit, fmt_bytes, fmt_number, fmt_percent  # noqa: F401 (re-exported)

PAGE = "report.html"
REPLAY_ROW = "replay rank"  # the timeline rows of the simulator's replay of the job's own durations
LABEL_CHARS = 60
# Forward light, backward dark (as timeline.png), updates grey, waits pale: idle shows as idle.
ACTION_COLOURS = {"F": "#9ecae1", "B": "#2171b5", "I": "#08519c", "W": "#fd8d3c", "U": "#969696", "wait": "#f0f0f0"}
ACTION_NAMES = {"F": "forward", "B": "backward", "I": "backward (input)", "W": "backward (weights)", "U": "update",
                "wait": "receive wait"}
MEMORY_PARTS = (("params_bytes", "parameters", "#4292c6"), ("grads_bytes", "gradients", "#fd8d3c"),
                ("master_bytes", "master weights", "#fdd0a2"), ("optimizer_bytes", "optimizer states", "#74c476"),
                ("activation_peak_bytes", "activations (peak)", "#9e9ac8"))


def label(row: dict, common: list[str] = ()) -> str:
    """The job's number and what sets it apart from the other jobs of the sweep."""
    own = [o for o in (row.get("overrides") or "").split() if o not in common]
    text = f"{row['job']}: {' '.join(own) or 'defaults'}"
    return text if len(text) <= LABEL_CHARS else text[:LABEL_CHARS - 1] + "…"


# ---- reading the jobs -------------------------------------------------------------------

def load_jobs(sweep: Path, rows: list[dict]) -> list[Job]:
    """The completed jobs with their summary and metrics (what the plots need)."""
    common, jobs = common_overrides(rows), []
    for row in rows:
        folder = sweep / row["job"]
        if row.get("status") != "completed":
            continue
        try:
            summary = json.loads((folder / "summary.json").read_text())
        except (OSError, ValueError):
            continue
        jobs.append(Job(row, label(row, common), summary, _metrics(folder / "metrics.jsonl"), folder))
    return jobs


def _metrics(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []


def _timeline_events(job: Job) -> list[dict]:
    """trace.json's compute and wait slices of the timeline step (pipelines only), then the
    simulator's replay of that step at the run's own durations (predicted_trace.json), on rows
    named `replay rank r`."""
    step = job.summary.get("timeline_step")
    out = []
    for name, prefix in (("trace.json", "rank"), ("predicted_trace.json", REPLAY_ROW)):
        try:
            trace = json.loads((job.folder / name).read_text())
        except (OSError, ValueError):
            continue
        events = [e for e in trace.get("traceEvents", [])  # pid 1: all-to-all calls (ep), not pipeline actions
                  if e.get("ph") == "X" and e.get("pid", 0) == 0 and (e.get("args") or {}).get("step") == step]
        t0 = min((e["ts"] for e in events), default=0.0)  # each from its own step's start
        out += [{**e, "ts": e["ts"] - t0, "row": f"{prefix} {e['tid']}"} for e in events]
    return out


# ---- figures ----------------------------------------------------------------------------

def loss_figure(jobs: list[Job]):
    import plotly.graph_objects as go

    fig = go.Figure()
    for job in jobs:
        rows = job.metrics
        fig.add_trace(go.Scatter(x=[r["step"] for r in rows], y=[r["loss"] for r in rows], mode="lines",
                                 name=job.label, legendgroup=job.label))
        evals = [r for r in rows if r.get("val_loss") is not None]
        if evals:
            fig.add_trace(go.Scatter(x=[r["step"] for r in evals], y=[r["val_loss"] for r in evals],
                                     mode="markers", name=f"{job.label} (val_loss)", legendgroup=job.label))
    return _layout(fig, "Loss against step (training loss lines; held-out val_loss markers)",
                   xaxis_title="step", yaxis_title="loss (nats per token)", height=460)


def throughput_figure(jobs: list[Job]):
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    names = [j.label for j in jobs]
    fig = make_subplots(rows=1, cols=2, subplot_titles=("tokens/s (median after warm-up; bars: p10-p90 steps)",
                                                        "MFU (model FLOP/s over the per-rank peak)"))
    tps = [j.summary.get("tokens_per_s") for j in jobs]
    mfu = [j.summary.get("mfu") for j in jobs]  # null under fp64: no bar
    error = throughput_error(jobs)
    fig.add_trace(go.Bar(x=names, y=tps, name="tokens/s", error_y=error, hovertext=[interval_text(j) for j in jobs],
                         hovertemplate="%{x}<br>tokens/s %{hovertext} (median, p10-p90 steps)<extra></extra>",
                         marker_color="#3182bd"), row=1, col=1)
    # the numbers above the error bars, not on the bars, where the error bars struck them through
    labels, y_range = labels_above(names, tps, error, [fmt_number(v) for v in tps])
    fig.add_trace(labels, row=1, col=1)
    fig.add_trace(go.Bar(x=names, y=mfu, name="MFU", text=[fmt_percent(v) for v in mfu],
                         marker_color="#e6550d"), row=1, col=2)
    fig.update_yaxes(title_text="tokens/s", tickformat=",", range=y_range, row=1, col=1)
    fig.update_yaxes(title_text="MFU", tickformat=".1%", row=1, col=2)
    _layout(fig, "Throughput per job", height=480, showlegend=False)
    fig.update_layout(margin_t=fig.layout.margin.t + 30)  # room for the subplots' own titles under the figure's
    return fig


def bubble_figure(jobs: list[Job]):
    """The pipeline jobs only (None without any: an empty chart says nothing)."""
    import plotly.graph_objects as go

    jobs = [j for j in jobs if (j.summary.get("pp") or 1) > 1]
    if not jobs:
        return None
    names = [j.label for j in jobs]
    fig = go.Figure()
    for key, name, colour in (("bubble_fraction", "measured", "#31a354"),
                              ("predicted_bubble_fraction", "replay (simulator, the run's own durations)", "#9ecae1"),
                              ("bubble_fraction_analytic", "schedule's: closed form or schedule model", "#bdbdbd")):
        values = [j.summary.get(key) for j in jobs]
        text = [fmt_percent(v) + (" (schedule model)" if key == "bubble_fraction_analytic" and
                                  j.summary.get("bubble_analytic_source") == SCHEDULE_MODEL else "")
                for j, v in zip(jobs, values, strict=True)]
        fig.add_trace(go.Bar(x=names, y=values, name=name, text=text, marker_color=colour))
    return _layout(fig, "Pipeline bubble per job: measured (mean over ranks), the simulator's replay of each run, and "
                   "the schedule's (closed form or schedule model)", barmode="group",
                   yaxis_title="idle share of the step", yaxis_tickformat=".0%", height=460)


def memory_figure(jobs: list[Job]):
    import plotly.graph_objects as go

    ranks = [(job, r) for job in jobs for r in job.summary.get("ranks", [])]
    if not ranks:  # summaries without per-rank memory: no chart rather than an empty one
        return None
    totals = [sum(r.get(k) or 0 for k, _, _ in MEMORY_PARTS) for _, r in ranks]
    formulas = [r.get("model_state_formula_bytes") for _, r in ranks] + [r.get("model_state_formula_paper_bytes")
                                                                          for _, r in ranks]
    unit, size = byte_unit(max([*totals, *(f or 0 for f in formulas), 1]))
    x = [f"job {job.row['job']} · rank {r['rank']}" for job, r in ranks]
    hover = [f"{job.label}<br>rank {r['rank']} (pp {r.get('pp')}, dp {r.get('dp')}, tp {r.get('tp')})"
             for job, r in ranks]
    fig = go.Figure()
    for key, name, colour in MEMORY_PARTS:
        values = [(r.get(key) or 0) / size for _, r in ranks]
        fig.add_trace(go.Bar(x=x, y=values, name=name, marker_color=colour, hovertext=hover,
                             hovertemplate="%{hovertext}<br>" + name + ": %{y:.2f} " + unit + "<extra></extra>"))
    # Beside the measured bars: this configuration's formula and the ZeRO paper's form (2 + 2 + 12 with
    # master weights, 4 + 4 + 8 without), model states only
    for key, name, colour in (("model_state_formula_bytes", "this configuration's formula", "#de2d26"),
                              ("model_state_formula_paper_bytes", "the ZeRO paper's form", "#252525")):
        values = [r.get(key) for _, r in ranks]
        fig.add_trace(go.Scatter(x=x, y=[None if f is None else f / size for f in values], mode="markers", name=name,
                                 hovertext=hover, marker=dict(symbol="line-ew", size=34, line=dict(width=3, color=colour)),
                                 hovertemplate="%{hovertext}<br>" + name + ": %{y:.2f} " + unit + "<extra></extra>"))
    return _layout(fig, "Memory per rank: model states and the activation peak, against the formulas",
                   barmode="stack", yaxis_title=unit, height=520)


def timeline_figure(job: Job):
    """One pipeline step as a Gantt chart (None when the job has no trace)."""
    import plotly.graph_objects as go

    events = _timeline_events(job)
    if not events:
        return None
    fig = go.Figure()
    for cat in ("wait", "F", "B", "I", "W", "U"):
        mine = [e for e in events if e.get("cat") == cat]
        if not mine:
            continue
        fig.add_trace(go.Bar(
            orientation="h", y=[e["row"] for e in mine], x=[e["dur"] / 1e3 for e in mine],
            base=[e["ts"] / 1e3 for e in mine], name=ACTION_NAMES[cat], marker_color=ACTION_COLOURS[cat],
            marker_line=dict(width=0.5, color="#252525"), text=[e["name"] if cat != "wait" else "" for e in mine],
            hovertemplate="%{text} %{x:.1f} ms from %{base:.1f} ms<extra>" + ACTION_NAMES[cat] + "</extra>"))
    s = job.summary
    title = (f"{job.label}: step {s.get('timeline_step')} (median step time) | bubble measured "
             f"{fmt_percent(s.get('bubble_fraction'))}, {analytic_label(s.get('bubble_analytic_source', CLOSED_FORM))} "
             f"{fmt_percent(s.get('bubble_fraction_analytic'))}"
             + (f", replay {fmt_percent(s['predicted_bubble_fraction'])} (step time "
                f"{s['predicted_step_time_error']:+.1%} vs measured)" if s.get("predicted_step_time_error") is not None
                else ""))
    rows = sorted({e["row"] for e in events}, key=lambda r: (r.startswith(REPLAY_ROW), int(r.split()[-1])))
    return _layout(fig, title, barmode="overlay", xaxis_title="ms from the step's first action",
                   yaxis=dict(autorange="reversed", categoryorder="array",
                              categoryarray=rows),
                   height=180 + 50 * len(rows))


# ---- the page ---------------------------------------------------------------------------

STYLE = """
body { font-family: system-ui, sans-serif; margin: 24px; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.1em; margin-top: 28px; }
table { border-collapse: collapse; font-size: 0.8em; width: 100%; }
th, td { border: 1px solid #ddd; padding: 3px 5px; text-align: right; white-space: nowrap; }
td.text { text-align: left; white-space: normal; overflow-wrap: anywhere; min-width: 4.5em; }
th { background: #f5f5f5; white-space: normal; font-weight: 600; }
tr.status-failed, tr.status-rejected, tr.status-interrupted, tr.status-incomplete, tr.status-not\\ run {
  background: #fff3f3; }
.notes p { margin: 4px 0; } .warning { color: #b30000; }
"""


def _section(title: str, fig) -> str:
    """A panel; "" for a figure without data (None): a panel is drawn only when it has some."""
    if fig is None:
        return ""
    return f"<h2>{html.escape(title)}</h2>" + fig.to_html(full_html=False, include_plotlyjs=False)


def render(sweep: Path, rows: list[dict], notes: list[str]) -> str:
    from plotly.offline import get_plotlyjs


    jobs = load_jobs(sweep, rows)
    parts = [f"<h1>Sweep {html.escape(str(sweep))}: {len(rows)} jobs, {len(jobs)} completed</h1>",
             '<div class="notes">' + "".join(
                 f'<p class="{"warning" if n.startswith("WARNING") else "best"}">{html.escape(n)}</p>' for n in notes)
             + "</div>", "<h2>Jobs</h2>",
             f"<p>Common overrides: <code>{html.escape(' '.join(common_overrides(rows)) or 'none')}</code></p>",
             table_html(rows, jobs)]
    if jobs:
        parts += [_section("Loss", loss_figure(jobs)), _section("Throughput", throughput_figure(jobs)),
                  _section("Repeats", repeats_figure(sweep, [j.row for j in jobs])),
                  _section("Tokens/s over the steps", steps_figure(jobs)),
                  _section("Where the step goes", breakdown_figure(jobs)),
                  _section("Memory against throughput", pareto_figure(jobs)),
                  _section("Pipeline bubble", bubble_figure(jobs)), _section("Memory per rank", memory_figure(jobs))]
        for job in jobs:
            fig = timeline_figure(job)
            if fig is not None:
                parts.append(_section(f"Pipeline timeline: {job.label}", fig))
        parts.append(moe_section(jobs))  # "" for a dense sweep
    return ("<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>Sweep report</title>"
            f"<style>{STYLE}</style><script type=\"text/javascript\">{get_plotlyjs()}</script></head>"
            f"<body>{''.join(parts)}<script>{CHECKS}</script></body></html>")


def write_dashboard(sweep: Path, rows: list[dict], notes: list[str]) -> Path:
    """Write <sweep>/report.html (atomically: a half-written page never looks like a report).
    `notes`: the lines above the table (framework.report.compare's headline: its warnings, the best job)."""
    from framework.files import write_atomic

    path = Path(sweep) / PAGE
    write_atomic(str(path), render(Path(sweep), rows, list(notes)))
    return path
