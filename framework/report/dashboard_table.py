"""The dashboard's table of jobs (framework/report/dashboard.py draws the page): every job
with its numbers in readable units; numbers never wrap, the text columns (overrides,
layout, noisy, reason) wrap anywhere, so the table fits the page (report.html checks it:
dashboard_checks.py). Memory twice, said which: the process's peak RSS and the tensors the
layout needs. A job without a pipeline has n/a for the bubble."""

from __future__ import annotations

import html

from framework.schedules import SCHEDULE_MODEL
from framework.report.dashboard_compare import tensor_memory
from framework.report.dashboard_parts import Job, fmt_bytes, fmt_number, fmt_percent


def common_overrides(rows: list[dict]) -> list[str]:
    """The overrides every job of the sweep shares (said once, above the table)."""
    sets = [(r.get("overrides") or "").split() for r in rows]
    if len(sets) < 2:
        return []
    return [o for o in sets[0] if all(o in s for s in sets[1:])]


TABLE = (("job", "job", str), ("own_overrides", "overrides (beyond the common ones)", str), ("status", "status", str),
         ("layout", "layout", str), ("global_batch", "global batch", fmt_number),
         ("tokens_per_step", "tokens per step", fmt_number), ("model_params", "params", "{:,}".format),
         ("loss", "loss", fmt_number),
         ("val_loss", "val_loss", fmt_number), ("tokens_per_s", "tokens/s", fmt_number), ("mfu", "MFU", fmt_percent),
         ("bubble_fraction", "bubble (measured)", fmt_percent),
         ("bubble_schedule", "bubble (the schedule's: closed form, or schedule model)", str),
         ("memory_peak_bytes", "peak RSS (process memory, max over ranks)", fmt_bytes),
         ("tensor_memory", "tensors (model states + activation peak, fullest rank)", fmt_bytes),
         ("noisy", "noisy", str), ("reason", "reason", str))


def table_html(rows: list[dict], jobs: list[Job]) -> str:
    summaries = {j.row["job"]: j.summary for j in jobs}
    common = common_overrides(rows)
    head = "".join(f"<th>{html.escape(title)}</th>" for _, title, _ in TABLE)
    body = []
    for row in rows:
        own = " ".join(o for o in (row.get("overrides") or "").split() if o not in common)
        values = {**row, **summaries.get(row["job"], {}), "own_overrides": own}
        job = next((j for j in jobs if j.row["job"] == row["job"]), None)
        values["tensor_memory"] = tensor_memory(job) if job is not None else None
        if (values.get("pp") or 1) == 1 and job is not None:  # no pipeline: no bubble to speak of
            values["bubble_fraction"] = values["bubble_fraction_analytic"] = None
            values["bubble_schedule"] = "n/a"
        if values.get("bubble_fraction_analytic") is not None:
            values["bubble_schedule"] = fmt_percent(values["bubble_fraction_analytic"]) + (
                " (schedule model)" if values.get("bubble_analytic_source") == SCHEDULE_MODEL else "")
        cells = "".join(f"<td{TEXT_CLASS if key in TEXT_COLUMNS else ''}>{html.escape(_cell(values, key, fmt))}</td>"
                        for key, _, fmt in TABLE)
        body.append(f'<tr class="status-{html.escape(str(row.get("status")))}">{cells}</tr>')
    return f'<table id="jobs"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'


TEXT_COLUMNS = ("own_overrides", "layout", "noisy", "reason")  # wrapped anywhere: the numbers stay whole
TEXT_CLASS = ' class="text"'


def _cell(values: dict, key: str, fmt) -> str:
    if key == "bubble_fraction" and values.get("bubble_schedule") == "n/a":
        return "n/a"
    return fmt(values[key]) if values.get(key) is not None else ""
