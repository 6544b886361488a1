"""The exported model: a transformers directory (`save_pretrained`) that
`AutoModelForCausalLM.from_pretrained` loads and `model.pretrained` accepts for the next run.

Written by the logging rank from the merged state dict (framework.trainer.save_checkpoint):
`config.json` (the run's transformers config: its real sizes and vocabulary), the weights
as safetensors, and the tokenizer when it is a transformers one. With `data.tokenizer=bytes`
there is no tokenizer to save: token ids are UTF-8 bytes (0-255) and 256 ends a document
(framework.data.ByteTokenizer); train further with `data.tokenizer=bytes`.
The directory is built under a temporary name and renamed when complete.
"""

from __future__ import annotations

import os
import shutil

import torch

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
