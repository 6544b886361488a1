"""The optimizer, below `parallel/` and `train/` so both build on it: `build.py` (the
configured torch optimizer, its implementation, the learning-rate schedule) and `master.py`
(the fp32 master weights in one flat buffer, ZeRO-Offload's host copy). ZeRO (parallel/zero.py)
and both runners (train/) step through it; it imports only the policies."""
