"""Pipeline timelines: Chrome trace events (opens in Perfetto) and a per-rank Gantt PNG.

Input: for each step, each rank's action records (name, start, compute_start, end) in
unix seconds. Clocks of ranks on one host are the same clock; across hosts they are as
close as the hosts' time sync. A receive wait (start -> compute_start) is drawn as its own
`wait` slice in the trace, so idle time shows as what it is.
"""

from __future__ import annotations

import json
from typing import Optional

from framework.metrics.bubble import analytic_label
from framework.schedules import CLOSED_FORM, Action

Record = tuple[str, float, float, float]  # action, start, compute_start, end


def kept_steps(first: int, last: int, measured_from: int, limit: int) -> set[int]:
    """The steps whose action records a run keeps (trace.json, the W&B actions table, the
    timeline, the op times): at most `limit` + 1, spread evenly from `first` to `last`, plus
    the first measured step, so a 100,000-step run keeps what a 100-step one does."""
    n = last - first + 1
    if n <= limit:
        return set(range(first, last + 1))
    spread = {first + round(i * (n - 1) / (limit - 1)) for i in range(limit)} if limit > 1 else {last}
    return spread | {min(max(measured_from, first), last)}


def chrome_trace(steps: dict[int, list[list[Record]]], comm: Optional[dict] = None) -> dict:
    """`comm`: step -> per-rank (dim, what, start, end) communication spans
    (framework/comm/comm_timer.py), drawn as slices of category dim (`a2a` for ep's
    all-to-alls) on the rank's row of their own process (pid 1), so they never hide the
    compute they run inside of."""
    comm = comm or {}
    starts = [r[1] for per_rank in steps.values() for recs in per_rank for r in recs] + \
        [s for per_rank in comm.values() for spans in per_rank for _, _, s, _ in spans]
    t0 = min(starts, default=0.0)
    events = []
    n_ranks = max([len(v) for v in steps.values()] + [len(v) for v in comm.values()], default=0)
    for rank in range(n_ranks):
        events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": rank, "args": {"name": f"rank {rank}"}})
    for step, per_rank in sorted(steps.items()):
        for rank, recs in enumerate(per_rank):
            for name, start, cstart, end in recs:
                if cstart - start > 0:
                    events.append({"name": "wait", "cat": "wait", "ph": "X", "pid": 0, "tid": rank,
                                   "ts": (start - t0) * 1e6, "dur": (cstart - start) * 1e6, "args": {"step": step}})
                action = Action.parse(name)
                op = action.op.value
                events.append({"name": name, "cat": op, "ph": "X", "pid": 0, "tid": rank, "ts": (cstart - t0) * 1e6,
                               "dur": (end - cstart) * 1e6, "args": {"step": step, "microbatch": action.microbatch}})
    if comm:
        events.append({"ph": "M", "name": "process_name", "pid": 1,
                       "args": {"name": "communication (the rank waiting in a collective)"}})
    for step, per_rank in sorted(comm.items()):
        for rank, spans in enumerate(per_rank):
            for dim, what, start, end in spans:
                events.append({"name": what, "cat": "a2a" if dim == "ep" else dim, "ph": "X", "pid": 1, "tid": rank,
                               "ts": (start - t0) * 1e6, "dur": (end - start) * 1e6,
                               "args": {"step": step, "dim": dim}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_trace(steps: dict[int, list[list[Record]]], path: str, comm: Optional[dict] = None) -> None:
    with open(path, "w") as f:
        json.dump(chrome_trace(steps, comm), f)


def render_timeline(per_rank: list[list[Record]], path: str, title: str,
                    predicted: Optional[list[list[Record]]] = None, predicted_title: str = "",
                    comm: Optional[list[list]] = None) -> None:
    """timeline.png: `gantt_figure` saved (the figure's artists are what tests read)."""
    fig = gantt_figure(per_rank, title, predicted, predicted_title, comm)  # first: it picks the Agg backend
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110)
    plt.close(fig)


def gantt_figure(per_rank: list[list[Record]], title: str, predicted: Optional[list[list[Record]]] = None,
                 predicted_title: str = "", comm: Optional[list[list]] = None):
    """Gantt chart of one step, coloured by micro-batch (one hue each, MB_PAIRS): forwards light,
    backwards (B) dark, a split backward's I dark and hatched `//`, its W light and hatched `..`;
    updates grey.
    `comm`: per rank (dim, what, start, end) spans, a thin lane under the rank's compute,
    one grey per dimension (COMM_COLORS), its legend right of the chart. `predicted`: a
    simulated step (per pipeline rank; a run's own: the simulator's replay of its
    durations), drawn underneath on the same time axis."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on a training node
    import matplotlib.pyplot as plt

    panels = [(per_rank, title)] + ([(predicted, predicted_title)] if predicted else [])
    heights = [0.6 * len(recs) + 1.2 for recs, _ in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, sum(heights) + 0.3), sharex=True,
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    for i, (ax, (recs, text)) in enumerate(zip(axes[:, 0], panels)):
        _gantt(ax, recs, plt.get_cmap("tab20"), comm if i == 0 else None)
        ax.set_title(text, fontsize=9)
    axes[-1, 0].set_xlabel("ms since the step's first action (white = idle: waiting for a neighbour)")
    fig.tight_layout()  # counts the legend outside the axes: the axes shrink to leave it room
    return fig


# A micro-batch takes one of tab20's hue pairs (dark: B, I; light: F, W), never its grey pair
# (index 7): greys are the updates' (0.5) and communication's, so neither reads as a micro-batch.
MB_PAIRS = (0, 1, 2, 3, 4, 5, 6, 8, 9)
# One grey per dimension, none of them tab20's (0.5, 0.78); a black edge keeps the palest visible on white.
COMM_COLORS = {"dp": "#000000", "tp": "#3a3a3a", "pp": "#606060", "ep": "#a0a0a0", "cp": "#e0e0e0"}
COMM_OTHER = "#202020"  # a dimension not listed above


def _gantt(ax, per_rank: list[list[Record]], cmap, comm: Optional[list[list]] = None) -> None:
    t0 = min(r[1] for recs in per_rank for r in recs)
    for rank, spans in enumerate(comm or []):  # the communication lane, under the compute bars
        for dim, _, s, e in spans:
            ax.barh(rank + 0.5, (e - s) * 1e3, left=(s - t0) * 1e3, height=0.18, color=COMM_COLORS.get(dim, COMM_OTHER),
                    edgecolor="black", linewidth=0.3, gid=f"comm {dim}")
    dims = sorted({dim for spans in comm or [] for dim, *_ in spans}, key=lambda d: (list(COMM_COLORS) + [d]).index(d))
    if dims:
        from matplotlib.patches import Patch

        # Outside the axes, right of the chart: inside, it hid the bars under it
        ax.legend(handles=[Patch(facecolor=COMM_COLORS.get(d, COMM_OTHER), edgecolor="black", linewidth=0.3,
                                 label=f"{d} comm") for d in dims], fontsize=6, loc="upper left",
                  bbox_to_anchor=(1.005, 1.0), borderaxespad=0.0)
    for rank, recs in enumerate(per_rank):
        for name, _start, cstart, end in recs:
            action = Action.parse(name)
            mb, op = action.microbatch, action.op.value
            color = "0.5" if op == "U" else cmap(2 * MB_PAIRS[mb % len(MB_PAIRS)] + (op in "FW"))
            x, w = (cstart - t0) * 1e3, (end - cstart) * 1e3
            ax.barh(rank, w, left=x, height=0.8, color=color, edgecolor="black", linewidth=0.4,
                    hatch={"I": "//", "W": ".."}.get(op))
            if w > 0:
                ax.text(x + w / 2, rank, name, ha="center", va="center", fontsize=6, clip_on=True)
    ax.set_yticks(range(len(per_rank)), [f"rank {r}" for r in range(len(per_rank))])
    ax.invert_yaxis()


def write_run_timeline(run, job_dir: str, actions: dict, measured: list[dict], summary: dict, prediction,
                       wandb_run, comm: Optional[dict] = None) -> None:  # comm: step -> per-rank spans
    """A pipeline run's trace.json (the kept steps, `kept_steps`), predicted_trace.json (the
    simulator's replay of this run's own durations, when there is one: a replay, though the
    file keeps its name) and timeline.png (of the kept measured steps, the one with the
    median step time); both to W&B when it logs. `measured`: the rows after
    warm-up. Sets summary["timeline_step"]."""
    import os

    from framework.metrics.replay import timeline_records

    write_trace(actions, os.path.join(job_dir, "trace.json"), comm)
    measured = [r for r in measured if r["step"] in actions]
    median_row = sorted(measured, key=lambda r: r["step_time_s"])[len(measured) // 2]
    chosen = median_row["step"]
    png = os.path.join(job_dir, "timeline.png")
    title = (f"{run.schedule.name}, pp={run.parallelism.pp}, m={run.schedule.microbatches}, "
             f"v={run.schedule.virtual_stages}: step {chosen} (median step time of {len(measured)}) | bubble "
             f"measured {median_row['bubble_fraction']:.3f}, "
             f"{analytic_label(summary.get('bubble_analytic_source', CLOSED_FORM))} "
             f"{median_row['bubble_fraction_analytic']:.3f} (at its op times)")
    predicted = None if prediction is None else timeline_records(prediction)
    if predicted is not None:
        write_trace({chosen: predicted}, os.path.join(job_dir, "predicted_trace.json"))
    render_timeline(actions[chosen], png, title, predicted, comm=(comm or {}).get(chosen), predicted_title=(
                    f"replay of this run (the simulator at its own mean durations): step "
                    f"{summary.get('predicted_step_time_s', 0) * 1e3:.1f} ms vs measured median "
                    f"{summary['step_time_s'] * 1e3:.1f} ms ({summary.get('predicted_step_time_error', 0):+.1%}) | "
                    f"bubble {summary.get('predicted_bubble_fraction', 0):.3f} vs {summary['bubble_fraction']:.3f}"))
    summary["timeline_step"] = chosen
    if wandb_run is not None:
        import wandb

        rows = [[rank, step, a, s, cs - s, e - cs] for step, per in actions.items()
                for rank, recs in enumerate(per) for a, s, cs, e in recs]
        wandb_run.log({"timeline": wandb.Image(png), "actions": wandb.Table(
            columns=["rank", "step", "action", "start_unix_s", "wait_s", "compute_s"], data=rows)})
