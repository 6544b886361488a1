"""DualPipe's overlap under NCCL's stream rules: can a pair's two threads deadlock the ranks?

`parallelism.overlap_dualpipe` runs each steady-state pair's F on a second thread beside its
B (framework/comm/side_thread.py); the F thread's all-to-alls go to the `ep_side` group,
the B thread's to `ep`. gloo cannot show what NCCL would do with that, so it is modelled
here (issue 47), beside check.py's model of the pipeline's p2p batches.

The rules. A collective is enqueued on the stream of the thread that issues it: its NCCL
stream waits for that stream at issue and, the call being synchronous, that stream then
waits for the collective. So the collectives on one stream complete in the order they were
enqueued there, and a collective completes once every rank of its group has reached it on
the stream it was enqueued on. A host read on a thread (the MoE dispatch's `.tolist()` of
its counts) waits for everything enqueued before it on that thread's stream, and the thread
issues nothing meanwhile. The host interleaves the two threads of a rank in any order.

`find_deadlock` explores every interleaving on every rank (a state: each thread's position
and each stream's pending collectives, on every rank; completions applied as soon as they
can happen, which never disables anything) and returns the issue orders of a deadlock, or
None: deadlock-free for any timing.
- Today's design, both threads on the one compute stream (`shared=True`): a deadlock as
  soon as each thread issues a collective (two ranks enqueue ep and ep_side in opposite
  orders; each waits for the other's). Why the key is refused on CUDA (validate/schedule.py).
- The design to build, the F thread on a stream of its own (`shared=False`): no stream
  holds both threads' collectives and a read waits on its own thread's stream only, so the
  two threads' systems never interact and are explored one at a time (an exact reduction).
"""

from __future__ import annotations

from typing import Optional

READ, COLLECTIVE = "read", "collective"


def find_deadlock(programs: dict[str, list[str]], ranks: int, shared: bool) -> Optional[dict[int, list]]:
    """`programs`: each thread's ops in program order (READ or COLLECTIVE; a thread's k-th
    collective is on its own group, the same on every rank). Returns, for a deadlock, each
    rank's issue order up to it ([(thread, op index)]); None when none is reachable."""
    if not shared:  # independent systems: each thread alone, on its own stream
        for thread, ops in programs.items():
            found = _explore({thread: ops}, ranks, {thread: thread})
            if found is not None:
                return found
        return None
    return _explore(programs, ranks, {t: "compute" for t in programs})


def _explore(programs: dict[str, list[str]], ranks: int, stream_of: dict[str, str]) -> Optional[dict[int, list]]:
    threads = sorted(programs)
    streams = sorted(set(stream_of.values()))
    # a rank: (positions per thread, pending collectives per stream as (thread, op index) tuples)
    start = tuple((tuple(0 for _ in threads), tuple(() for _ in streams)) for _ in range(ranks))
    seen: set = set()
    stack = [(start, tuple(() for _ in range(ranks)))]
    while stack:
        state, issued = stack.pop()
        state = _complete(state)
        if state in seen:
            continue
        seen.add(state)
        moves = []
        for r, (pos, pending) in enumerate(state):
            for ti, t in enumerate(threads):
                if pos[ti] == len(programs[t]):
                    continue
                si = streams.index(stream_of[t])
                op = programs[t][pos[ti]]
                if op == READ and pending[si]:
                    continue  # waits for its stream to drain
                new_pos = pos[:ti] + (pos[ti] + 1,) + pos[ti + 1:]
                new_pending = pending if op == READ else \
                    pending[:si] + (pending[si] + ((t, pos[ti]),),) + pending[si + 1:]
                nxt = state[:r] + ((new_pos, new_pending),) + state[r + 1:]
                moves.append((nxt, issued[:r] + (issued[r] + ((t, pos[ti]),),) + issued[r + 1:]))
        done = all(p == tuple(len(programs[t]) for t in threads) and not any(q) for p, q in state)
        if not moves and not done:
            return {r: list(seq) for r, seq in enumerate(issued)}
        stack.extend(moves)
    return None


def _complete(state: tuple) -> tuple:
    """Every collective at the head of its stream on every rank completes (repeatedly)."""
    changed = True
    while changed:
        changed = False
        heads = [{q[0] for q in pending if q} for _, pending in state]
        for op in set.intersection(*heads) if heads else set():
            state = tuple((pos, tuple(q[1:] if q and q[0] == op else q for q in pending)) for pos, pending in state)
            changed = True
            break
    return state


def pair_programs(moe_layers_f: int, moe_layers_b: int, reads: bool = True) -> dict[str, list[str]]:
    """A pair's two threads: per MoE layer, F reads its routing counts on the host (one read,
    framework/comm/expert_parallel.py) and runs the dispatch and combine all-to-alls; B
    runs their two backward all-to-alls."""
    f = ([READ] if reads else []) + [COLLECTIVE, COLLECTIVE]
    return {"F": f * moe_layers_f, "B": [COLLECTIVE, COLLECTIVE] * moe_layers_b}
