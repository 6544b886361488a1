"""Pipeline schedules as data: the registry (`base.py`) and one module per schedule family.

A schedule maps (pp, microbatches, virtual_stages) to each pipeline rank's ordered list of
`Action`s (`F3`, `1I3`, `W3`, `B3`, `U7`); asynchronous schedules give a whole run's list.
Importing this package registers every built-in schedule; `get(name)` returns what one
declares (placement, ops, constraints, bubble and its source, memory bound, update rule);
`resolve(run.schedule)` also reads `schedule.modules` (schedules defined outside) and
`schedule=csv schedule.csv=<file>` (torch's CSV format).

Beside the lists, what follows from them alone, so that the schema, the metrics, the
simulator and the executor all read one model (this package imports nothing of the
framework but `commands`, and sits under config in docs/code-map.md's order):
- messages.py  which action needs and produces which activation / gradient
- p2p.py       the p2p plan: each rank's sends and receives, placed and grouped (`comm_plan`)
- clock.py     unit-time and calibrated clocks: the dry run's grid, the bubble, `predict`
- matching.py, check.py  the NCCL model (one ordered stream per communicator, in-order
               matching) and the proof of every list under it (`check`, `nccl_simulate`)
- tiling.py    a plan's p2p ops tiled into NCCL-safe groups
- cli.py       `python -m framework.schedules list | dump | grid` (__main__.py)
"""

from framework.schedules.base import (CLOSED_FORM, REGISTRY, SCHEDULE_MODEL, Action, AsyncRule, Op, OpTimes, Schedule, StageMap, Violation, build_schedule, get,
                   modelled, names, register, unregister)
from framework.schedules import classic, pipedream, zero_bubble, interleaved_zb, zbv, dualpipev, zb_auto  # noqa: F401  (they register)
from framework.schedules.csv_format import CsvError, dump_csv, load_csv
from framework.schedules.loading import CSV, csv_schedule, load_modules, never_flushes, resolve

__all__ = ["CLOSED_FORM", "SCHEDULE_MODEL", "modelled", "REGISTRY", "Action", "AsyncRule", "Op", "OpTimes", "Schedule", "StageMap", "Violation",
           "build_schedule", "get", "names", "register", "unregister", "CsvError", "dump_csv", "load_csv", "CSV",
           "csv_schedule", "load_modules", "never_flushes", "resolve"]
