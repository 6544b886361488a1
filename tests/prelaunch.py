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
    Hydra composes the config groups the overrides choose (the slow part, ~0.3 s: once per
    set of groups) and then applies each key override in order to the composed config; so
    does this, with the groups' composition memoized and the key overrides, the fuzzed one
    last, applied as Hydra applies them. A group override (`optimizer=...`) composes."""
    from hydra import compose, initialize_config_dir
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from framework.launch.job import run_job
    from framework.validate import configure
    from framework.validate.overrides import add_absent_keys, check_command_line

    argv = base + [arg]
    check_command_line(argv, CONF)
    argv = add_absent_keys(argv, CONF)
    groups = tuple(a for a in argv if _is_group(a))
    keys = [a for a in argv if not _is_group(a)]
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        if _is_group(arg):
            cfg = compose("config", overrides=argv)
        else:
            if groups not in _BASES:
                _BASES[groups] = compose("config", overrides=list(groups))
            cfg = copy.deepcopy(_BASES[groups])
            ConfigLoaderImpl._apply_overrides_to_config(OverridesParser.create().parse_overrides(keys), cfg)
    run = configure(cfg, argv)
    with contextlib.redirect_stdout(io.StringIO()):
        run_job(run, job_dir)


def _is_group(arg: str) -> bool:
    """Whether an override chooses a config group's option (a directory of conf/)."""
    name = arg.lstrip("+~").split("=", 1)[0]
    return "." not in name and os.path.isdir(os.path.join(CONF, name))
