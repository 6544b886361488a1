"""Pipeline parallelism: schedules as data (schedules/, proved by check.py), the p2p plan
(p2p.py, messages.py), blocks -> stages (partition.py, stage.py), one rank's executor
(executor.py), the split backward (split_backward.py), weight versions for the asynchronous
schedules (weights.py) and their single-process reference (reference.py). The training step
around the executor is framework/train/pipeline_runner.py; the clock that checks and places
the p2p ops is framework/parallel/pipeline/clock.py."""
