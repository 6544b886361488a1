"""Measurements every run takes: FLOPs / MFU (flops.py), memory (memory.py), bubble (bubble.py),
where the step goes (breakdown.py), and the prediction that stands beside them: the run's
bounded calibration (calibrate.py, calibration.json) and its replay at its own durations
(replay.py, the `predicted_*` metrics), which the simulator's what-ifs also call. The
timers a collective is wrapped in are framework/comm/comm_timer.py (below models)."""
