"""CPU threads per process: the rule, its overrides, and that a spawned process applies it."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest

from phaseflip.config import EngineConfig
from phaseflip.errors import InvalidRequestError
from phaseflip.threads import apply_cpu_threads, available_cores, plan_for, plan_threads


@pytest.mark.parametrize("cores,ranks,threads", [
    (1, 1, 1), (2, 1, 1), (2, 2, 1), (4, 1, 3), (4, 2, 1), (16, 1, 15), (16, 2, 7),
    (64, 8, 7), (3, 4, 1),
])
def test_auto_leaves_a_core_and_shares_the_rest(cores, ranks, threads):
    plan = plan_threads(None, ranks, cores=cores, env={})
    assert (plan.threads, plan.source) == (threads, "auto")
    assert plan.describe().startswith(f"CPU threads {threads}/rank (auto: {cores} cores")


def test_flag_beats_environment_beats_auto():
    assert plan_threads(3, 2, cores=2, env={"OMP_NUM_THREADS": "5"}).threads == 3
    env = plan_threads(None, 2, cores=2, env={"OMP_NUM_THREADS": "5"})
    assert (env.threads, env.source) == (5, "OMP_NUM_THREADS")
    for junk in ("", "0", "two", "-1"):  # not a thread count: the rule decides
        assert plan_threads(None, 1, cores=8, env={"OMP_NUM_THREADS": junk}).source == "auto"


def test_cores_come_from_the_affinity_mask():
    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("no CPU affinity on this platform")
    assert available_cores() == len(os.sched_getaffinity(0))


def test_local_ranks_from_the_config(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("phaseflip.threads.available_cores", lambda: 16)
    assert plan_for(EngineConfig(tp_size=2, pp_size=2)).threads == 3  # 15 cores / 4 ranks
    two_hosts = EngineConfig(tp_size=4, nnodes=2, dist_init_addr="127.0.0.1:1")
    assert plan_for(two_hosts).threads == 7  # 2 ranks on this host
    assert plan_for(EngineConfig(cpu_threads=4)).threads == 4


def test_bad_flag_is_refused():
    with pytest.raises(InvalidRequestError, match="cpu_threads"):
        EngineConfig(cpu_threads=0)


def _threads_after_apply(cfg: EngineConfig, out) -> None:
    import torch

    apply_cpu_threads(cfg)
    out.put(torch.get_num_threads())


@pytest.mark.parametrize("requested", [1, 2])
def test_a_spawned_process_applies_it(requested):
    """What the engine process and each worker rank do first thing."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_threads_after_apply, args=(EngineConfig(cpu_threads=requested),
                                                          out))
    proc.start()
    try:
        assert out.get(timeout=60) == requested
    finally:
        proc.join(timeout=30)
