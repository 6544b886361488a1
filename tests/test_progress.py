"""The logging rank's live progress line (framework/report/progress.py), without a run: the line is
redrawn in place on a terminal, a heartbeat line keeps a log file alive during a slow step,
ETA and elapsed follow the steps' times, and run.log gets the lines that stay.

The printed times come from a fake clock (Progress's `now`), moved by hand: the exact
strings do not depend on how loaded the machine is. Only the redraw thread's period is real
time, and the tests wait (up to 30 s, far beyond what load delays a 50 ms redraw by) for the
line they expect rather than for a duration."""

from __future__ import annotations

import io
import time

from framework.report.progress import RUN_LOG, Progress, clock

ROW = {"step": 1, "loss": 5.25, "tokens_per_s": 12345.0}


class FakeClock:
    """Seconds that move only when a test says so."""

    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and not predicate():
        time.sleep(0.02)
    assert predicate()


def test_clock_reads_like_a_duration():
    assert [clock(s) for s in (0, 5.4, 65, 3600 + 62)] == ["0:00", "0:05", "1:05", "1:01:02"]


def test_on_a_terminal_a_slow_step_is_redrawn_in_place(tmp_path):
    out, now = Terminal(), FakeClock()
    p = Progress(10, 1, str(tmp_path), stream=out, refresh_s=0.05, now=now)
    assert p.interactive
    p.step_started(1)
    now.advance(3.0)
    _wait_for(lambda: out.getvalue().count("\r\x1b[2K") >= 2)  # redrawn while step 1 still runs
    _wait_for(lambda: "\r\x1b[2Kstep    1/10 running 0:03 | elapsed 0:03 | ETA n/a" in out.getvalue())
    now.advance(1.0)
    p.step_done(4.0)
    p.gathered(ROW, "step    1/10 | loss 5.2500")
    p.step_started(2)
    now.advance(1.0)
    # the live line carries the gathered numbers; ETA = 9 steps x 4 s, less the 1 s step 2 has run
    _wait_for(lambda: ("step    2/10 running 0:01 | loss 5.2500 | 12,345 tok/s (step 1) | elapsed 0:05 | ETA 0:35"
                       in out.getvalue()))
    p.close()
    log = (tmp_path / RUN_LOG).read_text()
    assert log == "step    1/10 | loss 5.2500 | elapsed 0:04 | ETA 0:36\n"  # only the lines that stay


def test_in_a_log_file_a_slow_step_prints_a_heartbeat(tmp_path):
    out, now = io.StringIO(), FakeClock()
    p = Progress(3, 1, str(tmp_path), stream=out, refresh_s=0.05, heartbeat_s=30.0, now=now)
    assert not p.interactive
    p.step_started(1)
    now.advance(30.0)  # heartbeat_s without any line
    heartbeat = "still in step    1/3 running 0:30 | elapsed 0:30 | ETA n/a"
    _wait_for(lambda: heartbeat in out.getvalue())
    p.step_done(1.0)
    p.close()
    assert "\r" not in out.getvalue()  # no cursor tricks in a file
    assert out.getvalue().count("still in") == 1  # the clock stood still after it: no second heartbeat
    assert (tmp_path / RUN_LOG).read_text() == heartbeat + "\n"


def test_eta_leaves_out_the_first_step_once_there_are_others(tmp_path):
    p = Progress(10, 1, None, stream=io.StringIO(), interactive=False)
    for k, seconds in enumerate((30.0, 2.0, 4.0), start=1):  # the first carries warm-up
        p.step_started(k)
        p.step_done(seconds)
    assert p._eta(3) == clock(7 * 3.0)
    p.close()
    resumed = Progress(10, 6, None, stream=io.StringIO(), interactive=False)
    resumed.step_started(6)
    resumed.step_done(2.0)
    assert resumed._eta(6) == clock(4 * 2.0)  # a resumed run counts the steps left, not the steps it ran
    resumed.close()


def test_run_log_gets_the_launching_process_lines_and_a_redrawn_bar_once(tmp_path, capsys):
    import sys

    from framework.report.progress import console_to_run_log

    with console_to_run_log(str(tmp_path)):
        print("world 2 = dp 2 x tp 1 x pp 1 on cpu")
        sys.stderr.write("tokenizing:  50%\rtokenizing: 100%\n")  # a progress bar's redraws
        print("config error: x=1: bad. Fix: y", file=sys.stderr)
    assert (tmp_path / RUN_LOG).read_text().splitlines() == [
        "world 2 = dp 2 x tp 1 x pp 1 on cpu", "tokenizing: 100%", "config error: x=1: bad. Fix: y"]
    assert "world 2" in capsys.readouterr().out  # the console still gets everything
