"""Pipeline parallelism at run time. The schedules as data, their p2p plan and the NCCL model
that proves them are framework/schedules/ (below config, which checks names against them);
here: blocks -> stages (partition.py, stage.py), one rank's executor
(executor.py), the split backward (split_backward.py), weight versions for the asynchronous
schedules (weights.py) and their single-process reference (reference.py). The training step
around the executor is framework/train/pipeline_runner.py."""
