"""Stopping on request: SIGINT (Ctrl-C) and SIGTERM (a scheduler's pre-emption).

A stop is not a failure: nobody is blamed, no failure record is written, and the process
exits with 128 + the signal number (130, 143), as a shell reports a process killed by it.
`StopSignals` is the ONE path both signals take, in the launching process and in every
rank. A rank that checkpoints (trainer.checkpoint_interval > 0) `defer`s the stop: the
signal only sets `requested`, and the training loop, after the ranks agree at the next step
boundary, saves a checkpoint and raises `Stopped` itself (framework/train/trainer.py).
"""

from __future__ import annotations

import signal
from typing import Optional

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(BaseException):
    """Raised where the process was when the signal arrived. A BaseException, so the
    `except Exception` of library code (Hydra, torch, W&B) does not swallow it."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(signal.Signals(signum).name)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


class StopSignals:
    def __init__(self):
        self.deferring = False
        self.requested: Optional[int] = None  # the first stop signal received while deferring

    def install(self) -> StopSignals:
        for s in STOP_SIGNALS:
            signal.signal(s, self._handle)
        return self

    def defer(self) -> None:
        """From now on a stop is a request (`requested`) the caller acts on at a point of its
        choosing; further signals are absorbed meanwhile (a scheduler's SIGTERM to the whole
        process group, then the launcher's own SIGTERM to each rank, is one stop)."""
        self.deferring = True

    def undefer(self) -> Optional[int]:
        """Stops raise where they land again. Returns a stop requested meanwhile, if any."""
        self.deferring = False
        return self.requested

    def ignore(self) -> None:
        """While a rank writes its failure record: a stop arriving then (the agent ending
        the survivors) must not interrupt the record. Undo with `default()` right after."""
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)

    def default(self) -> None:
        """The OS's action again: the next SIGINT / SIGTERM ends the process at once (during
        teardown, or a second Ctrl-C), so nothing can outlive its launcher waiting for a stop
        it ignores, or print a second traceback from inside the first stop's handling."""
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_DFL)

    def _handle(self, signum: int, frame) -> None:
        if self.deferring:
            if self.requested is None:
                self.requested = signum
            return
        self.default()  # one-shot
        raise Stopped(signum)
