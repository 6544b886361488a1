"""Pipeline parallelism: schedules as data (schedules.py, proved by check.py), blocks ->
stages (partition.py, stage.py), one rank's executor (executor.py) and training step
(runner.py), weight versions for the asynchronous schedules (weights.py) and their
single-process reference (reference.py)."""
