# Loaded by every Python process when this folder is on PYTHONPATH (gpu.sh's sync count only):
# with COUNT_SYNCS=1 each host-device synchronisation warns (torch.cuda.set_sync_debug_mode),
# every time, so the log's count over two run lengths gives the syncs per step.
import os

if os.environ.get("COUNT_SYNCS") == "1":
    import warnings

    import torch

    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode("warn")
