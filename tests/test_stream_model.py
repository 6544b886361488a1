"""DualPipe's overlap under NCCL's stream rules (framework/parallel/pipeline/streams.py, issue
47): the model finds today's deadlock (both threads of a pair on the one compute stream) and
proves the design to build (the F thread on a stream of its own) for every pair dualpipev
makes at p 2..8, with ep 2..4."""
import time

from framework.schedules.check import check
from framework.schedules.p2p import comm_plan
from framework.schedules import get
from framework.schedules.base import pair_starts
from framework.parallel.pipeline.streams import COLLECTIVE, READ, find_deadlock, pair_programs


def test_two_threads_on_one_stream_deadlock_two_ranks():
    """One all-to-all per thread: rank 0 enqueues ep (B) first and rank 1 ep_side (F), or the
    other way round; each stream then waits for a collective its peer enqueued second."""
    found = find_deadlock({"F": [COLLECTIVE], "B": [COLLECTIVE]}, ranks=2, shared=True)
    assert found is not None
    assert len(found[0]) == len(found[1]) == 2
    assert [t for t, _ in found[0]] == [t for t, _ in found[1]][::-1]  # opposite orders


def test_what_cannot_deadlock_is_not_said_to():
    # one thread alone on the shared stream: every rank enqueues in one order
    assert find_deadlock({"F": [READ, COLLECTIVE, COLLECTIVE]}, ranks=3, shared=True) is None
    # a thread that only reads its own stream never waits for the other
    assert find_deadlock({"F": [READ, READ], "B": [COLLECTIVE]}, ranks=2, shared=False) is None
    # two threads with only host reads share nothing a peer must reach
    assert find_deadlock({"F": [READ], "B": [READ]}, ranks=2, shared=True) is None


def test_the_f_thread_on_its_own_stream_is_proved_for_every_dualpipev_pair():
    """Every pair of every rank at p 2..8 (m = 2p), with 1 or 2 MoE layers per chunk (a
    uniform partition gives every chunk the same count, so the pairs differ only by it; each
    shape is explored once) and ep 2..4, reads included: deadlock-free with the F thread on
    its own stream, a deadlock with both on the compute stream."""
    proved, t0 = 0, time.perf_counter()
    shapes: dict = {}
    for pp in range(2, 9):
        m = 2 * pp
        lists, smap = check("dualpipev", pp, m, 2, pairs=True), get("dualpipev").stage_map(pp, 2)
        for r, plan in comm_plan(lists, smap, pairs=True).items():
            for k in pair_starts(plan.actions):
                f, b = plan.actions[k], plan.actions[k + 1]
                assert f.chunk != b.chunk
                for layers in (1, 2):  # MoE layers in each chunk
                    for ep in (2, 3, 4):
                        key = (layers, ep)
                        if key not in shapes:
                            programs = pair_programs(layers, layers)
                            shapes[key] = (find_deadlock(programs, ep, shared=False),
                                           find_deadlock(programs, ep, shared=True))
                        own, today = shapes[key]
                        assert own is None, (pp, r, k, key)
                        assert today is not None, (pp, r, k, key)
                        proved += 1
    assert proved > 1000 and time.perf_counter() - t0 < 60
