"""How long each engine took to start the last time, kept in the cache directory, so that a start's progress
lines say what to expect (``fp16: 35 s so far, last start 61 s``): a first start on a CPU can take minutes,
and a user watching it should know whether it is stuck."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path


class StartHistory:
    """Engine -> seconds its last start took, in one small JSON file. A courtesy: a file that cannot be read or
    written is an empty history."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        try:
            self._seconds: dict[str, float] = json.loads(path.read_text())
        except (OSError, ValueError):
            self._seconds = {}

    def last(self, key: str) -> float | None:
        return self._seconds.get(key)

    def record(self, key: str, seconds: float) -> None:
        with self._lock:
            self._seconds[key] = round(seconds, 1)
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(json.dumps(self._seconds, indent=1, sort_keys=True))
                tmp.replace(self.path)
            except OSError:
                pass
