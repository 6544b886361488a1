"""The job's closing console lines: the summary's medians, the measured and analytic bubble,
and each rank's memory beside its formulas (printed by the launcher, framework.launch.job
and framework.launch.node)."""

from __future__ import annotations

from typing import Optional

from framework.metrics.breakdown import PARTS
from framework.comm.comm_timer import DIMS
from framework.metrics.moe import line as moe_line
from framework.metrics.model_states import paper_form
from framework.metrics.noise import line as noise_line
from framework.metrics.bubble import analytic_label
from framework.schedules import CLOSED_FORM


def summary_lines(summary: dict) -> str:
    lines = [f"loss {summary['loss_first']:.4f} -> {summary['loss']:.4f} | {summary['tokens_per_s']:,.0f} tokens/s "
             f"| {summary['step_time_s'] * 1e3:.1f} ms/step | mfu {_percent(summary['mfu'])} "
             f"(medians over {summary['measured_steps']} step{'s' * (summary['measured_steps'] != 1)} after "
             f"{summary['steps'] - summary['first_step'] + 1 - summary['measured_steps']} warm-up)"]
    if summary.get("step_time_p10_s") is not None:
        lines += noise_line(summary)
    if summary.get("moe_dropped_fraction") is not None:
        lines.append(moe_line(summary))
    if summary.get("pp", 1) > 1:
        ops = ", ".join(f"T_{op} {t * 1e3:.2f} ms" for op, t in summary.get("op_time_s", {}).items())
        lines.append(f"bubble {summary['bubble_fraction']:.3f} measured "
                     f"(max rank {summary['bubble_fraction_max']:.3f}) | "
                     f"{summary['bubble_fraction_analytic']:.3f} "
                     f"{analytic_label(summary.get('bubble_analytic_source', CLOSED_FORM))} "
                     f"({summary['schedule']} at the measured op "
                     f"times: {ops or 'none'})")
    if summary.get("time_compute_s") is not None:
        lines.append(breakdown_line(summary))
    if summary.get("predicted_time_compute_s") is not None:
        lines.append(replay_breakdown_line(summary))
    for r in summary["ranks"]:
        cp = f", cp {r['cp']}" if "cp" in r else ""
        lines.append(f"  rank {r['rank']} (pp {r['pp']}, dp {r['dp']}{cp}, tp {r['tp']}): params {r['params_bytes'] / 2**20:.1f} MiB"
                     f" | grads {r['grads_bytes'] / 2**20:.1f} MiB | master {r['master_bytes'] / 2**20:.1f} MiB"
                     f" | optimizer {r['optimizer_bytes'] / 2**20:.1f} MiB"
                     f" | activations peak {r['activation_peak_bytes'] / 2**20:.1f} MiB | RSS peak {r['rss_peak_bytes'] / 2**20:.0f} MiB")
        lines.append(f"    model states {r['model_state_bytes']:,} B measured | {r['model_state_formula_bytes']:,} B "
                     f"this configuration's formula | {r['model_state_formula_paper_bytes']:,.0f} B the ZeRO paper's "
                     f"{paper_form(summary.get('precision', ''))} form")
    return "\n".join(lines)


def breakdown_line(summary: dict) -> str:
    """`where the step goes: compute 61% | comm tp 22% | ...`: the step-time breakdown's medians
    (framework/metrics/breakdown.py) as shares of their sum, the parts above 0.5 %."""
    parts = {k[5:-2].replace("comm_", "comm "): v for k, v in summary.items()
             if k.startswith("time_") and k.endswith("_s") and k[5:-2] in PARTS}
    total = sum(parts.values())
    shown = [f"{k} {v / total:.0%}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1])
             if total and v / total >= 0.005]
    hidden = [f"{d} {summary[f'comm_hidden_{d}']:.0%}" for d in DIMS if summary.get(f"comm_hidden_{d}", 0) >= 0.005]
    # an overlap whose calls' completion this device does not show (CUDA) hid an unmeasured part
    unseen = summary.get("comm_hidden_unseen_calls") or 0
    return (f"where the step goes (mean over ranks, medians): {' | '.join(shown) or 'n/a'}"
            + (f"; communication hidden by overlap: {', '.join(hidden)}" if hidden else "")
            + (f"; hidden by overlap not measured for {unseen:g} overlapped calls a step (their completion "
               f"is not visible on this device: comm_hidden counts their wait as exposed)" if unseen else ""))


# (label, the replay's part, the measured parts it compares with): framework/metrics/replay.py
REPLAYED = (("compute", "compute", ("compute",)), ("comm tp/ep/cp", "comm_inside", ("comm_tp", "comm_ep", "comm_cp")),
            ("comm pp", "comm_pp", ("comm_pp",)), ("bubble", "bubble", ("bubble",)))


def replay_breakdown_line(summary: dict) -> str:
    """`replay's breakdown, ms predicted / measured: compute 410 / 402 | ...`: the simulator's
    replay of the run's own durations, cut as the measured step is, beside the measurement."""
    shown = []
    for label, part, parts in REPLAYED:
        measured = sum(summary.get(f"time_{p}_s", 0.0) for p in parts)
        shown.append(f"{label} {summary[f'predicted_time_{part}_s'] * 1e3:.1f} / {measured * 1e3:.1f}")
    return f"replay's breakdown, ms per step predicted / measured (mean over ranks): {' | '.join(shown)}"


def _percent(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{x:.2%}"


