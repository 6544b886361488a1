"""`python -m framework.simulate --op-times ...`: a schedule replayed at given op times, with
no job, against the zero-bubble paper's own numbers and hand-computed timelines."""

from __future__ import annotations

import pytest

from framework.schedules import get
from framework.sim.cli import main
from framework.sim.optimes import bubbles

# Qi et al., "Zero Bubble Pipeline Parallelism" (arXiv 2401.10241v1, ICLR 2024): Table 9's
# profiled op times (p, m, T_F, T_B, T_W, T_comm) and Table 5's bubble rates from them
# (1F1B, ZB-H1, ZB-H2), as the authors' script computes them (sail-sg/zero-bubble-pipeline-
# parallelism, branch arxiv, megatron/core/pipeline_parallel/efficiency.py).
TABLE = [
    (8, 24, 18.522, 18.086, 9.337, 0.601, 0.2431, 0.1585, 0.1083),
    (8, 32, 18.513, 18.086, 9.331, 0.626, 0.1985, 0.1242, 0.0837),
    (8, 64, 18.546, 18.097, 9.321, 0.762, 0.1240, 0.0674, 0.0444),
    (8, 24, 29.718, 29.444, 19.927, 0.527, 0.2347, 0.1323, 0.0698),
    (8, 32, 29.802, 29.428, 19.530, 0.577, 0.1898, 0.1045, 0.0559),
    (8, 64, 29.935, 29.621, 19.388, 0.535, 0.1091, 0.0554, 0.0294),
    (16, 48, 11.347, 11.248, 8.132, 0.377, 0.2552, 0.1397, 0.0672),
    (16, 64, 11.307, 11.254, 8.101, 0.379, 0.2082, 0.1088, 0.0516),
    (16, 128, 11.325, 11.308, 8.109, 0.378, 0.1251, 0.0576, 0.0266),
    (32, 96, 10.419, 10.207, 7.715, 0.408, 0.2646, 0.1421, 0.0641),
    (32, 128, 10.408, 10.204, 7.703, 0.408, 0.2168, 0.1106, 0.0490),
    (32, 256, 10.402, 10.248, 7.698, 0.460, 0.1352, 0.0594, 0.0257),
]


@pytest.mark.parametrize("row", TABLE, ids=lambda r: f"p{r[0]}_m{r[1]}_F{r[2]}")
def test_the_zero_bubble_papers_bubble_rates(row):
    """Its 1F1B (our flush: the fused backward lasts T_B + T_W), ZB-H1 and ZB-H2, each on the
    schedule's own dependency graph with T_comm per message, to the table's 4 decimals."""
    p, m, f, b, w, comm, *published = row
    times = {"F": f, "B": b, "W": w, "comm": comm}
    for name, want in zip(("flush", "zbh1", "zbh2"), published):
        got = bubbles(get(name), p, m, 1, times)["own"]["paper"]
        assert got == pytest.approx(want, abs=5.001e-5), name


def test_one_f_one_b_with_a_transfer_time_by_hand():
    """p 2, m 2, T_F 1, fused B 2, T_comm 0.5. Rank 0: F0 [0,1], F1 [1,2], B0 once rank 1's
    gradient arrives (5, 7), B1 at 8 (10). Rank 1: F0 at 1.5 (2.5), B0 (4.5), F1 (5.5), B1
    (7.5). Cost 10 (rank 0's span), work m (T_F + T_B + T_W) = 6: the paper's rate 0.4; ours
    the mean idle share of the 10-unit step: rank 0 4 of 10, rank 1 4 of 10 -> 0.4."""
    b = bubbles(get("flush"), 2, 2, 1, {"F": 1.0, "B": 1.5, "W": 0.5, "comm": 0.5})["own"]
    assert b["step"] == pytest.approx(10.0)
    assert b["paper"] == pytest.approx(0.4) and b["ours"] == pytest.approx(0.4)


@pytest.mark.parametrize("p, m", [(4, 8), (8, 24), (6, 13)])
def test_the_papers_closed_forms(p, m):
    """Bubble size cost - m (T_F + T_B + T_W) (the paper's Table 2; ZB-H2's with T_comm as
    the authors' script asserts it): 1F1B (p-1)(T_F+T_B+T_W) and ZB-H1 (p-1)(T_F+T_B-T_W)
    without transfers; ZB-H2 (p-1)(T_F+T_B+2 T_comm-2 T_W) with them."""
    f, b, w = 1.3, 1.1, 0.7
    for name, comm, size in (("flush", 0.0, (p - 1) * (f + b + w)), ("zbh1", 0.0, (p - 1) * (f + b - w)),
                             ("zbh2", 0.25, (p - 1) * (f + b + 2 * 0.25 - 2 * w))):
        rate = bubbles(get(name), p, m, 1, {"F": f, "B": b, "W": w, "comm": comm})["own"]["paper"]
        work = m * (f + b + w)
        assert work / (1 - rate) - work == pytest.approx(size), name


def test_the_executors_batches_against_the_schedules_own_graph():
    """At the paper's 1.5B op times, with its T_comm, under NCCL's rules: ZB-H1's executor
    batches cost 0.006 over the graph (0.077 when a compute waited for its whole batch: the
    gating rule, p2p.py), the rest being transfers that queue on one stream; ZB-H2 and 1F1B
    lose nothing to them."""
    times = {"F": 18.522, "B": 18.086, "W": 9.337, "comm": 0.601}
    h1 = bubbles(get("zbh1"), 8, 24, 1, times)
    assert h1["own"]["paper"] < h1["executor"]["paper"] < h1["own"]["paper"] + 0.006
    for name in ("zbh2", "flush"):
        b = bubbles(get(name), 8, 24, 1, times)
        assert b["executor"]["paper"] == pytest.approx(b["own"]["paper"], abs=2e-3)


def test_the_command_prints_both_timelines(capsys):
    assert main(["--op-times", "F=18.522,B=18.086,W=9.337,comm=0.601", "schedule=zbh1", "parallelism.pp=8",
                 "schedule.microbatches=24"]) == 0
    out = capsys.readouterr().out
    assert "bubble 0.159 (zero-bubble paper's" in out and "executor's p2p batches" in out
    assert "T_F 18.522, T_B 18.086, T_W 9.337, T_comm 0.601" in out


@pytest.mark.parametrize("argv, words", [
    (["--op-times", "F=1,B=1", "parallelism.pp=4", "schedule.microbatches=8"], "--op-times='F=1,B=1': W missing"),
    (["--op-times", "F=1,B=x,W=1", "parallelism.pp=4", "schedule.microbatches=8"], "B='x' is not a number"),
    (["--op-times", "F=1,B=1,W=1", "parallelism.pp=4"], "schedule.microbatches=None: is needed with --op-times"),
    (["--op-times", "F=1,B=1,W=1", "parallelism.pp=4", "schedule.microbatches=8", "parallelism.ep=2"],
     "parallelism.ep='2': does not act with --op-times"),
    (["--op-times", "F=1,B=1,W=1", "schedule=1f1b", "parallelism.pp=4", "schedule.microbatches=8"], "never flushes"),
    (["--op-times", "F=1,B=1,W=1", "schedule=zbhh1", "parallelism.pp=4", "schedule.microbatches=8"],
     "no such schedule. Did you mean zbh1"),
    (["--op-times", "F=1,B=1,W=1", "schedule=zbv", "parallelism.pp=4", "schedule.microbatches=8",
      "schedule.virtual_stages=3"], "schedule.virtual_stages=3: zbv places exactly 2 chunks"),
    (["/tmp", "--op-times", "F=1,B=1,W=1", "parallelism.pp=4", "schedule.microbatches=8"], "a job was given"),
])
def test_bad_op_times_arguments_are_one_line(argv, words, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("config error: ") and words in err and err.count("\n") == 1, err
