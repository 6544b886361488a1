"""An unknown key or group option on the command line is one `config error:` line before
Hydra composes (framework/validate/overrides.py), in a single run and a sweep alike."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from framework.config import ConfigError, load_config
from framework.validate.overrides import check_command_line

from .conftest import CONF, run_cli

UNKNOWN = [
    (["trainer.stepz=10"], "trainer.stepz=10: no such key. Did you mean trainer.steps", "Fix: trainer.steps=10"),
    (["+trainer.stepz=10"], "+trainer.stepz=10: no such key. Did you mean trainer.steps", "Fix: trainer.steps=10"),
    (["++trainer.stepz=10"], "++trainer.stepz=10: no such key. Did you mean trainer.steps", "Fix: trainer.steps=10"),
    (["parallelism=dp44"], "parallelism='dp44': no such option in conf/parallelism/. Did you mean dp4?",
     "Fix: parallelism=dp4; the options: 3d_2x2x2"),
    (["schedule=zbhh1"], "schedule='zbhh1': no such option in conf/schedule/. Did you mean zbh1", "Fix: schedule=zbh1"),
    (["model=gpt3"], "model='gpt3': no such option in conf/model/. Did you mean gpt2, gpt-39b or gpt-530b?",
     "Fix: model=gpt2;"),
    (["-m", "schedule=flush,zbhh1", "logger=none"], "schedule='zbhh1': no such option", "Fix: schedule=zbh1"),
    (["trainer.seq_len=8"], "trainer.seq_len=8: no such key. Did you mean data.seq_len", "Fix: data.seq_len=8"),
    (["sim.source=x"], "sim.source='x': no such key. Did you mean sim.from, hardware.source or hardware.peak_source?",
     "Fix: sim.from=x"),
    (["model.moe.expertz=3"], "model.moe.expertz=3: no such key. Did you mean model.moe.experts", "Fix: "),
    (["trainer.steps.x=1"], "trainer.steps.x=1: no such key", "Fix: "),
]


@pytest.mark.parametrize("argv,head,fix", UNKNOWN, ids=[" ".join(a) for a, _, _ in UNKNOWN])
def test_an_unknown_key_or_option_names_the_closest(argv, head, fix):
    with pytest.raises(ConfigError) as e:
        check_command_line(argv, CONF)
    assert str(e.value).startswith(head), str(e.value)
    assert fix in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_what_hydra_and_free_keys_accept_passes():
    check_command_line(["++trainer.steps=3", "hydra.run.dir=x", "hydra/launcher=basic", "hydra.sweeper.params=null",
                        "sim.from=x", "+optimizer.foo=2", "optimizer.lr=1e-3", "schedule.op_times.F=1",
                        "model.moe.experts=3", "experiment=smoke", "hparams_search=null", "-m", "schedule=flush,zbh1",
                        "parallelism.pp=choice(1,2)", "model=glob(gpt*)", "~trainer.seed", "--cfg", "job"], CONF)
    check_command_line(["-cp", "elsewhere", "schedule=mine"], CONF)  # another config dir: its groups are Hydra's


def test_the_schema_shows_an_unknown_keys_value():
    with pytest.raises(ConfigError, match=r"^trainer\.stepz=10: does not fit the schema"):
        load_config(OmegaConf.create({"trainer": {"stepz": 10}}))


def test_run_py_says_it_in_one_line_before_any_job(tmp_path):
    for argv in (["trainer.stepz=10", f"hydra.run.dir={tmp_path / 'one'}"],
                 ["-m", "schedule=flush,zbhh1", f"hydra.sweep.dir={tmp_path / 'sweep'}"]):
        r = run_cli(argv, timeout=120)
        assert r.returncode == 1, r.stderr
        assert r.stderr.strip().count("\n") == 0 and r.stderr.startswith("config error: "), r.stderr
        assert not list(tmp_path.iterdir())  # no job (or sweep) directory was made
