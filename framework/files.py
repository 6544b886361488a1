"""How the framework writes and reads its own files, one way: a file is written whole or
not at all (`write_atomic`: a temporary beside it, then a rename), and a JSON file a user
names is read with a ConfigError naming the key that pointed at it (`read_json`), never a
traceback. Here, low, because the job's writers (report/), its readers (validate/, launch/)
and the run's calibration (metrics/) all need the two."""

from __future__ import annotations

import json
import os
from typing import Any, Optional

from framework.commands import ConfigError, first_line


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


def read_json(key: str, name: Any, path: str, fix: str, max_bytes: Optional[int] = None) -> Any:
    """The JSON file at `path`, or a ConfigError naming `key`: unreadable, over `max_bytes`
    (None: no limit), not UTF-8, not JSON or nested past the parser's depth. Its shape is the
    caller's to check."""
    label = os.path.basename(path)
    try:
        with open(path, "rb") as f:
            data = f.read() if max_bytes is None else f.read(max_bytes + 1)
    except OSError as e:
        raise ConfigError(key, name, f"{label} is not readable ({e.strerror or e})", fix) from None
    if max_bytes is not None and len(data) > max_bytes:
        raise ConfigError(key, name, f"{label} is over {max_bytes >> 20} MiB: not the file this expects", fix)
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError; '[[[[...' past the depth
        raise ConfigError(key, name, f"{label} is not valid JSON ({first_line(e)})", fix) from None
