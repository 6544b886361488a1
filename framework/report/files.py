"""Writing a job's files: atomically, so a reader never sees half a file as a result."""

from __future__ import annotations

import os
import sys


def write_atomic(path: str, text: str) -> None:
    """Write to `path.tmp`, then rename over `path` (raises OSError on failure)."""
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise


def write_report(path: str, text: str, who: str = "") -> bool:
    """A failure report: atomically and never raising (it must survive a full disk); a
    failed write is said on stderr instead. Returns whether it was written."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_atomic(path, text)
        return True
    except OSError as e:
        print(f"{who}could not write {path}: {e}", file=sys.stderr, flush=True)
        return False
