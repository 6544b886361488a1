"""The exported model: a transformers directory (`save_pretrained`) that
`AutoModelForCausalLM.from_pretrained` loads and `model.pretrained` accepts for the next run.

Written by the logging rank from the merged state dict (`save_final_model`, at the end of a run
with trainer.save_checkpoint=true; final_model.pt beside it):
`config.json` (the run's transformers config: its real sizes and vocabulary), the weights
as safetensors, and the tokenizer when it is a transformers one. With `data.tokenizer=bytes`
there is no tokenizer to save: token ids are UTF-8 bytes (0-255) and 256 ends a document
(framework.data.ByteTokenizer); train further with `data.tokenizer=bytes`.
The directory is built under a temporary name and renamed when complete.
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import Optional

import torch
import torch.distributed as dist

from framework.parallel.pipeline.stage import stage_state_dict

EXPORT_DIR = "final_model"


def export_pretrained(state: dict[str, torch.Tensor], hf_config, tokenizer: str | None, job_dir: str) -> str:
    """`state`: every parameter under its transformers name (tied copies included)."""
    from transformers import AutoModelForCausalLM

    dtype = next(iter(state.values())).dtype
    model = AutoModelForCausalLM.from_config(hf_config, torch_dtype=dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {k for k in missing if _is_tied(model, k)}
    if unexpected or set(missing) - tied:
        raise RuntimeError(f"export: state dict does not fit {type(model).__name__}: "
                           f"missing {sorted(set(missing) - tied)}, unexpected {sorted(unexpected)}")
    final = os.path.join(job_dir, EXPORT_DIR)
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    if tokenizer:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(tokenizer).save_pretrained(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final


def _is_tied(model, name: str) -> bool:
    """A parameter the model shares with another one (the tied LM head)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    return name in params and any(p is params[name] for n, p in params.items() if n != name)


def save_final_model(runner, full, ctx, job_dir: str, tokenizer: Optional[str] = None) -> None:
    """final_model.pt (transformers parameter names, merged over pipeline stages and tp on
    rank 0) and final_model/, the same weights as a transformers directory (framework.report.export)."""
    zero = getattr(runner, "zero", None)
    if zero is not None and (zero.stage == 3 or getattr(zero, "sharded_between_steps", False)):
        zero.gather_all()  # parameters are sharded over dp between steps (FSDP2: at zero 2 too)
    # Every tp rank of dp replica 0 joins the gather of its shards, every ep rank of it (the
    # first dp ranks) the gather of the experts; tp rank 0 of dp rank 0 contributes them.
    c = ctx.coords
    part = (stage_state_dict(full, runner.chunks, runner.tp_comm, getattr(full, "ep_comm", None))
            if ctx.dims.edp_rank(c) == 0 else {})
    part = _own_tied_copy(part, runner, full) if c.tp == 0 and c.dp == 0 else {}
    parts = [None] * ctx.dims.world_size if ctx.rank == 0 else None
    dist.gather_object(part, parts, dst=0, group=ctx.log_group)  # CPU objects: gloo under NCCL too
    if ctx.rank == 0:
        ctx.recorder.note("write final_model.pt (rank 0)")
        merged = {k: v for p in parts for k, v in p.items()}
        path = os.path.join(job_dir, "final_model.pt")
        torch.save(merged, path + ".tmp")
        os.replace(path + ".tmp", path)
        ctx.recorder.note("write final_model/ (rank 0)")
        export_pretrained(merged, full.hf_model.config, tokenizer, job_dir)
        note = routing_not_exported(getattr(full, "moe", None))
        if note:
            print(f"WARNING: final_model/ {note}", file=sys.stderr, flush=True)


def _own_tied_copy(part: dict, runner, full) -> dict:
    """A pipeline's two copies of a tied embedding, each under its own name: the stage that
    embeds keeps the input embedding's name, the last stage the head's (each exports both
    names from its one copy, and the merge kept the last stage's for both, so the first
    stage's copy was never seen). final_model.pt then holds both copies, which tests compare
    with the single process; they are equal unless the tied-gradient sum is wrong. A rank
    holding both uses (one process, a V's pp rank 0: `runner.tied` is None) has one copy."""
    if getattr(runner, "tied", None) is None:
        return part
    hf = full.hf_model
    where = {id(m): n for n, m in hf.named_modules(remove_duplicate=False)}
    embeds = any(ch.embedding is not None for ch in runner.chunks)
    other = hf.get_output_embeddings() if embeds else hf.get_input_embeddings()
    return {k: v for k, v in part.items() if k != f"{where[id(other)]}.weight"}


def routing_not_exported(moe) -> Optional[str]:
    """What a transformers Qwen3-MoE config cannot say about how this model routed (it knows
    softmax top-k only): the exported model then computes a different function."""
    if moe is None:
        return None
    c = moe.cfg
    lost = [f"score={c.score}"] * (c.score != "softmax") + \
        [f"capacity_factor={c.capacity_factor}"] * (c.capacity_factor not in (None, float("inf"))) + \
        ["the expert biases (bias_update_rate > 0)"] * (c.bias_update_rate > 0)
    return (f"routes as transformers' Qwen3-MoE (softmax top-k, dropless, no expert bias); this run trained "
            f"with {', '.join(lost)}, which its config.json cannot hold") if lost else None


def transformers_tokenizer(run) -> Optional[str]:
    """The tokenizer to export beside the model: None for synthetic data and bytes."""
    return None if run.data.name == "synthetic" or run.data.tokenizer == "bytes" else run.data.tokenizer
