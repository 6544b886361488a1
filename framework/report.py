"""Compare the runs of a sweep: `python -m framework.report <sweep dir>`.

One row per job directory (a Hydra multirun subdirectory, or any folder holding a
config.yaml): its command-line overrides, its status and its summary metrics. Prints the
table and writes it as report.csv and report.md in the sweep directory. A job without
summary.json did not complete: it shows as `failed` (error.txt present) or `incomplete`.
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
COLUMNS = ("job", "overrides", "status") + METRICS


def _job_dirs(sweep: Path) -> list[Path]:
    dirs = [p.parent for p in sweep.rglob("config.yaml") if p.parent.name != ".hydra"]
    return sorted(set(dirs), key=lambda p: (len(p.parts), int(p.name) if p.name.isdigit() else 0, str(p)))


def _overrides(job: Path) -> str:
    f = job / ".hydra" / "overrides.yaml"
    if not f.exists():
        return ""
    return " ".join(o for o in (yaml.safe_load(f.read_text()) or []) if not o.startswith("hydra"))


def collect(sweep: Path) -> list[dict]:
    rows = []
    for job in _job_dirs(sweep):
        row = {"job": str(job.relative_to(sweep)) or ".", "overrides": _overrides(job)}
        summary = job / "summary.json"
        if summary.exists():
            s = json.loads(summary.read_text())
            row.update(status="completed", **{k: s.get(k) for k in METRICS})
        else:
            row["status"] = "failed" if (job / "error.txt").exists() else "incomplete"
        rows.append(row)
    return rows


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
