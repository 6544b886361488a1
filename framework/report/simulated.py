"""The report of a `search.mode=simulate` sweep (framework/sim/sweep.py): its
`simulated_search.json` read beside the jobs.

Every candidate was predicted from `sim.from`; only the best `search.top_k` ran. A candidate
that did not run has its config.yaml and prediction.json but no summary.json: the report
lists it as `predicted only` (not `incomplete`, which means a job still running or killed).
Every candidate row gets the predicted columns (`predicted_rank`, tokens/s as the total of
the layout's ranks, `predicted_tokens_per_s_cluster`, and per rank,
`predicted_tokens_per_s_per_gpu`, `predicted_step_time_s`) and its `tokens_per_step`, so
the fairness warnings cover predicted candidates too; a run candidate also has its measured
columns and `step_time_error` (predicted / measured - 1). Above the table: how far the
source run's own replay was from its measurement (its summary.json's
`predicted_step_time_error`), since every prediction inherits that error, with a warning
past `SOURCE_ERROR`. A cluster's sweep (`hardware=...`: the cost model, no source run) says
so instead, with how many candidates fit; a candidate that does not fit has no predicted
speed (empty) and its `reason` ("out of memory: ...").
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

RESULT = "simulated_search.json"  # framework/sim/sweep.py's RESULT (not imported: the report stays light)
PREDICTED_ONLY = "predicted only"
COLUMNS = ("predicted_rank", "predicted_tokens_per_s_cluster", "predicted_tokens_per_s_per_gpu",
           "predicted_step_time_s", "step_time_error")
SOURCE_ERROR = 0.10  # the source's replay off its own measurement by more than this: warned


def _table(sweep: Path) -> Optional[list]:
    try:
        rows = json.loads((sweep / RESULT).read_text())
    except (OSError, ValueError):
        return None
    return rows if isinstance(rows, list) and all(isinstance(r, dict) for r in rows) else None


def merge(sweep: Path, rows: list[dict]) -> list[dict]:
    """The report's rows with each candidate's prediction (module docstring); unchanged
    without a readable simulated_search.json."""
    table = _table(sweep)
    if table is None:
        return rows
    by_job = {}
    for entry in table:
        try:
            by_job[str(Path(entry["job_dir"]).resolve().relative_to(sweep.resolve()))] = entry
        except (KeyError, TypeError, ValueError):
            continue
    for row in rows:
        entry = by_job.get(row["job"])
        if entry is None:
            continue
        row.update({k: entry.get(k) for k in COLUMNS})
        # the older name of the cluster's total, which the report also reads to know a simulate sweep
        row["predicted_tokens_per_s"] = entry.get("predicted_tokens_per_s")
        if row.get("tokens_per_step") is None:
            row["tokens_per_step"] = entry.get("tokens_per_step")
        if row["status"] == "incomplete" and not entry.get("launched"):
            row.update(status=PREDICTED_ONLY, reason=entry.get("reason"))  # out of memory: why it has no speed
    return rows


def lines(sweep: Path) -> list[str]:
    """The source run's own replay error, above the table (a warning past SOURCE_ERROR)."""
    table = _table(sweep)
    if not table:
        return []
    if "hardware" in table[0]:  # a cluster's: priced by the cost model, not replayed from a run
        fit = sum(1 for r in table if r.get("fits"))
        return [f"search.mode=simulate: {len(table)} candidates priced by the cost model on {table[0]['hardware']} "
                f"({fit} fit in memory, {len(table) - fit} do not; none run: the cluster is not here)"]
    source = table[0].get("source")
    try:
        error = json.loads((Path(source) / "summary.json").read_text()).get("predicted_step_time_error")
    except (OSError, ValueError, TypeError):
        error = None
    if not isinstance(error, (int, float)):
        return [f"search.mode=simulate: {len(table)} candidates predicted from {source} (its own replay error is "
                "unknown: no predicted_step_time_error in its summary.json)"]
    out = [f"search.mode=simulate: {len(table)} candidates predicted from {source}, whose own replay was "
           f"{error:+.1%} off its measured step time"]
    if abs(error) > SOURCE_ERROR:
        out.append(f"WARNING: the source run's replay is {error:+.0%} off its own measurement (was it measured "
                   "under load? see its summary.json's noisy): every prediction here inherits that. Fix: rerun "
                   "the source job on a quiet machine and search again")
    return out
