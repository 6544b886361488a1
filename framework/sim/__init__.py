"""The simulator: what a pipeline (and an ep all-to-all) layout costs, from a run's own timings.

- clock.py     the schedule model's clock: unit-time lists (the dry run's grid, the schedule
               model's bubble) and the calibrated clock under gloo's or NCCL's rules; the
               checker (framework/parallel/pipeline/check.py) and the p2p plan use it too
- calibrate.py a run's bounded calibration (calibration.json): op times, gaps, link cost
- replay.py    a run replayed at its own durations (`predicted_*` in metrics), and the
               replay of any plan at given durations (what the what-ifs call)
- whatif.py    rescale a calibration to another schedule / m / v / pp
- source.py    the job a what-if predicts from: its files checked, other work refused
- alltoall.py  expert parallelism's all-to-all: byte model and cost
- sweep.py     search.mode=simulate: predict a sweep's jobs, run the best top_k
- cli.py       `python -m framework.simulate <job dir> [overrides]` (and `--op-times`, optimes.py)
- optimes.py   a schedule at given op times, no job: the zero-bubble paper's bubble beside ours
- bench.py     `python -m framework.sim.bench`: a device's hardware profile by micro-benchmark
- cost/        the cost model: op lists, hardware profile, collectives, a layout's price (docs/cost_model.md)
"""
