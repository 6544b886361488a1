"""Launching ranks and telling how they ended, one module per concern:

- local.py      the local launch: the torch elastic agent starts world_size ranks on this node
- watchdog.py   the hang watchdog: reads the ranks' flight recorders, ends a stalled job
- diagnosis.py  how the ranks ended: root cause first, then the consequences, in one block
- node.py       one node of a multi-node job (`python -m framework.launch.node`): torchrun's agent,
                the watchdog, and the exit path that writes the job's error.txt / summary.json
                (not imported here: it is a program)

The rank side is framework/worker.py; this package only reads what the ranks leave.
"""

from .diagnosis import RankEnd, RankFailure, diagnose, read_records
from .local import launch_local
from .watchdog import HANG_FILE, Watchdog, hang_text

__all__ = ["HANG_FILE", "RankEnd", "RankFailure", "Watchdog", "diagnose", "hang_text", "launch_local", "read_records"]
