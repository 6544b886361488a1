"""Stopping on request: SIGINT (Ctrl-C) and SIGTERM (a scheduler's pre-emption).

A stop is not a failure: nobody is blamed, no failure record is written, and the process
exits with 128 + the signal number (130, 143), as a shell reports a process killed by it.
`StopSignals` is the ONE path both signals take, in the launching process and in every
rank; `hooks` run first (in a rank: the place a pre-emption checkpoint will be saved).
"""

from __future__ import annotations

import signal
from typing import Callable

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
        self.hooks: list[Callable[[int], None]] = []

    def install(self) -> StopSignals:
        for s in STOP_SIGNALS:
            signal.signal(s, self._handle)
        return self

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
        self.default()  # one-shot
        for hook in self.hooks:
            hook(signum)
        raise Stopped(signum)
