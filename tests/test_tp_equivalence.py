"""Tensor parallelism reproduces the single process: GPT-2 and Llama at tp = 2 and 4, with
sequence parallelism, with pp (tp2_pp2) and as 3-D dp 2 x tp 2 x pp 2 (flush, interleaved).

Same global batch (8 sequences) everywhere; in fp64, per-step losses, gradient norms and the
final parameters (gathered over tp into transformers' shapes) agree to rtol 1e-9
(conftest.py); the fp32 run (llama tp4) tracks the fp64 single process's losses to 1e-5. The
byte tokenizer's 257 tokens do not divide by 2 or 4, so every run also proves the vocab
padding stays out of the loss. The per-rank accounting is checked exactly: parameter
bytes against the sharding formula, tp bytes per step against the collectives' count
(GPT-2 runs are fp64: 8 bytes an element).
"""

import pytest

from .conftest import (FP64, TINY, assert_same_losses_fp32, assert_same_training, compose, final_params, read_metrics,
                       run_local)

MODELS = {
    "gpt2": ["model=gpt2-tiny", "model.n_layer=4", "model.n_embd=32", "model.n_head=4"],
    # 8 query heads over 4 key-value heads: grouped-query attention survives tp = 4
    "llama": ["model=llama-tiny", "model.n_layer=4", "model.n_embd=32", "model.n_head=8", "model.n_kv_head=4",
              "model.n_inner=64"],
}
SP = "parallelism.sequence_parallel=true"
LAYOUTS = {
    "single": ["parallelism=single", "schedule.microbatches=4"],
    "tp2": ["parallelism=tp2", "schedule.microbatches=4"],
    "tp4": ["parallelism=tp4", "schedule.microbatches=4"],
    "tp2_sp": ["parallelism=tp2", "schedule.microbatches=4", SP],
    "tp2_pp2_flush_sp": ["parallelism=tp2_pp2", "schedule=flush", "schedule.microbatches=4", SP],
    "3d_flush": ["parallelism=3d_2x2x2", "schedule=flush", "schedule.microbatches=2"],
    "3d_interleaved": ["parallelism=3d_2x2x2", "schedule=interleaved", "schedule.microbatches=2"],
}
CASES = [("gpt2", k) for k in LAYOUTS if k != "single"] + [("llama", k) for k in ("tp2", "tp4", "tp2_sp")]
FP32 = ("llama", "tp4")  # the family's one fp32 run: loss level only
FP64_BYTES = 8


def _common(data_cache):
    return [*[a for a in TINY if not a.startswith("model.")], "data=pycode", "data.max_files=20",
            f"data.cache_dir={data_cache}", "trainer.steps=3", "trainer.warmup_steps=1",
            "trainer.save_checkpoint=true", "optimizer.lr=3e-3"]


def _args(data_cache, model, layout):
    return [*MODELS[model], *LAYOUTS[layout], *_common(data_cache), *([] if (model, layout) == FP32 else [FP64])]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache, shared_run):
    # the GPT-2 single process is test_zero.py's composition reference too: run once
    out = {("gpt2", "single"): shared_run(*_args(data_cache, "gpt2", "single"))}
    for model, layout in [("llama", "single"), *CASES]:
        job = tmp_path_factory.mktemp(f"{model}_{layout}")
        summary = run_local(job, *_args(data_cache, model, layout))
        out[model, layout] = (summary, read_metrics(job), final_params(job))
    return out


@pytest.mark.parametrize("model,layout", CASES, ids=[f"{m}-{k}" for m, k in CASES])
def test_tensor_parallel_reproduces_the_single_process(runs, model, layout):
    ref_summary, ref_metrics, ref_params = runs[model, "single"]
    summary, metrics, params = runs[model, layout]
    assert summary["tp"] in (2, 4) and summary["global_batch"] == ref_summary["global_batch"] == 8
    assert summary["sequence_parallel"] == ("sp" in layout)
    if (model, layout) == FP32:
        assert_same_losses_fp32(metrics, ref_metrics)
    else:
        assert_same_training(metrics, params, ref_metrics, ref_params)
    assert metrics[-1]["loss"] < metrics[0]["loss"]


def _gpt2_params(tp: int, vocab: int = 257, h: int = 32, layers: int = 4, positions: int = 256) -> int:
    """GPT-2 parameters one tp rank holds: matrices and column biases split, the rest whole."""
    vocab_rows = -(-vocab // tp)  # padded vocabulary / tp
    block = 4 * h + (3 * h * h + 3 * h) // tp + h * h // tp + h + (4 * h * h + 4 * h) // tp + 4 * h * h // tp + h
    return vocab_rows * h + positions * h + layers * block + 2 * h  # tied head: no extra rows


@pytest.mark.parametrize("layout,tp", [("single", 1), ("tp2", 2), ("tp4", 4)])
def test_parameter_bytes_per_rank_shrink_as_the_sharding_says(runs, layout, tp):
    ranks = runs["gpt2", layout][0]["ranks"]
    assert len(ranks) == tp
    assert {r["params_bytes"] for r in ranks} == {FP64_BYTES * _gpt2_params(tp)}


def _gpt2_tp_bytes(tp: int, sp: bool, m: int = 4, b: int = 2, t: int = 32, h: int = 32, layers: int = 4,
                   e: int = FP64_BYTES) -> int:
    """Bytes a rank sends in tp collectives per step (ring counts, tp_comm.py), by hand;
    `e` bytes an element."""
    act = b * t * h * e
    share = (tp - 1) / tp
    # (B, T, H) transitions per micro-batch: embedding exit, 2 entries and 2 exits per block,
    # head entry, each once forward and once backward (all-reduce = 2x the share; with
    # sequence parallelism each is one all-gather or reduce-scatter of the share).
    per_mb = (2 + 4 * layers) * act * 2 * share
    if sp:  # backward gathers each block's two entries and the head's input again
        per_mb += (2 * layers + 1) * act * share
    per_mb += 3 * b * t * e * 2 * share  # cross-entropy: max, target logit, sum of exp per token
    total = m * per_mb + e * 2 * share  # the step's gradient-norm all-reduce (one float)
    if sp:  # replicated parameters' gradients: norms, row biases, position table
        total += (256 * h + layers * 6 * h + 2 * h) * e * 2 * share
    return int(total)


@pytest.mark.parametrize("layout,tp,sp", [("tp2", 2, False), ("tp4", 4, False), ("tp2_sp", 2, True)])
def test_tp_bytes_per_step_are_counted_exactly(runs, layout, tp, sp):
    metrics = runs["gpt2", layout][1]
    assert {m["tp_comm_bytes"] for m in metrics} == {_gpt2_tp_bytes(tp, sp)}
    assert runs["gpt2", "single"][1][0]["tp_comm_bytes"] == 0


@pytest.mark.parametrize("tp", [2])
def test_sequence_parallelism_cuts_activation_memory(runs, tp):
    full = runs["gpt2", f"tp{tp}"][0]["activation_peak_bytes_max"]
    sp = runs["gpt2", f"tp{tp}_sp"][0]["activation_peak_bytes_max"]
    assert sp < 0.9 * full, (sp, full)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_dry_run_estimate_counts_the_same_shards(tp):
    from framework.launch.job import meta_model
    from framework.launch.plan import make_plan
    from framework.validate import validate_model

    run = compose(*MODELS["gpt2"], "parallelism=single", f"parallelism.tp={tp}", "dry_run=true")
    model = meta_model(run, 257)
    plan = make_plan(run, model, validate_model(run, model))
    assert plan["memory_estimate_per_rank"][0]["params_bytes"] == 4 * _gpt2_params(tp)
