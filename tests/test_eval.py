"""Held-out evaluation (framework/train/evaluate.py, the held-out data in framework/data/sources.py).

(a) What is held out: pycode's last data.val_files stdlib files, never in the training
stream; hf's last data.val_fraction of the training split's documents, or data.val_split;
synthetic tokens drawn with another seed. Turning evaluation on never changes training.
(b) Bad settings are rejected before launch.
(c) val_loss is one number for every synchronous layout with the same global batch: fp64
runs agree to FP64_TOL, evaluated directly on ranks (also ZeRO-3, whose gathered state an
evaluation must leave as a step does) and through the trainer's metrics.jsonl / summary.json.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from framework.config import ConfigError
from framework.data import TokenData, held_out_count, heldout_files, meta_path, prepare, stdlib_files
from framework.validate.heldout import check_eval

from .conftest import FP64, FP64_TOL, TINY, assert_config_error, compose, read_metrics, run_local
from .distributed import run_ranks
from .test_data import make_local_hf_dataset

ALL_STDLIB = stdlib_files(None, 0)


def _pycode(cache, *more):
    return compose("data=pycode", "data.max_files=3", "data.val_files=2", f"data.cache_dir={cache}",
                   "data.seq_len=16", "trainer.micro_batch_size=1", "schedule.microbatches=1", *more)


# ---- (a) what is held out ----

def test_pycode_holds_out_the_last_sorted_files_and_never_trains_on_them():
    assert ALL_STDLIB == sorted(ALL_STDLIB) and len(ALL_STDLIB) > 40
    assert heldout_files(20) == ALL_STDLIB[-20:] and heldout_files(0) == []
    for max_files in (None, 5, len(ALL_STDLIB) - 10, 10 ** 6):  # whatever max_files is
        train = stdlib_files(max_files, 20)
        assert not set(train) & set(heldout_files(20))
        assert train == ALL_STDLIB[:-20][:max_files]
    with pytest.raises(ConfigError, match="data.val_files"):
        stdlib_files(None, len(ALL_STDLIB))


def test_pycode_held_out_tokens_are_those_files_and_eval_leaves_training_alone(tmp_path):
    off = prepare(_pycode(tmp_path))
    assert off.val_tokens_path is None and off.val_num_samples == 0  # no held-out work without eval
    assert not list(tmp_path.glob("pycode-val-*"))
    train = np.load(off.tokens_path).copy()
    on = prepare(_pycode(tmp_path, "trainer.eval_interval=2"))
    assert on.tokens_path == off.tokens_path and np.array_equal(np.load(on.tokens_path), train)
    held = np.load(on.val_tokens_path)
    docs = [Path(f).read_text(encoding="utf-8") for f in heldout_files(2)]
    want = b"".join(d.encode() + b"\0" for d in docs if d)  # \0 stands for end-of-document here
    assert bytes(np.where(held == 256, 0, held).astype(np.uint8)) == want
    assert on.val_num_samples == (len(held) - 1) // 16
    meta = json.loads(meta_path(Path(on.val_tokens_path)).read_text())
    assert meta["inputs"]["sources"] == {"stdlib": [[f, os.path.getsize(f)] for f in heldout_files(2)],
                                         "part": "held out"}
    assert not set(ALL_STDLIB[-2:]) & {f for f, _ in json.loads(meta_path(Path(on.tokens_path)).read_text())
                                       ["inputs"]["sources"]["stdlib"]}


def _hf(tmp_path, path, tok, *more):
    return compose("data=hf", f"data.path={path}", "data.text_field=context", f"data.tokenizer={tok}",
                   f"data.cache_dir={tmp_path / 'cache'}", "data.seq_len=16", "trainer.micro_batch_size=1",
                   "schedule.microbatches=1", *more)


def _docs(tokens_path, tok_dir) -> list[str]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tok_dir).decode(np.load(tokens_path).astype(np.int64)).split(
        "<|endoftext|>")[:-1]


def test_hf_holds_out_the_last_fraction_of_the_documents(tmp_path):
    texts, path, tok = make_local_hf_dataset(tmp_path)
    json_args = (f"data.data_files={path}",)
    assert held_out_count(60, 0.1) == 6 and held_out_count(60, 0.001) == 1 and held_out_count(60, 0.0) == 0
    off = prepare(_hf(tmp_path, "json", tok, *json_args, "data.val_fraction=0.1"))
    on = prepare(_hf(tmp_path, "json", tok, *json_args, "data.val_fraction=0.1", "trainer.eval_interval=1"))
    assert off.val_tokens_path is None and on.tokens_path == off.tokens_path  # eval leaves training alone
    assert _docs(on.tokens_path, tok) == texts[:54] and _docs(on.val_tokens_path, tok) == texts[54:]
    assert json.loads(meta_path(Path(on.tokens_path)).read_text())["inputs"]["sources"]["held_out_fraction"] == 0.1
    everything = prepare(_hf(tmp_path, "json", tok, *json_args))  # no fraction: all documents trained on
    assert everything.tokens_path != on.tokens_path and _docs(everything.tokens_path, tok) == texts


def test_hf_evaluates_on_a_split(tmp_path):
    texts, _, tok = make_local_hf_dataset(tmp_path)
    data = tmp_path / "splits"
    data.mkdir()
    for name, part in (("train", texts[:40]), ("validation", texts[40:])):
        (data / f"{name}.jsonl").write_text("\n".join(json.dumps({"context": t}) for t in part))
    on = prepare(_hf(tmp_path, data, tok, "data.val_split=validation", "trainer.eval_interval=1"))
    assert _docs(on.tokens_path, tok) == texts[:40] and _docs(on.val_tokens_path, tok) == texts[40:]
    with pytest.raises(ConfigError, match="^data.val_split='test': could not be loaded"):
        prepare(_hf(tmp_path, data, tok, "data.val_split=test", "trainer.eval_interval=1"))


def test_synthetic_held_out_tokens_differ_from_training():
    run = compose("data=synthetic", "data.num_samples=64", "data.seq_len=16", "trainer.eval_interval=1",
                  "trainer.eval_batches=3", "trainer.micro_batch_size=2", "schedule.microbatches=2")
    p = prepare(run)
    assert p.val_tokens_path is None and p.val_num_samples == 3 * run.global_batch == 12
    train = TokenData.load(run, None).tokens
    held = TokenData.load_heldout(run, None, p.val_num_samples)
    assert held.num_samples == 12 and held.tokens.max() < 256
    assert not np.array_equal(held.tokens, train[:len(held.tokens)])
    assert np.array_equal(held.tokens, TokenData.load_heldout(run, None, 12).tokens)  # seeded
    assert prepare(compose("data=synthetic")).val_num_samples == 0


# ---- (b) rejections ----

REJECTED = [
    (["trainer.eval_interval=-1"], "trainer.eval_interval=-1", "must be >= 0"),
    (["trainer.eval_batches=0"], "trainer.eval_batches=0", "must be >= 1"),
    (["data.val_files=-1"], "data.val_files=-1", "must be >= 0"),
    (["data.val_fraction=1.0"], "data.val_fraction=1.0", "must be < 1"),
    (["data.val_fraction=-0.1"], "data.val_fraction=-0.1", "must be >= 0"),
    (["data=pycode", "data.val_files=0", "trainer.eval_interval=5"], "data.val_files=0", "needs held-out"),
    (["data=hf", "data.path=json", "trainer.eval_interval=5"], "trainer.eval_interval=5", "holds nothing out"),
    (["data=hf", "data.path=json", "data.val_split=validation", "data.val_fraction=0.1"], "data.val_fraction=0.1",
     "not both"),
    (["data=hf", "data.path=json", "data.val_split=train"], "data.val_split='train'", "is the training split"),
    (["parallelism=pp2", "schedule=1f1b", "model.tie_embeddings=false", "trainer.eval_interval=5"],
     "trainer.eval_interval=5", "never flushes"),
]


@pytest.mark.parametrize("overrides,head,problem", REJECTED)
def test_bad_eval_settings_are_rejected(overrides, head, problem):
    assert_config_error(overrides, head, problem)  # validate(), before launch: the schema's rules, then check_eval


def test_eval_settings_that_are_fine_pass():
    for overrides in ([], ["trainer.eval_interval=3"], ["data=synthetic", "trainer.eval_interval=1"],
                      ["data=hf", "data.path=json", "data.val_fraction=0.05", "trainer.eval_interval=1"],
                      ["data=hf", "data.path=json", "data.val_split=validation", "trainer.eval_interval=1"],
                      ["data=pycode", "data.val_files=0"]):  # holds nothing out, evaluates nothing
        check_eval(compose(*overrides))


def test_held_out_data_smaller_than_a_micro_batch_is_rejected(tmp_path):
    _, path, tok = make_local_hf_dataset(tmp_path)
    run = _hf(tmp_path, "json", tok, f"data.data_files={path}", "data.val_fraction=0.02",
              "data.seq_len=64", "trainer.micro_batch_size=4", "trainer.eval_interval=1")
    with pytest.raises(ConfigError, match=r"^data.val_fraction=0.02: the held-out data gives \d sequences"):
        prepare(run)


# ---- (c) val_loss equal across layouts ----

def test_every_dp_layout_evaluates_the_same_sequences_in_training_order():
    from framework.train.evaluate import eval_indices

    ref = np.concatenate(eval_indices(20, 2, 4, 0, 1, batches=3))
    assert ref.tolist() == [i % 20 for i in range(24)]  # unshuffled, wrapping a small held-out set
    for dp, m in ((2, 2), (4, 1)):
        ranks = [eval_indices(20, 2, m, r, dp, batches=3) for r in range(dp)]
        assert all(len(mbs) == 3 * m and all(len(mb) == 2 for mb in mbs) for mbs in ranks)
        got = np.concatenate([np.concatenate(ranks[r][b * m:(b + 1) * m]) for b in range(3) for r in range(dp)])
        assert np.array_equal(got, ref)


def _eval_rank(rank: int, world: int, run, info, prepared) -> dict:
    """Evaluate, train a step, twice, then evaluate again: the val losses and rank state."""
    from framework.train.evaluate import HeldOut, evaluate
    from framework.topology import ParallelContext, ParallelDims
    from framework.train.trainer import Batches, build_runner, train_step

    torch.set_num_threads(1)
    p = run.parallelism
    ctx = ParallelContext.create(ParallelDims.of(p), rank, torch.device("cpu"))
    runner, _ = build_runner(run, info, ctx)
    batches = Batches(run, info, ctx)
    heldout = HeldOut(run, prepared.val_tokens_path, prepared.val_num_samples, ctx)
    modes = [m.training for m in runner.module.modules()]
    vals = []
    for step in range(run.trainer.steps):
        vals.append(evaluate(runner, heldout, run, ctx))
        train_step(step, runner, batches, run, ctx)
    vals.append(evaluate(runner, heldout, run, ctx))
    zero = getattr(runner, "zero", None)
    return {"vals": vals, "modes_kept": modes == [m.training for m in runner.module.modules()],
            "gathered": [f.gathered for f in zero.flat] if zero is not None and zero.stage == 3 else []}


def _direct(data_cache, *layout):
    from framework.launch.job import run_info

    run = compose(*TINY, *layout, "data=pycode", "data.max_files=20", f"data.cache_dir={data_cache}", FP64,
                  "model.n_layer=4", "trainer.steps=2", "trainer.eval_interval=1", "trainer.eval_batches=2",
                  "optimizer.lr=3e-3")
    prepared = prepare(run)
    out = run_ranks(_eval_rank, run.world_size, run, run_info(run, "cpu"), prepared, timeout=300)
    assert all(r["modes_kept"] for r in out)  # train / eval mode restored
    assert all(r["vals"] == out[0]["vals"] for r in out)  # the same float on every rank
    return out


@pytest.fixture(scope="module")
def direct_single(data_cache):
    return _direct(data_cache, "parallelism=single", "schedule.microbatches=4")[0]["vals"]


def _assert_single_process_val_loss(out: list[dict], direct_single: list[float]) -> None:
    vals = out[0]["vals"]
    assert len(vals) == 3 and vals[0] != vals[1] != vals[2] and all(math.isfinite(v) for v in vals)
    torch.testing.assert_close(torch.tensor(vals, dtype=torch.float64),
                               torch.tensor(direct_single, dtype=torch.float64), **FP64_TOL)


def test_zero3_evaluates_the_single_process_val_loss_and_leaves_no_unit_gathered(direct_single, data_cache):
    out = _direct(data_cache, "parallelism=zero3", "schedule.microbatches=2")
    _assert_single_process_val_loss(out, direct_single)
    assert all(r["gathered"] for r in out)  # every rank holds ZeRO-3 units ...
    assert not any(any(r["gathered"]) for r in out)  # ... and evaluation left none gathered, as between steps


def test_tp2_pp2_interleaved_sp_evaluates_the_single_process_val_loss(direct_single, data_cache):
    out = _direct(data_cache, "parallelism=tp2_pp2", "parallelism.sequence_parallel=true", "schedule=interleaved",
                  "schedule.microbatches=4", "schedule.virtual_stages=2")
    _assert_single_process_val_loss(out, direct_single)


def test_cp2_tp2_evaluates_the_single_process_val_loss(direct_single, data_cache):
    """Context parallel evaluation: each cp rank's mean over its tokens, averaged."""
    out = _direct(data_cache, "parallelism=tp2", "parallelism.cp=2", "schedule.microbatches=4")
    _assert_single_process_val_loss(out, direct_single)


LAYOUTS = {"single": ["parallelism=single", "schedule.microbatches=4"],
           "dp2": ["parallelism=dp2", "schedule.microbatches=2"],
           "tp2": ["parallelism=tp2", "schedule.microbatches=4"],
           "pp2_flush": ["parallelism=pp2", "schedule=flush", "schedule.microbatches=4"],
           "single_4_layers": ["parallelism=single", "schedule.microbatches=4", "model.n_layer=4"],
           "pp2_interleaved": ["parallelism=pp2", "schedule=interleaved", "schedule.microbatches=4",
                               "schedule.virtual_stages=2", "model.n_layer=4"],
           # a V: pp rank 1 holds stages 1 and 2, handed over in memory; rank 0 the first and the last
           "pp2_zbv": ["parallelism=pp2", "schedule=zbv", "schedule.microbatches=4", "model.n_layer=4"]}
REFERENCE = {"dp2": "single", "tp2": "single", "pp2_flush": "single", "pp2_interleaved": "single_4_layers",
             "pp2_zbv": "single_4_layers"}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, data_cache):
    out = {}
    for name, layout in LAYOUTS.items():
        job = tmp_path_factory.mktemp(f"eval_{name}")
        summary = run_local(job, *TINY, *layout, "data=pycode", "data.max_files=20", f"data.cache_dir={data_cache}",
                            FP64, "trainer.steps=4", "trainer.eval_interval=2", "trainer.eval_batches=2",
                            "trainer.log_interval=4", "optimizer.lr=3e-3")
        out[name] = summary, read_metrics(job)
    return out


def _val_losses(metrics: list[dict]) -> list[float]:
    rows = {m["step"]: m for m in metrics}
    assert all(("val_loss" in rows[s]) == (s in (2, 4)) for s in rows), metrics
    return [rows[2]["val_loss"], rows[4]["val_loss"]]


@pytest.mark.parametrize("layout", REFERENCE)
def test_val_loss_is_equal_across_layouts(trained, layout):
    summary, metrics = trained[layout]
    ref_summary, ref_metrics = trained[REFERENCE[layout]]
    vals, ref = _val_losses(metrics), _val_losses(ref_metrics)
    for v, rows in ((vals, metrics), (ref, ref_metrics)):
        assert all(isinstance(x, float) and math.isfinite(x) for x in v)
        assert v[0] != v[1] and all(x != r["loss"] for x, r in zip(v, [rows[1], rows[3]]))  # rows of steps 2 and 4
    torch.testing.assert_close(torch.tensor(vals, dtype=torch.float64), torch.tensor(ref, dtype=torch.float64),
                               **FP64_TOL)
    assert summary["val_loss"] == vals[-1] and ref_summary["val_loss"] == ref[-1]
