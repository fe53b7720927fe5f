"""How many CPU threads each process's torch may use.

torch's default is one intra-op thread per core of the machine, in every process. A server
runs a front end (HTTP, tokenizer) and one process per local rank, so on a small box the
default puts several spinning OpenMP pools on the same cores: on a loaded 2-core machine a
64-token completion took 11-27 s with the default and under 1 s with one thread.

The rule: the cores this process may run on (its CPU affinity, which containers and `taskset`
narrow), less one for the front end, tokenizer and scheduler, shared evenly by the ranks of
this host; at least one thread. `--cpu-threads N` overrides it, and so does an explicit
`OMP_NUM_THREADS` in the environment.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

log = logging.getLogger("phaseflip.threads")


@dataclass(frozen=True)
class ThreadPlan:
    threads: int
    """torch intra-op threads for each process of this host."""
    source: str
    """Where the number comes from: `--cpu-threads`, `OMP_NUM_THREADS` or `auto`."""
    cores: int
    """Cores this process may run on."""
    local_ranks: int
    """Model ranks on this host (one process each)."""

    def describe(self) -> str:
        """One phrase for the ready line, e.g. `CPU threads 1/rank (auto: 2 cores, 2 ranks)`."""
        if self.source == "auto":
            ranks = "1 rank" if self.local_ranks == 1 else f"{self.local_ranks} ranks"
            return f"CPU threads {self.threads}/rank (auto: {self.cores} cores, {ranks})"
        return f"CPU threads {self.threads}/rank ({self.source})"


def available_cores() -> int:
    """Cores this process may be scheduled on (affinity mask; all cores where unknown)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def plan_threads(requested: int | None, local_ranks: int, cores: int | None = None,
                 env: Mapping[str, str] | None = None) -> ThreadPlan:
    """The thread count for each of `local_ranks` processes (see the module docstring)."""
    cores = available_cores() if cores is None else cores
    local_ranks = max(1, local_ranks)
    if requested is not None:
        return ThreadPlan(max(1, requested), "--cpu-threads", cores, local_ranks)
    omp = (os.environ if env is None else env).get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) > 0:
        return ThreadPlan(int(omp), "OMP_NUM_THREADS", cores, local_ranks)
    spare = cores - 1 if cores > 1 else cores  # one core for the front end and scheduler
    return ThreadPlan(max(1, spare // local_ranks), "auto", cores, local_ranks)


def plan_for(cfg) -> ThreadPlan:
    """The plan for an `EngineConfig`: its --cpu-threads and the ranks it puts on this host."""
    return plan_threads(getattr(cfg, "cpu_threads", None), cfg.world_size // max(1, cfg.nnodes))


def apply_cpu_threads(cfg) -> ThreadPlan:
    """Sets this process's torch threads from `cfg`; call once at process start, before any
    torch work (the engine process and every worker rank do)."""
    import torch  # deferred: the CLI imports this module for --help

    plan = plan_for(cfg)
    if torch.get_num_threads() != plan.threads:
        torch.set_num_threads(plan.threads)
    log.debug("%s", plan.describe())
    return plan
