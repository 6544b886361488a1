"""What `python run.py` runs before any rank starts, in the test's own process (no rank, no
subprocess): the command-line check, Hydra's composition, framework.validate.configure and
run_job (with launcher=external or dry_run=true it stops where ranks would start)."""

from __future__ import annotations

import contextlib
import copy
import io
import os

CONF = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")
_BASES: dict = {}


def prelaunch(base: list[str], arg: str, job_dir: str) -> None:
    """What run.py runs before any rank starts (its __main__ and job()), in this process.
    The base overrides are composed once (Hydra's compose is the slow part) and the fuzzed
    one applied as Hydra's composition applies a key override; a group override composes."""
    from hydra import compose, initialize_config_dir
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from framework.launch.job import run_job
    from framework.validate import configure
    from framework.validate.overrides import add_absent_keys, check_command_line

    argv = base + [arg]
    check_command_line(argv, CONF)
    argv = add_absent_keys(argv, CONF)
    group = "." not in arg.split("=", 1)[0]
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        if group:
            cfg = compose("config", overrides=argv)
        else:
            if tuple(base) not in _BASES:
                _BASES[tuple(base)] = compose("config", overrides=base)
            cfg = copy.deepcopy(_BASES[tuple(base)])
            ConfigLoaderImpl._apply_overrides_to_config(OverridesParser.create().parse_overrides(argv[-1:]), cfg)
    run = configure(cfg, argv)
    with contextlib.redirect_stdout(io.StringIO()):
        run_job(run, job_dir)
