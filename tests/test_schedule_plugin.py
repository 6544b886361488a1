"""A schedule is one file: this test file defines one, registers it, and runs it end to end.

`lifo` is GPipe with the backward in reverse micro-batch order (the last forward's
activations are the first freed). The ranks are forks of a preloaded server, so the
registration below does not reach them by itself: `schedule.modules=[<this file>]` makes
the launching process (validation: the checker proves it) and every rank import it. The
run reproduces the single process in fp64 like every built-in schedule.

Top-level imports are absolute on purpose: the ranks import this file by its path.
"""

from framework.schedules import Action, Op, Schedule, register

NAME = "lifo"


def lifo(pp: int, m: int, v: int = 1, steps: int = 1) -> dict[int, list[Action]]:
    return {r: [Action(Op.F, j) for j in range(m)] + [Action(Op.B, j) for j in reversed(range(m))]
            for r in range(pp)}


register(Schedule(name=NAME, generate=lifo, ops=frozenset({Op.F, Op.B}), doc="GPipe, backward last-in first-out",
                  bubble=lambda p, m, v=1, times=None, steps=1: (p - 1) / (m + p - 1),
                  memory_bound=lambda pp, m, v, r: m))


def test_a_schedule_defined_in_a_test_file_is_checked_executed_and_equal_to_the_single_process(tmp_path, data_cache):
    from tests.conftest import FP64, TINY, assert_same_training, final_params, read_metrics, run_local

    from framework.schedules.check import check

    assert [str(a) for a in check(NAME, 2, 3)[1]] == ["F0", "F1", "F2", "B2", "B1", "B0"]  # proved in-process too
    common = [*TINY, "model.n_layer=4", "data=pycode", "data.max_files=20", f"data.cache_dir={data_cache}",
              "trainer.steps=2", "trainer.warmup_steps=1", "trainer.save_checkpoint=true", "optimizer.lr=3e-3", FP64]
    run_local(tmp_path / "single", *common, "parallelism=single", "schedule=flush", "schedule.microbatches=4")
    summary = run_local(tmp_path / "lifo", *common, "parallelism=pp2", f"schedule.name={NAME}",
                        "schedule.microbatches=4", f"schedule.modules=[{__file__}]")
    assert summary["schedule"] == NAME and summary["pp"] == 2
    assert_same_training(read_metrics(tmp_path / "lifo"), final_params(tmp_path / "lifo"),
                         read_metrics(tmp_path / "single"), final_params(tmp_path / "single"))


def test_a_schedule_module_written_against_the_old_path_still_registers():
    """Schedule modules of users import the registry; it moved to framework.schedules (issue
    49), and the old path gives the same objects, with a warning that says where it went."""
    import importlib
    import sys

    import pytest

    import framework.schedules as new

    sys.modules.pop("framework.parallel.pipeline.schedules", None)
    with pytest.warns(DeprecationWarning, match="moved to framework.schedules"):
        old = importlib.import_module("framework.parallel.pipeline.schedules")
    assert old.register is new.register and old.Schedule is new.Schedule and old.REGISTRY is new.REGISTRY
    assert set(old.__all__) == set(new.__all__) and all(getattr(old, n) is getattr(new, n) for n in new.__all__)
