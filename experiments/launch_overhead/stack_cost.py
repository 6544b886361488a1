"""Elastic's rendezvous event names, from inside a test runner: what `inspect.stack()` costs
where the framework's own tests launch jobs, against the name read from the frame.

    .venv/bin/python -m pytest -q -s experiments/launch_overhead/stack_cost.py

A local launch makes 6 rendezvous events, each named with get_method_name(), which walks
the stack twice: 12 walks. Prints the seconds for 12 names both ways (median of 5), the
stack's depth and how many modules are loaded (inspect.getmodule scans them)."""

import importlib
import inspect
import statistics
import sys
import time


def elastic_name(depth: int = 2) -> str:  # torch 2.13's dynamic_rendezvous.get_method_name
    if len(inspect.stack()) > depth:
        return inspect.stack()[depth].function
    return "no_method_name"


def frame_name(depth: int = 2) -> str:  # framework/launch/local.py's
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:
        return "no_method_name"


def test_print_what_twelve_event_names_cost():
    importlib.import_module("framework.launch.job")  # the modules a launch has loaded

    for fn in (elastic_name, frame_name):
        times = []
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(6):
                fn(), fn()
            times.append(time.perf_counter() - t)
        print(f"\n{fn.__name__}: {statistics.median(times):.4f} s for 12 names; stack depth {len(inspect.stack())}, "
              f"{len(sys.modules)} modules loaded", end="")
    print()
