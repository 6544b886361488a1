"""NCCL-safe point-to-point: the checker's NCCL model, the one batching description the
executor runs, and the measured bubble reacting to a stage made slower on purpose.

gloo cannot show NCCL's rules (stream-ordered p2p, a send completing only with its
receive, in-order matching without tags), so they are modelled (check.nccl_simulate) and
the executor is run on gloo with `batch_isend_irecv` returning one merged Work per batch
and every tag 0 (debug.coalesced_p2p), as NCCL returns and matches them. The pipeline
equivalence tests run some layouts in that mode too (tests/test_pipeline.py).
"""

import contextlib

import pytest
import torch
from torch import nn

from framework.schedules.check import ScheduleError, check, nccl_simulate
from framework.schedules.messages import Message, needs, produces, receiver_of, sender_of
from framework.schedules.p2p import P2POp, RankPlan, comm_plan
from framework.schedules import Action, StageMap, build_schedule
from framework.schedules.clock import simulate

from .conftest import TINY, read_metrics, run_local
from .distributed import run_ranks


def next_action_plan(lists: dict[int, list[Action]], smap: StageMap) -> dict[int, RankPlan]:
    """The first executor's batching (until 2026-11-22), to show what the NCCL model
    rejects: each action's send goes out with the receive of the rank's next action."""
    plans = {}
    for r, acts in lists.items():
        plan = RankPlan(list(acts), [[] for _ in range(len(acts) + 1)])
        for k, a in enumerate(acts):
            need = needs(a, r, smap)
            if need is not None:
                plan.batches[k].append(P2POp("recv", sender_of(need, smap), need))
            out = produces(a, r, smap)
            if out is not None:
                plan.batches[k + 1].insert(0, P2POp("send", receiver_of(out, smap), out))
        plans[r] = plan
    return plans


def test_the_first_executors_pairing_deadlocks_interleaved_under_nccl_and_the_plan_does_not():
    lists, smap = build_schedule("interleaved", 2, 4, 2), StageMap(2, 2)
    simulate(lists, smap)  # valid lists: gloo's rules never see the problem
    with pytest.raises(ScheduleError, match="deadlock under NCCL's rules"):
        nccl_simulate(next_action_plan(lists, smap), smap)
    nccl_simulate(comm_plan(lists, smap), smap)
    # flush survives even the old pairing: the model is not rejecting everything
    nccl_simulate(next_action_plan(build_schedule("flush", 4, 8), StageMap(4)), StageMap(4))


def _plan(actions, batches):
    return RankPlan(actions, batches)


def test_nccl_mode_rejects_a_hand_made_deadlock():
    """Each rank sends first, then receives, in separate batches. gloo would buffer both
    sends; under NCCL each send waits for a receive stuck behind it on the peer's stream."""
    a, b = Message("act", 0, 1), Message("grad", 0, 0)
    plans = {0: _plan([Action("F", 0), Action("B", 0)], [[P2POp("send", 1, a)], [P2POp("recv", 1, b)], []]),
             1: _plan([Action("F", 0), Action("B", 0)], [[P2POp("send", 0, b)], [P2POp("recv", 0, a)], []])}
    # actions that need no message: the deadlock is in the batches alone
    with pytest.raises(ScheduleError, match="never completes"):
        nccl_simulate(_without_needs(plans), StageMap(2))


def _without_needs(plans):
    return {r: RankPlan([Action("U", k) for k in range(len(p.actions))], p.batches) for r, p in plans.items()}


def test_nccl_mode_rejects_messages_matched_out_of_order():
    m0, m1 = Message("act", 0, 1), Message("act", 1, 1)
    plans = {0: _plan([Action("U", 0)], [[P2POp("send", 1, m0), P2POp("send", 1, m1)], []]),
             1: _plan([Action("U", 0)], [[P2POp("recv", 0, m1), P2POp("recv", 0, m0)], []])}
    with pytest.raises(ScheduleError, match="would land in the buffer of"):
        nccl_simulate(plans, StageMap(2))


@pytest.mark.parametrize("name,p,m,v", [("interleaved", 4, 8, 3), ("2bw", 8, 16, 1), ("flush", 8, 3, 1)])
def test_check_runs_the_nccl_model_on_the_executors_plan(name, p, m, v, monkeypatch):
    import framework.schedules.check as chk

    seen = []
    real = chk.nccl_simulate
    monkeypatch.setattr(chk, "nccl_simulate", lambda plans, smap, **kw: seen.append(plans) or real(plans, smap, **kw))
    check(name, p, m, v, steps=2)
    want = comm_plan(build_schedule(name, p, m, v, 2), StageMap(p, v))
    assert len(seen) == 1 and seen[0] == want  # the very batches the executor issues, op by op
    assert sum(len(b) for plan in want.values() for b in plan.batches) > 0


class _Stage(nn.Module):
    def __init__(self, last: bool):
        super().__init__()
        self.lin, self.last = nn.Linear(4, 4), last

    def forward(self, x, y=None):
        h = self.lin(x)
        return h.pow(2).mean() if self.last else h


def _run_executor(rank, world, name, m, v):
    """One rank of a real executor over gloo, run twice (tags per message, then
    debug.coalesced_p2p); returns, per mode, every batch_isend_irecv it made and its actions."""
    import torch.distributed as dist

    import framework.parallel.pipeline.executor as ex
    from framework.timestamps import HostClock

    calls = []
    real = dist.batch_isend_irecv
    pp_group = dist.new_group(list(range(world)))  # not the default group: each op must name it
    pairs = {}  # each pair of neighbours its own group (topology._pair_groups' rule)
    for i in range(world):
        pair = sorted({i, (i + 1) % world})
        g = dist.new_group(pair)
        if rank in pair:
            pairs[pair[0] if pair[1] == rank else pair[1]] = g

    def recording(ops):
        assert len({op.peer for op in ops}) == 1 and all(op.group is pairs[op.peer] for op in ops), \
            "a pipeline P2POp not on its pair's group"
        calls.append([("send" if op.op is dist.isend else "recv", op.peer, op.tag) for op in ops])
        return real(ops)

    ex.dist.batch_isend_irecv = recording
    plan = comm_plan(build_schedule(name, world, m, v), StageMap(world, v))[rank]
    out = {}
    for coalesced in (False, True):
        torch.manual_seed(0)
        chunks = [_Stage(last=c * world + rank == world * v - 1) for c in range(v)]
        executor = ex.PipelineExecutor(chunks, ex.PipelinePeers(list(range(world)), rank, StageMap(world, v), pp_group, pairs),
                                       torch.device("cpu"),
                                       (2, 3, 4), lambda j, c: contextlib.nullcontext(), lambda j, c: None,
                                       torch.float32, plan, HostClock(), coalesced_p2p=coalesced)
        batch = (torch.randn(2, 3, 4), None)
        marks = executor.run(0, len(plan.actions), lambda j: batch, 1.0 / m)
        executor.wait_sends()
        dist.barrier()  # no tag-0 message of the second run meets a receive of the first
        out[coalesced], calls = (list(calls), [mk[0] for mk in marks]), []
    return out


def test_the_executor_issues_exactly_the_checked_groups():
    """One `batch_isend_irecv` per group of each batch (p2p.py's gating rule) and peer, in
    group order then peer order, each op with its message's tag and on its pair of
    neighbours' own group (its own communicator, framework/schedules/matching.py stream_of). Interleaved at
    p 3, m 6, v 2: nine batches hold several groups, so an executor issuing a whole batch as
    one call fails here."""
    from framework.parallel.pipeline.executor import _tag

    name, p, m, v = "interleaved", 3, 6, 2
    results = run_ranks(_run_executor, p, name, m, v)
    smap = StageMap(p, v)
    plans = comm_plan(build_schedule(name, p, m, v), smap)
    split = [b for plan in plans.values() for b in plan.batches if len({op.group for op in b}) > 1]
    assert len(split) == 9  # the layout is decisive: batches of several groups
    for rank, modes in enumerate(results):
        for coalesced, (calls, actions) in modes.items():
            # coalesced mode: tags all 0, so gloo too matches a pair's messages in issue order
            want = [[(op.op, op.peer, 0 if coalesced else _tag(op.msg, smap.num_stages))
                     for op in b if op.group == g and op.peer == q]
                    for b in plans[rank].batches for g in sorted({op.group for op in b})
                    for q in sorted({op.peer for op in b if op.group == g})]
            assert calls == want, (rank, coalesced)
            assert actions == [str(a) for a in plans[rank].actions]


DELAY_MS = 100


def test_a_slower_stage_raises_the_other_stages_measured_bubble_by_its_extra_time(tmp_path):
    """Stage 1 sleeps DELAY_MS inside each of its 2m forward and backward computes. Stage
    0's compute is unchanged, and under flush its window (first action to the flush)
    stretches by the time the slow stage adds on the critical path, so its measured bubble
    must become 1 - busy / (window without delay + that extra time).

    Tolerances, for a loaded machine. A sleep lasts at least its time; it overshoots by the
    wake-up latency (under 1 ms measured idle, tens of ms under load), and load stretches
    the compute (5 ms a step per stage measured idle). So what follows from the sleeps alone
    is asserted one-sided and exactly, step by step: stage 1 is busy at least the 2m delays,
    and stage 0's window holds every compute of stage 1 (stage 1's first forward needs stage
    0's first; the flush ends both windows). The two-sided checks allow SLACK = added / 2
    (400 ms): far above what load adds (2m wake-ups and the compute), far below what each
    catches, a whole `added` (the delay counted twice, counted on stage 0, or missing from
    stage 0's window). The delay is 20x the step's compute, so load cannot hide in it."""
    m = 4
    args = [*TINY, "data=synthetic", "data.num_samples=64", "trainer.steps=4", "metrics.skip_first=1",
            "parallelism=pp2", "schedule=flush", f"schedule.microbatches={m}"]
    run_local(tmp_path / "base", *args)
    run_local(tmp_path / "slow", *args, f"debug.stage_delay_ms={DELAY_MS}", "debug.delay_pp_rank=1")
    base, slow = (read_metrics(tmp_path / k)[1:] for k in ("base", "slow"))
    added = 2 * m * DELAY_MS / 1e3
    slack = added / 2

    def med(rows, key, rank):
        return sorted(r[key][rank] for r in rows)[len(rows) // 2]

    # the delay is compute on stage 1, counted once, and only there
    assert all(r["rank_busy_s"][1] >= added for r in slow), slow  # no sleep ends early
    extra = med(slow, "rank_busy_s", 1) - med(base, "rank_busy_s", 1)  # the slow stage's extra time (overshoot in)
    assert extra < added + slack, (extra, added)
    assert med(slow, "rank_busy_s", 0) < med(base, "rank_busy_s", 0) + slack
    # it lands in stage 0's window, as idle time: the slow stage's extra time
    assert all(r["rank_window_s"][0] >= r["rank_busy_s"][1] for r in slow), slow
    idle = {k: med(rows, "rank_window_s", 0) - med(rows, "rank_busy_s", 0) for k, rows in (("base", base), ("slow", slow))}
    assert idle["slow"] - idle["base"] == pytest.approx(extra, abs=slack)
    # the bubble from those numbers; 0.05 of a window of about `added` is 40 ms of stage 0's
    # busy time, which load does not add to a few ms of compute
    expected = 1 - med(slow, "rank_busy_s", 0) / (med(base, "rank_window_s", 0) + extra)
    assert med(slow, "rank_bubble_fraction", 0) == pytest.approx(expected, abs=0.05)


def test_cuda_event_clock_reads_marks_against_the_anchor(monkeypatch):
    """No GPU here: fake events that fire at chosen device times. A mark's time is the
    anchor's host time plus the device time elapsed since the anchor, whatever the host
    was doing when it recorded the mark (on CUDA it only enqueues)."""
    from framework import timestamps as clk

    device_now = iter([100.0, 100.5, 103.0])  # ms on the device: anchor, then two marks

    class FakeEvent:
        def __init__(self, enable_timing):
            assert enable_timing

        def record(self, stream):
            self.t = next(device_now)

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return other.t - self.t

    class FakeStream:
        def synchronize(self):
            pass

    monkeypatch.setattr(clk.torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(clk.torch.cuda, "current_stream", lambda device=None: FakeStream())
    monkeypatch.setattr(clk.time, "time", lambda: 5000.0)
    clock = clk.CudaEventClock(torch.device("cuda", 0))
    clock.begin_step()
    a, b = clock.mark(), clock.mark()
    assert clock.seconds(a) == pytest.approx(5000.0005) and clock.seconds(b) == pytest.approx(5000.003)
    assert isinstance(clk.clock_for(torch.device("cpu")), clk.HostClock)


def test_the_configured_schedule_is_proved_before_launch(monkeypatch):
    """validate() runs the checker (gloo and NCCL rules) on the exact pp, m, v requested."""
    import framework.schedules.check as chk
    from framework.config import ConfigError
    from framework.validate import validate

    from .conftest import compose

    asked = []

    def failing(sched, lists, pp, m, v=1, steps=1, pairs=False, cp=1):
        asked.append((sched.name, pp, m, v))
        raise ScheduleError("deadlock under NCCL's rules: {0: 'batch [...] never completes'}")

    monkeypatch.setattr(chk, "prove", failing)
    with pytest.raises(ConfigError, match="schedule.name='interleaved': fails the schedule checker at pp=2"):
        validate(compose("parallelism=pp2", "schedule=interleaved", "schedule.microbatches=6"))
    assert asked == [("interleaved", 2, 6, 2)]


def test_async_runs_hold_a_bounded_number_of_p2p_buffers(tmp_path):
    """1f1b never flushes: earlier steps' sends are waited for at each step's end (gloo
    reports a send complete only once waited), so the bytes held for p2p do not grow with
    the run's length."""
    args = [*TINY, "data=synthetic", "data.num_samples=128", "parallelism=pp2", "schedule=1f1b",
            "schedule.microbatches=2", "model.tie_embeddings=false"]
    held = [run_local(tmp_path / str(n), *args, f"trainer.steps={n}")["p2p_buffer_peak_bytes_max"] for n in (3, 9)]
    assert held[0] == held[1] > 0
