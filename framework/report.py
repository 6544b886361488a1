"""Compare the runs of a sweep: `python -m framework.report <sweep dir>`.

One row per job of the sweep: its command-line overrides, its status, its summary metrics
and, for a job that did not complete, the reason. Prints the table and writes it as
report.csv and report.md in the sweep directory. Status comes from the job's summary.json:
`completed`, `failed` (a rank failed or hung; error.txt / hang.txt hold the report),
`rejected` (a config error, before any rank started) or `interrupted` (Ctrl-C, SIGTERM).
A job directory without summary.json is `incomplete` (the job is running, or its process
was killed). A job of a basic sweep (multirun.yaml) that has no directory is `not run`.
Earlier runs set aside in `.previous/` (framework.job) are not jobs of this sweep.
"""

from __future__ import annotations

import csv
import json
import os
import sys
from pathlib import Path

import yaml

METRICS = ("loss", "tokens_per_s", "step_time_s", "mfu", "memory_peak_bytes", "bubble_fraction",
           "bubble_fraction_analytic", "world_size")
COLUMNS = ("job", "overrides", "status") + METRICS + ("reason",)
MARKERS = ("config.yaml", "summary.json", ".hydra/overrides.yaml")


def _job_dirs(sweep: Path) -> list[Path]:
    dirs = set()
    for marker in MARKERS:
        for p in sweep.rglob(marker):
            job = p.parent.parent if marker.startswith(".hydra") else p.parent
            rel = job.relative_to(sweep).parts
            if not any(part.startswith(".") or part == "wandb" for part in rel):  # .hydra, .previous, W&B's files
                dirs.add(job)
    return sorted(dirs, key=lambda p: (len(p.parts), int(p.name) if p.name.isdigit() else 0, str(p)))


def planned_jobs(sweep: Path) -> list[str]:
    """The overrides of every job a basic-sweeper multirun planned (from multirun.yaml), in
    job-number order; [] for other sweepers (their trials are decided while they run)."""
    f = sweep / "multirun.yaml"
    if not f.exists():
        return []
    hydra = (yaml.safe_load(f.read_text()) or {}).get("hydra", {})
    if not str(hydra.get("sweeper", {}).get("_target_", "")).endswith("BasicSweeper") \
            or str(hydra.get("sweep", {}).get("subdir")) != "${hydra.job.num}":
        return []  # other sweepers decide trials as they go; other subdirs are not job numbers
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    # As BasicSweeper builds them: its params first, then the command line's overrides.
    task = [f"{k}={v}" for k, v in (hydra.get("sweeper", {}).get("params") or {}).items()]
    task += list(hydra.get("overrides", {}).get("task", []))
    try:
        batches = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(task), None)
    except Exception:  # noqa: BLE001 - e.g. glob() sweeps need Hydra's config loader: no planned list
        return []
    return [" ".join(o for o in job if not o.startswith("hydra")) for batch in batches for job in batch]


def _overrides(job: Path) -> str:
    f = job / ".hydra" / "overrides.yaml"
    if not f.exists():
        return ""
    return " ".join(o for o in (yaml.safe_load(f.read_text()) or []) if not o.startswith("hydra"))


def _row(sweep: Path, job: Path) -> dict:
    row = {"job": str(job.relative_to(sweep)) or ".", "overrides": _overrides(job)}
    try:
        s = json.loads((job / "summary.json").read_text())
    except FileNotFoundError:
        return {**row, "status": "incomplete", "reason": "no summary.json: running, or its process was killed"}
    except (OSError, ValueError) as e:
        return {**row, "status": "incomplete", "reason": f"summary.json unreadable ({e})"}
    row.update(status=s.get("status", "completed"), reason=s.get("reason"), **{k: s.get(k) for k in METRICS})
    return row


def collect(sweep: Path) -> list[dict]:
    rows = [_row(sweep, job) for job in _job_dirs(sweep)]
    seen = {r["job"] for r in rows}
    for num, overrides in enumerate(planned_jobs(sweep)):
        if str(num) not in seen:
            rows.append({"job": str(num), "overrides": overrides, "status": "not run",
                         "reason": "no job directory: the sweep stopped before this job"})
    return sorted(rows, key=lambda r: (int(r["job"]) if r["job"].isdigit() else -1, r["job"]))


def _fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def markdown(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def write(rows: list[dict], sweep: Path) -> None:
    with open(sweep / "report.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows({c: r.get(c) for c in COLUMNS} for r in rows)
    (sweep / "report.md").write_text(markdown(rows))


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not os.path.isdir(argv[0]):
        print("usage: python -m framework.report <sweep dir>", file=sys.stderr)
        return 2
    sweep = Path(argv[0])
    rows = collect(sweep)
    if not rows:
        print(f"no job directories (with config.yaml) under {sweep}", file=sys.stderr)
        return 1
    print(markdown(rows), end="")
    write(rows, sweep)
    print(f"wrote {sweep / 'report.csv'} and {sweep / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
