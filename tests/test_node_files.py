"""Shared-memory files of engines that are gone are swept by the next engine that makes one."""

from __future__ import annotations

import os
import subprocess
import sys

from phaseflip.cache.hicache.frames import shared_frames_path
from phaseflip.node_files import shm_dir


def test_hicache_tier_of_a_killed_engine_is_swept():
    """A killed engine cannot unlink its HiCache host tier (1 GiB of tmpfs by default): the
    next engine's tier removes it, and keeps a live engine's."""
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    stale = shm_dir() / f"phaseflip-hicache-{gone}-abcd"
    live = shm_dir() / f"phaseflip-hicache-{os.getpid()}-beef"
    stale.write_bytes(b"x")
    live.write_bytes(b"x")
    try:
        path = shared_frames_path()
        assert not stale.exists() and live.exists()
        assert path.name.startswith(f"phaseflip-hicache-{os.getpid()}-")
    finally:
        stale.unlink(missing_ok=True)
        live.unlink(missing_ok=True)
