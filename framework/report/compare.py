"""Compare the runs of a sweep: `python -m framework.report <sweep dir>`.

One row per job of the sweep: its command-line overrides, its status, its summary metrics
and, for a job that did not complete, the reason. Prints the table and writes it as
report.csv and report.md in the sweep directory. Status comes from the job's summary.json:
`completed`, `failed` (a rank failed or hung; error.txt / hang.txt hold the report),
`rejected` (a config error, before any rank started) or `interrupted` (Ctrl-C, SIGTERM).
A job directory without summary.json is `incomplete` (the job is running, or its process
was killed). A job of a basic sweep (multirun.yaml) that has no directory is `not run`. A
summary.json that is not JSON, or whose fields the report reads have other types, is no
result: one warning line names the file and the job is left out of the table (when no job
is left, the command fails with one line).
Earlier runs set aside in `.previous/` (framework.launch.job) are not jobs of this sweep.

A fair comparison of layouts holds the work per step and the model fixed: the report warns
when the completed jobs differ in global batch or tokens per step (set
trainer.global_batch_size, and each layout derives its micro-batches), in any key of the
`model` group of their config.yaml, or in their parameter count (`model_params` in
summary.json; a tied embedding counts once), and names each job whose measurement was
noisy (summary.json's `noisy`: its step-time spread or the machine's load; metrics/noise.py). When the jobs share an objective, the best
completed job is named (max for tokens_per_s and mfu, min for the others), unless the
objective is a speed and a job was measured with noise: then the jobs are ranked and the line
says why no winner is named. A sweep with repeats names a configuration instead
(framework/report/repeats.py `verdict`). report.html is the
comparison dashboard (framework.report.dashboard): plots of every job, one self-contained page.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path
from typing import Optional

import yaml

from framework.commands import Directory, Parser, command, reject
from framework.report import repeats, simulated
from framework.report.fairness import LOSS_RTOL, fairness_warnings, same_loss  # noqa: F401 (tests import them here)
from framework.report.winner import baseline, best, best_line  # noqa: F401 (tests import them here)

METRICS = ("loss", "tokens_per_s", "step_time_s", "step_time_p10_s", "step_time_p90_s", "step_time_cv",
           "other_cpu_share", "mfu", "memory_peak_bytes", "bubble_fraction", "bubble_fraction_analytic", "world_size",
           "global_batch", "tokens_per_step")
COLUMNS = ("job", "overrides", "status") + METRICS + ("noisy", "reason")
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
    try:
        hydra = (yaml.safe_load(f.read_text()) or {}).get("hydra", {})
    except (OSError, yaml.YAMLError, AttributeError):
        return []  # a truncated multirun.yaml: the jobs on disk are still reported
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
    try:
        overrides = yaml.safe_load(f.read_text()) or []
    except (OSError, yaml.YAMLError):
        return "(.hydra/overrides.yaml unreadable)"  # one job's broken file must not hide the others
    return " ".join(str(o) for o in overrides if not str(o).startswith("hydra"))


STATUSES = ("completed", "failed", "rejected", "interrupted")  # what a job writes (framework.launch.jobdir)
UNREADABLE = "unreadable"  # a summary.json that is not JSON, or whose fields have other types: not in the table
# summary.json's fields the report and its dashboard read, by type (None: not measured)
NUMBERS = (*METRICS, "model_params", "cpu_threads_per_rank", "val_loss", "measured_steps", "timeline_step", "predicted_step_time_s",
           "predicted_bubble_fraction", "predicted_step_time_error")
TEXTS = ("reason", "bubble_analytic_source", "layout", "schedule", "noisy")


def read_summary(path: Path) -> dict:
    """A job's summary.json; ValueError saying what is wrong when it is not JSON, not an
    object, or a field the report reads has another type (a status "completed" beside
    tokens_per_s "abc" is no result)."""
    try:
        s = json.loads(path.read_text())
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError (bytes that are no text)
        raise ValueError(f"not JSON: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    if not isinstance(s, dict):
        raise ValueError(f"a JSON {type(s).__name__}, not an object")
    if s.get("status", "completed") not in STATUSES:
        raise ValueError(f"status {s['status']!r} is none of {', '.join(STATUSES)}")
    for key in NUMBERS:
        if not _number(s.get(key)):
            raise ValueError(f"{key} is {s[key]!r}, not a number")
    for key in TEXTS:
        if s.get(key) is not None and not isinstance(s[key], str):
            raise ValueError(f"{key} is {s[key]!r}, not a string")
    ranks = s.get("ranks", [])  # the dashboard's memory plot: each rank's position and bytes
    if not isinstance(ranks, list) or not all(isinstance(r, dict) and all(
            _number(v) for k, v in r.items() if k in ("rank", "pp", "dp", "tp") or k.endswith("_bytes")) for r in ranks):
        raise ValueError("ranks is not a list of objects whose rank, pp, dp, tp and *_bytes are numbers")
    return s


def _number(v) -> bool:
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))


def _row(sweep: Path, job: Path) -> dict:
    row = {"job": str(job.relative_to(sweep)) or ".", "overrides": _overrides(job)}
    try:
        s = read_summary(job / "summary.json")
    except FileNotFoundError:
        return {**row, "status": "incomplete", "reason": "no summary.json: running, or its process was killed"}
    except (OSError, ValueError) as e:
        return {**row, "status": UNREADABLE, "reason": f"{job / 'summary.json'} is unreadable "
                f"({e.strerror if isinstance(e, OSError) else e})"}
    row.update(status=s.get("status", "completed"), reason=s.get("reason"), **{k: s.get(k) for k in METRICS}, noisy=s.get("noisy"),
               model_params=s.get("model_params"), model_config=_group(job, "model"),
               cpu_threads_per_rank=s.get("cpu_threads_per_rank"),
               micro_batch_size=(_group(job, "trainer") or {}).get("micro_batch_size"))
    return row


def _group(job: Path, name: str) -> Optional[dict]:
    """One group of the job's resolved config.yaml (None when it has none)."""
    try:
        group = (yaml.safe_load((job / "config.yaml").read_text()) or {}).get(name)
    except (OSError, yaml.YAMLError, AttributeError):
        return None
    return group if isinstance(group, dict) else None


def collect(sweep: Path) -> list[dict]:
    rows = [_row(sweep, job) for job in _job_dirs(sweep)]
    seen = {r["job"] for r in rows}
    for num, overrides in enumerate(planned_jobs(sweep)):
        if str(num) not in seen:
            rows.append({"job": str(num), "overrides": overrides, "status": "not run",
                         "reason": "no job directory: the sweep stopped before this job"})
    rows = simulated.merge(sweep, rows)  # search.mode=simulate: "predicted only" and the predicted columns
    return sorted(rows, key=lambda r: (int(r["job"]) if r["job"].isdigit() else -1, r["job"]))


def _fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def columns(rows: list[dict]) -> tuple:
    """The table's columns: a simulate sweep's add the predicted ones (report/simulated.py)."""
    return COLUMNS + (simulated.COLUMNS if any(r.get("predicted_rank") is not None for r in rows) else ()) \
        + (("speedup",) if any("speedup" in r for r in rows) else ())


def markdown(rows: list[dict]) -> str:
    cols = columns(rows)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def write(rows: list[dict], sweep: Path, notes: list[str] = ()) -> None:
    with open(sweep / "report.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns(rows))
        w.writeheader()
        w.writerows({c: r.get(c) for c in columns(rows)} for r in rows)
    (sweep / "report.md").write_text("".join(f"{n}\n\n" for n in notes) + markdown(rows))


def headline(sweep: Path, rows: list[dict]) -> list[str]:
    """Lines above the table: fairness warnings, then the best job."""
    lines = simulated.lines(sweep) + fairness_warnings(rows)
    done = [r for r in rows if r.get("status") == "completed"]
    agree = same_loss(done)
    if agree:
        lines.append(f"every job reaches the same loss ({agree[0]:.6g}, within {agree[1]:.1e} relative; the "
                     f"layouts' tolerance {LOSS_RTOL:g}): what differs is speed, ranked by tokens_per_s")
    with_repeats = repeats.lines(sweep, done)  # sweep.repeats: its verdict names a configuration, not a job
    lines += with_repeats
    found = None if with_repeats else best(sweep, rows)
    if found:
        lines.append(best_line(done, *found))
    return lines


WHICH = "give a sweep directory (hydra.sweep.dir, e.g. multirun/<date>/<time>) or one job's directory"


def parser() -> Parser:
    p = Parser(prog="python -m framework.report", description=__doc__.split("\n\n")[0])
    p.add_argument("sweep_dir", type=Directory(WHICH), help="a sweep's directory (hydra.sweep.dir) or one job's")
    p.add_argument("--baseline", metavar="JOB", help="report.baseline=<job> works too: every job's speed-up "
                   "against this one (its tokens/s over the baseline's)")
    return p


@command
def main(argv: list[str]) -> int:
    """Bad arguments (none or several, a missing path, a file, a directory without readable
    jobs) are one `config error:` line and exit 2; a summary.json that cannot be read is
    one warning line and left out of the table; an unwritable report one line and exit 1."""
    key = "report.baseline" if any(a.startswith("report.baseline=") for a in argv) else "--baseline"  # as given
    argv = [a for b in argv for a in (["--baseline", b.split("=", 1)[1]] if b.startswith("report.baseline=") else [b])]
    args = parser().parse_args(argv)
    sweep = Path(args.sweep_dir)
    try:
        rows = collect(sweep)
        if not rows:
            reject("sweep_dir", str(sweep), "has no job directories (config.yaml, summary.json or .hydra/) under it",
                   WHICH)
        bad = [r for r in rows if r["status"] == UNREADABLE]
        rows = [r for r in rows if r["status"] != UNREADABLE]
        if not rows:
            reject("sweep_dir", str(sweep), f"none of its {len(bad)} summary.json files is readable "
                   f"({bad[0]['reason']})", "give the directory of a sweep this framework wrote")
        notes = [f"WARNING: {r['reason']}: job {r['job']} is left out of the table" for r in bad]
        notes += (baseline(rows, args.baseline, key) if args.baseline is not None else []) + headline(sweep, rows)
        print("\n".join([*notes, ""]) if notes else "", end="")
        print(markdown(rows), end="")
        write(rows, sweep, notes)
        from framework.report.dashboard import write_dashboard  # plotly: only when a page is written

        page = write_dashboard(sweep, rows, notes)
    except OSError as e:  # a read-only sweep directory, a full disk
        print(f"error: {sweep}: {e.strerror or e}: {e.filename}. Fix: make the sweep directory writable",
              file=sys.stderr)
        return 1
    print(f"wrote {sweep / 'report.csv'}, {sweep / 'report.md'} and {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
