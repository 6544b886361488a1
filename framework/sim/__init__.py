"""The simulator: what a pipeline (and an ep all-to-all) layout costs, from a run's own timings.

It reads the schedule model (framework/schedules/: lists, clock, NCCL model) and a run's
calibration and replay (framework/metrics/calibrate.py, replay.py: the run's own prediction).

- whatif.py    rescale a calibration to another schedule / m / v / pp
- source.py    the job a what-if predicts from: its files checked, other work refused
- alltoall.py  expert parallelism's all-to-all: byte model and cost
- sweep.py     search.mode=simulate: predict a sweep's jobs, run the best top_k
- cli.py       `python -m framework.simulate <job dir> [overrides]` (and `--op-times`, optimes.py)
- optimes.py   a schedule at given op times, no job: the zero-bubble paper's bubble beside ours
- bench.py     `python -m framework.sim.bench`: a device's hardware profile by micro-benchmark
- cost/        the cost model: op lists, hardware profile, collectives, a layout's price (docs/cost_model.md)
"""
