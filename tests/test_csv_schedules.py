"""Schedules in torch's compute-only CSV format, both ways: a file torch 2.13 dumps reads
here as the same schedule; what `python -m framework.schedules dump` writes, torch's
`_PipelineScheduleRuntime._load_csv` reads back in the same per-rank order; a bad file is a
config error before any rank starts, naming the row, the cell and the rule. (A file torch
dumped runs end to end in tests/test_zero_bubble.py.)"""

import logging
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

from framework.config import ConfigError
from framework.schedules import build_schedule, csv_schedule, get, names
from framework.validate import validate

from .conftest import compose

ROOT = Path(__file__).resolve().parents[1]


def _torch_stages(p: int, v: int):
    from torch.distributed.pipelining.stage import PipelineStage

    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank, stage.group_size, stage.submod, stage.num_stages = 0, p, None, p * v
    return [stage for _ in range(v)]


@pytest.fixture(autouse=True)
def _quiet_torch():
    logging.disable(logging.WARNING)  # torch warns about the bubbles it pads
    yield
    logging.disable(logging.NOTSET)


@pytest.mark.parametrize("p,m", [(2, 4), (2, 7), (4, 8), (3, 12)])
def test_a_csv_torch_dumped_reads_as_our_schedule(tmp_path, p, m):
    from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble

    path = tmp_path / "zbv.csv"
    ScheduleZBVZeroBubble(_torch_stages(p, 2), m)._dump_csv(str(path), format="compute_only")
    assert ",," in path.read_text() or path.read_text().splitlines()[1].startswith(",")  # torch pads idle cells
    sched, _ = csv_schedule(str(path))
    assert (sched.placement, sched.extra) == ("v", {"path": str(path), "pp": p, "microbatches": m,
                                                    "virtual_stages": 2})
    assert sched.generate(p, m, 2) == build_schedule("zbv", p, m, 2)


CASES = [(n, p, m) for n in names() if get(n).flushes for p, m in ((2, 4), (4, 8))]


@pytest.mark.parametrize("name,p,m", CASES)
def test_our_dump_loads_in_torch_with_the_same_order(tmp_path, name, p, m):
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    sched = get(name)
    v = sched.preset_chunks
    path = tmp_path / f"{name}.csv"
    r = subprocess.run([sys.executable, "-m", "framework.schedules", "dump", name, "--pp", str(p), "--microbatches",
                        str(m), "-o", str(path)], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    runtime = _PipelineScheduleRuntime(_torch_stages(p, v), m)
    runtime._load_csv(str(path))  # torch lowers it (adds its sends and receives): it must accept the file
    smap = sched.stage_map(p, v)
    ours = {r: [f"{smap.stage(r, a.chunk)}{a.op.value}{a.microbatch}" for a in acts]
            for r, acts in build_schedule(name, p, m, v).items()}
    assert {r: [str(a) for a in acts if a is not None] for r, acts in runtime.pipeline_order.items()} == ours


def _write(tmp_path, rows) -> str:
    path = tmp_path / "s.csv"
    path.write_text("\n".join(",".join(r) for r in rows) + "\n")
    return str(path)


ZBH1_2x2 = [["0F0", "0F1", "0I0", "0W0", "0I1", "0W1"], ["1F0", "1I0", "1W0", "1F1", "1I1", "1W1"]]


def _swap(rows, r, i, j):
    rows = [list(x) for x in rows]
    rows[r][i], rows[r][j] = rows[r][j], rows[r][i]
    return rows


BAD = [
    ("cell", [["0F0", "0X1"], ["1F0"]], "row 1 (pp rank 0), cell 2 '0X1': not a compute action"),
    ("comms", [["0F0", "0SEND_F0"], ["1F0"]], "cell 2 '0SEND_F0': not a compute action"),
    ("w before i", _swap(ZBH1_2x2, 1, 1, 2), "row 2 (pp rank 1), cell 2 '1W0': breaks a rule: rank 1: W0 before its I"),
    ("stage twice", [["0F0", "1F1"], ["1F0"]], "row 2 (pp rank 1), cell 1 '1F0': stage 1 is already in row 1"),
    ("no backward", [r[:-2] for r in ZBH1_2x2], "row 1 (pp rank 0): breaks a rule: rank 0: backward missing"),
    ("deadlock", [ZBH1_2x2[0], ["1I0", "1W0", "1F0", "1F1", "1I1", "1W1"]], "cell 1 '1I0'"),
]


@pytest.mark.parametrize("rows,problem", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_a_bad_file_is_a_config_error_naming_row_and_cell(tmp_path, rows, problem):
    path = _write(tmp_path, rows)
    with pytest.raises(ConfigError) as e:
        validate(compose("parallelism=pp2", "schedule=csv", f"schedule.csv={path}", "model.n_layer=2"))
    assert str(e.value).startswith(f"schedule.csv={path!r}") and problem in str(e.value), str(e.value)


def test_a_file_for_another_layout_names_the_key_to_change(tmp_path):
    path = _write(tmp_path, ZBH1_2x2)
    with pytest.raises(ConfigError, match=r"parallelism.pp=4: .* is a schedule for pp=2. Fix: set parallelism.pp=2"):
        validate(compose("parallelism=pp4", "schedule=csv", f"schedule.csv={path}", "model.n_layer=4"))
    with pytest.raises(ConfigError, match="schedule.csv=None: schedule=csv reads its schedule from a file"):
        validate(compose("parallelism=pp2", "schedule=csv"))
    run = compose("parallelism=pp2", "schedule=csv", f"schedule.csv={path}", "model.n_layer=2")
    validate(run)  # the good file passes, sizes from the file
    assert (run.schedule.microbatches, run.schedule.virtual_stages) == (2, 1)
