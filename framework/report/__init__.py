"""Where a run's numbers go, and how runs are compared.

- sinks.py        the logging rank: console, metrics.jsonl, summary.json, W&B (flat layout keys)
- records.py      typed per-step records from a runner to the logging rank
- progress.py     the live progress line; run.log
- wandb_sink.py   W&B mode, credentials, reachability probe, offline fallback
- files.py        atomic writes of a job's files; failure reports that survive a full disk
- export.py       the exported transformers directory (final_model/)
- compare.py      `python -m framework.report <sweep dir>`: report.md / .csv, fairness warnings
- dashboard.py, dashboard_moe.py, dashboard_parts.py  report.html, the offline dashboard
"""
