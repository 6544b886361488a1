"""Pipeline schedules as data: the registry (`base.py`) and one module per schedule family.

A schedule maps (pp, microbatches, virtual_stages) to each pipeline rank's ordered list of
`Action`s (`F3`, `1I3`, `W3`, `B3`, `U7`); asynchronous schedules give a whole run's list.
Importing this package registers every built-in schedule; `get(name)` returns what one
declares (placement, ops, constraints, bubble and its source, memory bound, update rule);
`resolve(run.schedule)` also reads `schedule.modules` (schedules defined outside) and
`schedule=csv schedule.csv=<file>` (torch's CSV format).
"""

from framework.parallel.pipeline.schedules.base import (CLOSED_FORM, REGISTRY, SCHEDULE_MODEL, Action, AsyncRule, Op, OpTimes, Schedule, StageMap, Violation, build_schedule, get,
                   modelled, names, register, unregister)
from framework.parallel.pipeline.schedules import classic, pipedream, zero_bubble, interleaved_zb, zbv, dualpipev, zb_auto  # noqa: F401  (they register)
from framework.parallel.pipeline.schedules.csv_format import CsvError, dump_csv, load_csv
from framework.parallel.pipeline.schedules.loading import CSV, csv_schedule, load_modules, never_flushes, resolve

__all__ = ["CLOSED_FORM", "SCHEDULE_MODEL", "modelled", "REGISTRY", "Action", "AsyncRule", "Op", "OpTimes", "Schedule", "StageMap", "Violation",
           "build_schedule", "get", "names", "register", "unregister", "CsvError", "dump_csv", "load_csv", "CSV",
           "csv_schedule", "load_modules", "never_flushes", "resolve"]
