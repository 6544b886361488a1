"""Sharded, layout-free distributed checkpoints: each rank writes what it holds; any layout resumes any checkpoint.

Written with `torch.distributed.checkpoint` (DCP) to `<job>/checkpoints/step_<k>/` after k
optimizer steps. Every tensor is stored under its single-process name and shape, whatever
the layout that saved it, as boxes with global offsets (DCP's chunk metadata):
- `model/<transformers name>`: the parameter. Each rank writes only its own boxes: its tp
  shard (vocab padding left out), its ZeRO slice, its stage's names. Nothing is gathered.
- `optim/<transformers name>/<state>`: the optimizer state of that parameter (AdamW's
  `exp_avg`, `exp_avg_sq`, `step`), cut the same way as the parameter.
- `rng/rank<r>` (and `rng_cuda/rank<r>`): each rank's generator state, restored only when
  the resuming layout is the same (dropout draws are per rank; with dropout 0 nothing reads them).
Beside DCP's files: `meta.json` (step, layout, model sizes, precision, optimizer, data, global
batch, the checkpoint it resumed from), `metrics.jsonl` (the run's rows up to step k, so a
resumed run's file is whole) and, written last and atomically, `COMPLETE`: a checkpoint
without it is ignored and replaced.

A load (`load.py`) reads, on each rank, only the stored boxes overlapping what it holds. The
data position is the step alone (the sampler is a function of seed, step and global batch)
and the lr schedule a function of the step, so neither is stored.

Files: `shards.py` (what a rank holds, as boxes; DCP's protocol and planners), `save.py`
(staging, the background write, failures), `load.py`, `store.py` (finding, pruning, one
lineage, whether a job is done), `resume.py` (what a resume may load: the path, meta.json, every
recorded size and stored shape against the run).
"""

from framework.checkpoint.load import load
from framework.checkpoint.save import CheckpointWriteError, Saver, layout_of
from framework.checkpoint.resume import check_compatible, read_meta, resolve_resume
from framework.checkpoint.store import (CHECKPOINTS_DIR, MARKER, META, METRICS, checkpoints, finished, history,
                    is_complete, latest, prune, set_aside_newer, step_dir)

__all__ = ["CHECKPOINTS_DIR", "MARKER", "META", "METRICS", "CheckpointWriteError", "Saver", "check_compatible",
           "checkpoints", "finished", "history", "is_complete", "latest", "layout_of", "load", "prune", "read_meta",
           "resolve_resume", "set_aside_newer", "step_dir"]
