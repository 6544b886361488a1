"""Where a rank waits on communication, per parallel dimension: the step-time breakdown's
source (framework/metrics/breakdown.py).

One `CommTimer` per rank (`ParallelContext.timer`); the code that issues a dimension's
collectives wraps each call in `timer.span(dim)`: tp and cp (TPComm), ep's all-to-alls
(EPComm), our ZeRO's gathers and reduce-scatters and the explicit gradient reductions after
backward (dp), the tied-embedding sum (pp). A span is the time the rank's work waited for
the call: on CPU host time around it (gloo runs the transfer while the host waits: the
transfer plus the wait for the slowest peer); on CUDA two events on the compute stream,
read after the step (no host sync per call: the span is the compute stream's wait for
the collective, i.e. the exposed time).

Threads (parallelism.overlap_dualpipe): each thread has its own open span, and a span from
a pair's F thread is marked (`last_side`), so the breakdown can tell whose compute hid it.

Nested spans count once, in the outermost (a gradient sync over tp inside the dp span is
dp's). Not seen: torch DDP's bucketed all-reduce (its C++ reducer overlaps the last
backward; what it exposes stays in that backward's compute) and FSDP2's own collectives.

Total beside exposed (`totals`, the breakdown's `comm_total_<dim>_s`): every span counts
whole (exposed), and a call issued without waiting (the overlaps of parallelism.overlap_*)
adds the part of its time the host spent on other work: from its issue to the earlier of
its completion and the moment the caller began to wait for it (per dimension the union
of those intervals less its spans: calls queued together count once). `watch(dim, works)`
registers such a call: a watcher thread waits for its Works and stamps the completion
(gloo's reduce-scatter and send / receive Works have no future: "Work::getFuture not
implemented"), and the caller waits on the `_Watched` it returns, which stamps when that
wait begins and times the wait as a span of its own unless the caller's span holds it (so
however it is waited for, a wait right after the issue hides nothing, and no wait goes
uncounted) and never waits on a Work a second time (a gloo send's second wait() blocks for a
completion that never comes). The issue is stamped once the call is handed to its
watcher, so the hand-over counts as exposed, never as hidden (idle watchers are reused: a
thread is started only when every one is busy). A completion stamp needs the GIL back;
while the caller waits it holds none, so the stamp is late only for a call that completed
before its wait, and then by at most the interpreter's switch interval.
Every overlap registers its calls this one way: our ZeRO's reduce-scatters and prefetched
gathers, the cp ring's passes and the pipeline's per-chunk dp all-reduce buckets.
Where the completion cannot be seen (CUDA, whose collective futures complete at enqueue; a
thread calling wait() there would only order streams) the total is the exposed wait alone,
a lower bound, so `comm_hidden` reads 0 there, never more than was hidden; such calls are
counted (`totals["unseen_calls"]`, the breakdown's `comm_hidden_unseen_calls`) so the
console can say the overlap went unmeasured.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from typing import Optional

import torch

from framework.timestamps import clock_for
from framework.comm.side_thread import on_side

DIMS = ("dp", "tp", "pp", "ep", "cp")


class CommTimer:
    def __init__(self, device: torch.device):
        self.clock = clock_for(device)
        self.spans: list[tuple] = []  # this step's (dim, what, start mark, end mark)
        self._open = threading.local()  # per thread: a pair's two threads time their own calls
        self._lock = threading.Lock()
        self.side: set[int] = set()  # indices of spans from a pair's F thread (side_thread.py)
        self.last_side: set[int] = set()  # the last take()'s: indices into what it returned
        self.host = device.type != "cuda"  # completion times of overlapped calls are readable
        self.totals: dict[str, float] = {}  # the last step's, set by take()
        self.unseen = 0  # this step's overlapped calls whose completion cannot be read (CUDA)
        self.watched: list[tuple[str, "_Watched"]] = []  # this step's `watch`ed calls
        self._idle: list[queue.SimpleQueue] = []  # watcher threads waiting for a call (`_watcher`)
        self.delay: dict[str, float] = {}  # debug.dp_delay_ms / ep_delay_ms: dim -> seconds slept before its spans

    def begin_step(self) -> None:
        """Before the step's first span (CUDA: anchors event times to the host clock)."""
        self.clock.begin_step()
        self.spans, self.side = [], set()
        self.unseen, self.watched = 0, []

    @property
    def open(self) -> Optional[str]:
        """The calling thread's open span's dimension (None: none open)."""
        return getattr(self._open, "dim", None)

    @contextlib.contextmanager
    def span(self, dim: str, what: str = ""):
        if self.open is not None:  # nested: the outer span owns the time
            yield
            return
        if self.delay and dim in self.delay:  # before the span: a slow rank's own part; its peers wait inside theirs
            time.sleep(self.delay[dim])
        self._open.dim, start = dim, self.clock.mark()
        try:
            yield
        finally:
            end = self.clock.mark()
            with self._lock:
                if on_side():
                    self.side.add(len(self.spans))
                self.spans.append((dim, what or dim, start, end))
            self._open.dim = None

    def watch(self, dim: str, works: list) -> list:
        """An overlapped call was just issued: what the caller waits on instead of `works`
        (module docstring). Its wait is an ordinary span. Works as they are where the
        completion cannot be seen (CUDA) or inside another span (the outer span owns it)."""
        if self.open is not None:
            return works
        if not self.host:
            self.unseen += 1
            return works
        watched = _Watched(self, dim)
        self._watcher().put((watched, works))
        watched.issued = time.time()
        with self._lock:
            self.watched.append((dim, watched))
        return [watched]

    def _watcher(self) -> queue.SimpleQueue:
        """An idle watcher thread's queue, or a new thread's: one thread per call in flight
        (never a queue of calls behind one wait), reused once its call completes, so a call
        costs a hand-over, not a thread start."""
        with self._lock:
            if self._idle:
                return self._idle.pop()
        q: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._watch_loop, args=(q,), name="comm-watch", daemon=True).start()
        return q

    def _watch_loop(self, q: queue.SimpleQueue) -> None:
        while True:
            watched, works = q.get()
            watched.run(works)
            del watched, works  # an idle watcher holds no Work (nor the buffers it keeps alive)
            with self._lock:
                self._idle.append(q)

    def take(self) -> list[tuple[str, str, float, float]]:
        """This step's spans as (dim, what, start, end) in unix seconds; call once the step's
        work is done (CUDA: the events have fired). Sets `totals`."""
        sec = self.clock.seconds
        out = [(d, w, sec(s), sec(e)) for d, w, s, e in self.spans]
        totals = dict.fromkeys(DIMS, 0.0)
        for d, _, s, e in out:
            totals[d] += e - s
        for d in {d for d, _ in self.watched}:
            flight = [w.in_flight() for dim, w in self.watched if dim == d]
            totals[d] += hidden_s(flight, [(s, e) for dim, _, s, e in out if dim == d])
        totals["unseen_calls"] = float(self.unseen)  # not a dimension: breakdown.row reads it by name
        self.totals, self.last_side = totals, self.side
        self.spans, self.side = [], set()
        self.unseen, self.watched = 0, []
        return out


class _Watched:
    """An overlapped call's Works, waited for by a thread that stamps their completion
    (CommTimer.watch). wait() stamps when the caller begins to wait, then waits for that
    thread inside a span of the call's dimension (a caller's own span holds it: nested), so
    no wait for the call goes untimed, and raises what the Works' wait raised."""

    def __init__(self, timer: CommTimer, dim: str):
        self.issued = self.completed = self.waited = None
        self.timer, self.dim = timer, dim
        self._ready, self._error = threading.Event(), None

    def run(self, works: list) -> None:
        """On a watcher thread: wait for the Works, stamp the completion."""
        try:
            for w in works:
                w.wait()
            self.completed = time.time()
        except BaseException as e:  # handed to the caller's wait
            self._error = e
        finally:
            self._ready.set()

    def wait(self, timeout=None) -> bool:
        if self.waited is None:
            self.waited = time.time()
        with self.timer.span(self.dim, "overlapped call's wait"):
            self._ready.wait()
        if self._error is not None:
            raise self._error
        return True

    def in_flight(self) -> tuple[float, float]:
        """From the issue to the earlier of the completion and the caller's wait: the host's
        own time under the call (empty while neither happened: nothing is known)."""
        ends = [t for t in (self.completed, self.waited) if t is not None]
        return (self.issued, min(ends)) if ends else (self.issued, self.issued)


def hidden_s(flight: list, spans: list) -> float:
    """Seconds some call of a dimension was in flight (`flight`: each call's (issue, end of
    its in-flight time)) while the rank was not waiting in that dimension's `spans`: the
    union of the intervals, never their sum (calls queued behind each other are in flight
    together), less the exposed time already counted."""
    covered, out = _union(spans), 0.0
    for s, e in _union(flight):
        out += e - s - sum(max(0.0, min(e, b) - max(s, a)) for a, b in covered)
    return out


def _union(intervals: list) -> list:
    merged: list = []
    for s, e in sorted(i for i in intervals if i[1] > i[0]):
        if merged and s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        else:
            merged.append((s, e))
    return merged


@contextlib.contextmanager
def timed(timer: Optional[CommTimer], dim: str, what: str = ""):
    """`timer.span` when there is a timer (runners built without one time nothing)."""
    if timer is None:
        yield
    else:
        with timer.span(dim, what):
            yield


def watch(timer: Optional[CommTimer], dim: str, works: list) -> list:
    """`timer.watch` when there is a timer; without one, the Works as they are."""
    return works if timer is None else timer.watch(dim, works)
