"""Files the server keeps state in (measured costs, a learned policy's state, gate reports), written whole."""

from __future__ import annotations

import os
from pathlib import Path


def replace_whole(path: Path, text: str) -> None:
    """Write ``text`` to a file of this process's own beside ``path``, then rename it over ``path``: a reader
    meanwhile (another server sharing the file, the replicas of a cluster) reads the old file or the new one, and a
    crash never leaves half of one. Processes writing the same file never share the temporary one."""
    written = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    written.write_text(text)
    written.replace(path)
