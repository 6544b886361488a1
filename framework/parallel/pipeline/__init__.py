"""Pipeline parallelism: partition of blocks into stages (schedules and executor follow)."""
