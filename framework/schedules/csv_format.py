"""Schedules in torch's compute-only CSV format, both ways.

One row per pipeline rank, one cell per action in the rank's order, written as torch 2.13's
`_Action` prints it: `<global stage><op><micro-batch>` (`0F0`, `3I1`, `3W1`, `1B2`), an
empty cell for idle; DualPipeV's `(0F3;3B1)OVERLAP_F_B` pairs run here one after the
other. A compute-only file has no sends or receives: the framework derives them
(`p2p.comm_plan`), so communication cells (`SEND_F`, ...) are rejected. The placement is read
from which row holds which stage: Megatron's loop (stage g on rank g % p) or a V (rank r
holds stages r and 2p-1-r).

`load_csv` builds a `Schedule` named `csv` (not registered: it is the file's) that the
checker proves like every other; `dump_csv` writes any schedule so torch's
`_PipelineScheduleRuntime._load_csv` reads it back.

A file is read defensively, before anything is sized by it: at most `MAX_FILE_BYTES`, UTF-8,
at most `MAX_ROWS` rows, and every index below `MAX_INDEX` (and a micro-batch below the run's
`schedule.microbatches` where it is given), so a cell like `0F99999999999999999999` is an
error naming that cell, never a range of that length. Anything wrong is a `CsvError`.
"""

from __future__ import annotations

import csv
import io
import re
from typing import Optional

from framework.schedules.base import Action, Op, Schedule, StageMap, modelled

_CELL = re.compile(r"^(\d+)([FBIW])(\d+)$")
_PAIR = re.compile(r"^\((.*)\)OVERLAP_F_B$")
# Far above any schedule run (pp = 64, m = 1024, v = 2 with F, I and W is 400k cells in 3 MB),
# far below what a mistyped number would make the reader build.
MAX_FILE_BYTES = 4 << 20
MAX_ROWS = 1024  # pipeline ranks
MAX_INDEX = 100_000  # a stage or a micro-batch


class CsvError(ValueError):
    """What is wrong with a schedule file: the row (pipeline rank), the cell (1-based column)
    and the rule broken."""

    def __init__(self, path: str, row: Optional[int], cell: Optional[int], text: str, rule: str):
        where = f"row {row + 1} (pp rank {row})" if row is not None else "the file"
        where += f", cell {cell + 1} {_short(text)!r}" if cell is not None else ""
        super().__init__(f"{path}: {where}: {rule}")
        self.row, self.cell = row, cell


def _short(text: str, n: int = 40) -> str:
    return text if len(text) <= n else text[:n - 3] + "..."


def _cells(path: str, row: int, col: int, text: str, microbatches: Optional[int]) -> list[tuple[int, str, int]]:
    """A cell's actions as (stage, op, micro-batch), each index bounded (module docstring)."""
    pair = _PAIR.match(text)
    parts = pair.group(1).split(";") if pair else [text]
    out = []
    for part in parts:
        m = _CELL.match(part.strip())
        if m is None:
            raise CsvError(path, row, col, text, "not a compute action: write <stage><F|I|W|B><micro-batch> "
                           "(e.g. 0F0, 3I1) or (<F>;<B>)OVERLAP_F_B; sends and receives are the framework's")
        stage = _index(path, row, col, text, m.group(1), "stage", MAX_INDEX, "no pipeline has that many stages")
        mb = _index(path, row, col, text, m.group(3), "micro-batch", *(
            (MAX_INDEX, "no schedule runs that many") if microbatches is None else
            (microbatches, f"schedule.microbatches={microbatches} numbers them 0..{microbatches - 1}")))
        out.append((stage, m.group(2), mb))
    return out


def _index(path: str, row: int, col: int, text: str, digits: str, what: str, bound: int, why: str) -> int:
    """int(digits) when below `bound` (the digits are counted first: no huge int is built)."""
    if len(digits) > len(str(bound)) or int(digits) >= bound:
        raise CsvError(path, row, col, text, f"{what} {_short(digits, 12)} is out of range (at most {bound - 1}: "
                       f"{why})")
    return int(digits)


def _rows(path: str) -> list[list[str]]:
    """The file's rows, trailing blank ones dropped: at most MAX_FILE_BYTES of UTF-8 text in
    at most MAX_ROWS rows (an inner blank row is an idle rank)."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise CsvError(path, None, None, "", f"cannot be read ({e.strerror or e})") from None
    if len(data) > MAX_FILE_BYTES:
        raise CsvError(path, None, None, "", f"is over {MAX_FILE_BYTES >> 20} MiB: not a schedule (one row per "
                       "pipeline rank, one cell per action)")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CsvError(path, None, None, "", f"is not a text file (byte {e.start} is not UTF-8): a schedule is "
                       "a CSV of cells like 0F0") from None
    rows, blank = [], 0
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        for row in reader:
            if not any(c.strip() for c in row):
                blank += 1
                continue
            if len(rows) + blank >= MAX_ROWS:
                raise CsvError(path, None, None, "", f"has over {MAX_ROWS} rows: a schedule has one row per "
                               "pipeline rank")
            rows += [[] for _ in range(blank)] + [row]
            blank = 0
    except csv.Error as e:
        raise CsvError(path, None, None, "", f"is not a CSV file (line {reader.line_num}: {e})") from None
    return rows


def _placement(path: str, holder: dict[int, int], pp: int) -> StageMap:
    stages = sorted(holder)
    if stages != list(range(len(stages))) or len(stages) % pp:
        raise CsvError(path, None, None, "", f"the stages used are {stages}: expected 0..S-1 with S a multiple of "
                       f"the {pp} rows")
    v = len(stages) // pp
    for smap in (StageMap(pp, v, "loop"), StageMap(pp, v, "v")):
        if (smap.placement == "loop" or v == 2) and all(smap.rank(g) == r for g, r in holder.items()):
            return smap
    raise CsvError(path, None, None, "", f"stage -> row {holder} is neither a loop (stage g in row g % {pp}) "
                   "nor a V of 2 chunks (row r holds stages r and 2p-1-r)")


def read_csv(path: str, microbatches: Optional[int] = None) -> tuple[dict[int, list[Action]], StageMap, int, dict]:
    """(lists, placement, micro-batches, where) with where[(rank, action)] = (row, cell).
    `microbatches`: the run's, when it gives one: a bound on every micro-batch index."""
    rows = _rows(path)
    if not rows:
        raise CsvError(path, None, None, "", "has no rows: one row per pipeline rank")
    raw, holder = {}, {}
    for r, row in enumerate(rows):
        raw[r] = []
        for c, text in enumerate(row):
            if not text.strip():
                continue  # idle
            for stage, op, mb in _cells(path, r, c, text.strip(), microbatches):
                if holder.setdefault(stage, r) != r:
                    raise CsvError(path, r, c, text, f"stage {stage} is already in row {holder[stage] + 1}: a stage "
                                   "lives on one rank")
                raw[r].append((c, text.strip(), stage, op, mb))
    smap = _placement(path, holder, len(rows))
    lists, where = {}, {}
    for r, cells in raw.items():
        lists[r] = []
        for c, text, stage, op, mb in cells:
            a = Action(Op(op), mb, smap.chunk(stage))
            where.setdefault((r, a), (c, text))
            lists[r].append(a)
    mbs = {a.microbatch for acts in lists.values() for a in acts}
    m = max(mbs) + 1 if mbs else 0  # below MAX_INDEX (or the run's m): _cells bounded every index
    if len(mbs) != m:  # a subset of 0..m-1 is all of it exactly when it has m members
        missing = next(i for i in range(m) if i not in mbs)
        raise CsvError(path, None, None, "", f"micro-batch {missing} never appears, but {m - 1} does: expected "
                       f"every micro-batch of 0..{m - 1}")
    return lists, smap, m, where


def load_csv(path: str, microbatches: Optional[int] = None) -> tuple[Schedule, dict]:
    """The file as a schedule (for its own pp, m, v), and where each action was written
    (`microbatches`: read_csv's bound)."""
    lists, smap, m, where = read_csv(path, microbatches)
    ops = frozenset(a.op for acts in lists.values() for a in acts)

    def generate(pp: int, microbatches: int, v: int, steps: int = 1) -> dict[int, list[Action]]:
        return {r: list(acts) for r, acts in lists.items()}

    def bubble(p: int, mm: int, v: int = 1, times=None, steps: int = 1) -> float:
        from framework.schedules.clock import simulated_bubble  # simulate imports this package's base
        return simulated_bubble(generate(p, mm, v), smap, times)

    sched = Schedule(name="csv", generate=generate, ops=ops or frozenset({Op.F}), placement=smap.placement,
                     doc=f"the schedule in {path}", bubble=bubble, bubble_source=modelled, chunks=smap.v,
                     memory_bound=lambda pp, mm, v, r: mm * v,  # a file declares none: the checker reports its peak
                     extra={"path": path, "pp": smap.pp, "microbatches": m, "virtual_stages": smap.v})
    return sched, where


def dump_csv(lists: dict[int, list[Action]], smap: StageMap, path: str) -> None:
    """Write lists in torch's compute-only format (global stage in each cell)."""
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        for r in sorted(lists):
            writer.writerow([f"{smap.stage(r, a.chunk)}{a.op.value}{a.microbatch}" for a in lists[r]])
