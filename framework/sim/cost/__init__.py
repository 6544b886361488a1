"""The cost model: a layout's step from op shapes and a hardware profile, no run (docs/cost_model.md).

- shapes.py       a model's shapes from `model.*` (no build; a 405B preset is a few integers), `Layout`
- ops.py          one micro-batch's ops per pass (F, I, W) on one rank, executed and model FLOPs
- hardware.py     a hardware profile (conf/hardware/ to come; `python -m framework.sim.bench` measures one)
- collectives.py  NCCL's algorithms as alpha-beta over the link a group crosses (topology.py's order)
- price.py        the composition: stage times -> the schedule clock -> dp / ZeRO / optimizer -> step, MFU
"""
