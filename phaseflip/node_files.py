"""Node-scoped shared-memory files (the weight image, HiCache's host tier): their names, and
sweeping the ones whose engine is gone.

A file is named `phaseflip-<kind>-<pid>-<random>` after the engine process that made it. A
killed engine (SIGKILL, OOM killer) cannot unlink its own, and a tmpfs file holds its memory
until reboot, so every engine that makes a file of a kind first removes that kind's files
whose process no longer runs.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)


def shm_dir() -> Path:
    """/dev/shm (tmpfs) where there is one, else the temporary directory."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() else Path(tempfile.gettempdir())


def node_file_path(kind: str, directory: Path | None = None) -> Path:
    """A fresh name for this process's file of `kind` (e.g. 'weights', 'hicache')."""
    return (directory or shm_dir()) / f"phaseflip-{kind}-{os.getpid()}-{os.urandom(4).hex()}"


def remove_stale(kind: str, directory: Path | None = None) -> list[Path]:
    """Unlinks the `kind` files in `directory` whose process is gone; returns them."""
    removed = []
    for f in (directory or shm_dir()).glob(f"phaseflip-{kind}-*-*"):
        try:
            pid = int(f.name.split("-")[2])
        except (IndexError, ValueError):
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            f.unlink(missing_ok=True)
            removed.append(f)
            log.warning("removed %s, left by the gone process %d", f, pid)
        except PermissionError:
            pass  # another user's live process
    return removed
