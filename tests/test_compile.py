"""trainer.compile=blocks (framework/models/compile.py): each transformer block compiled,
equal to eager in fp64 (rtol 1e-9: losses, gradient norms, every final parameter) and
compiling only in the first step (the `compiles` metric: frames compiled per step, 0 in
every measured step). Three compiled launches cover the layouts (`aot_eager` traces the
same forward and backward graphs inductor compiles, at a fraction of its build time on
this CPU): pp 2 x tp 2 + SP with the split-backward zbh1 schedule and full recomputation;
dp 2 x cp 2 ring under FSDP2; and the single process with selective recomputation under
inductor (gcc-built kernels). What cannot compile is refused before launch
(tests/test_config.py's BAD list: our ZeRO 3, MoE, metrics.skip_first=0)."""

import pytest

from .conftest import FP64, assert_same_training, final_params, read_metrics, run_local

COMMON = ["model=gpt2-tiny", "model.n_layer=2", "model.n_embd=32", "model.n_head=4", "data=synthetic",
          "data.seq_len=32", "trainer.steps=3", "trainer.micro_batch_size=1", "metrics.skip_first=1", "logger=none",
          "trainer.log_interval=1", "trainer.save_checkpoint=true", FP64]
COMPILED = ["trainer.compile=blocks", "trainer.compile_backend=aot_eager"]
LAYOUTS = {
    "pp2_tp2_sp_zbh1_full": ["parallelism=tp2_pp2", "parallelism.sequence_parallel=true", "schedule=zbh1",
                             "schedule.microbatches=4", "trainer.recompute=full", *COMPILED],
    "dp2_cp2_ring_fsdp2": ["parallelism=dp2", "parallelism.cp=2", "parallelism.cp_comm=ring", "parallelism.zero=3",
                           "parallelism.zero_impl=fsdp2", "schedule.microbatches=2", *COMPILED],
    "single_inductor_selective": ["parallelism=single", "schedule.microbatches=4", "trainer.recompute=selective",
                                  "trainer.compile=blocks", "trainer.compile_backend=inductor"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for name, layout in {"eager": ["parallelism=single", "schedule.microbatches=4"], **LAYOUTS}.items():
        job = tmp_path_factory.mktemp(name)
        summary = run_local(job, *COMMON, *layout)
        out[name] = (summary, read_metrics(job), final_params(job))
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_compiled_blocks_train_as_eager_and_compile_only_in_the_first_step(runs, layout):
    _, ref_metrics, ref_params = runs["eager"]
    summary, metrics, params = runs[layout]
    assert_same_training(metrics, params, ref_metrics, ref_params)
    compiles = [m["compiles"] for m in metrics]
    assert compiles[0] > 0 and compiles[1:] == [0, 0], compiles
    assert summary["compiles_warmup"] == compiles[0] and summary["compiles_measured"] == 0
    assert summary["compile_s"] > 0
    assert "compiles" not in runs["eager"][1][0] and "compile_s" not in runs["eager"][0]
