"""The schedule a run asks for: `resolve(run.schedule)`.

- `schedule.modules`: Python files (or importable module names) that define and `register`
  schedules of their own; imported once per process (the launching process validates with
  them, every rank imports them again before it builds its pipeline), so a researcher's
  schedule is one file outside the framework.
- `schedule.name=csv` with `schedule.csv=<path>`: the file's schedule (csv_format.py), read
  once per process and path.
- anything else: the registry's, configured by the schedule's own keys where it has
  them (`Schedule.configure`: zb-auto's memory limit and op times).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import Optional

from framework.schedules.base import REGISTRY, Schedule, get
from framework.schedules.csv_format import load_csv

CSV = "csv"  # the name that reads schedule.csv instead of the registry
_csv_cache: dict[tuple, tuple] = {}


def load_modules(modules) -> None:
    """Import each schedule module once; a file already imported (e.g. a test module that
    defines a schedule) is not imported a second time."""
    for name in modules or ():
        if name.endswith(".py") or os.sep in name:
            path = os.path.abspath(name)
            if any(getattr(m, "__file__", None) == path for m in list(sys.modules.values())):
                continue
            spec = importlib.util.spec_from_file_location(f"schedule_module_{abs(hash(path))}", path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
        else:
            importlib.import_module(name)


def csv_schedule(path: str, microbatches: Optional[int] = None) -> tuple[Schedule, dict]:
    """The CSV file's schedule and where each action was written (cached by path and mtime).
    `microbatches`: the run's, a bound on the file's micro-batch indices while reading it (a
    file read before is the same file: its sizes are compared with the run's by the caller)."""
    key = (os.path.abspath(path), os.path.getmtime(path) if os.path.exists(path) else None)
    if key not in _csv_cache:
        _csv_cache[key] = load_csv(path, microbatches)
    return _csv_cache[key]


def never_flushes(cfg) -> bool:
    """An asynchronous schedule (one that is registered; a file is flushing by format)."""
    load_modules(getattr(cfg, "modules", None))
    return cfg.name in REGISTRY and not REGISTRY[cfg.name].flushes


def resolve(cfg) -> Schedule:
    """The Schedule for a ScheduleConfig (name, csv, modules)."""
    load_modules(getattr(cfg, "modules", None))
    if cfg.name == CSV:
        return csv_schedule(cfg.csv)[0]
    s = get(cfg.name)
    return s.configure(cfg) if s.configure is not None else s
