"""What a soak reads of the server's processes from /proc (Linux): memory, descriptors,
threads, and which child is the engine. None wherever it cannot be read."""

from __future__ import annotations

import contextlib
from pathlib import Path

from phaseflip.distributed.spawner import child_pids


def proc_status_count(pid: int, field: str) -> int | None:
    """A number of /proc/<pid>/status (Threads; a `kB` field in kB)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def proc_status_bytes(pid: int, field: str) -> int | None:
    """A `kB` field of /proc/<pid>/status (VmRSS, RssShmem...), in bytes."""
    kb = proc_status_count(pid, field)
    return None if kb is None else kb * 1024


def proc_rss_bytes(pid: int) -> int | None:
    return proc_status_bytes(pid, "VmRSS")


def open_fds(pid: int) -> int | None:
    try:
        return len(list(Path(f"/proc/{pid}/fd").iterdir()))
    except OSError:
        return None


def private_rss_bytes(pid: int) -> tuple[int | None, int | None]:
    """(VmRSS less RssShmem, RssShmem): what the process holds itself, and what it has
    resident of shared-memory files."""
    rss, shmem = proc_rss_bytes(pid), proc_status_bytes(pid, "RssShmem")
    return (None if rss is None or shmem is None else rss - shmem), shmem


def engine_pid(server_pid: int) -> int | None:
    """The engine process: the front end's multiprocessing child that is not its resource
    tracker."""
    for child in child_pids(server_pid):
        with contextlib.suppress(OSError):
            cmd = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
            if b"spawn_main" in cmd and b"resource_tracker" not in cmd:
                return child
    return None
