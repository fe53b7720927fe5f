"""The TP all-reduce over symmetric memory (issue 16 item 3): which path a launch takes and
why, which messages route to it, that ranks agree on it, and (on a GPU) that its results equal
the process group's, eagerly and replayed from a CUDA graph.

CPU tests need no GPU: the choice, the routing and the agreement run on real gloo ranks. GPU
tests (marked `gpu`) run 2 ranks sharing cuda:0 over gloo, and one rank per GPU over NCCL when
there are two. Every spawned rank runs under a deadline: a hang fails, never blocks.
"""

from __future__ import annotations

import argparse
import datetime
import os
import queue
import time
from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
import torch.multiprocessing as mp

from phaseflip.config import EMBEDDED_MODEL, EngineConfig
from phaseflip.distributed.group import DistSpec, free_port, join
from phaseflip.distributed.symm_allreduce import (
    SymmBuffer,
    SymmMemCommunicator,
    agree_per_layout,
    setup_symm_all_reduce,
    symm_routes,
    wanted,
)
from phaseflip.layout import ProcessGroupCommunicator
from phaseflip.model.config import ModelConfig

pytestmark = pytest.mark.timeout(180, method="thread")  # signals cannot interrupt gloo
KIB = 1 << 10
CAP = 2048 * KIB


def spec(**over) -> DistSpec:
    base = DistSpec(world_size=2, tp_size=2, pp_size=1, init_addr=f"127.0.0.1:{free_port()}",
                    backend="gloo", timeout_s=60, ranks_per_node=2, node_rank=0,
                    layouts=((2, 1), (1, 2)), all_reduce="symm-mem", device="cpu",
                    all_reduce_max_bytes=CAP)
    return replace(base, **over)


# ---- the choice, without processes ------------------------------------------------------

@pytest.mark.parametrize("mode, device, per_node, world, gpus, go, why", [
    ("nccl", "cuda", 2, 2, 2, False, "--all-reduce nccl"),
    ("auto", "cuda", 2, 2, 2, True, "auto"),
    ("symm-mem", "auto", 2, 2, 2, True, "symm-mem"),
    ("auto", "cpu", 2, 2, 2, False, "no CUDA"),
    ("symm-mem", "cuda", 2, 2, 0, False, "no CUDA"),
    ("auto", "cuda", 2, 4, 2, False, "span 2 nodes"),
    ("auto", "cuda", 2, 2, 1, False, "share 1 GPU"),  # ranks sharing: auto keeps the group
    ("symm-mem", "cuda", 2, 2, 1, True, "symm-mem"),  # ... symm-mem forces it there
])
def test_which_path_a_launch_tries(mode, device, per_node, world, gpus, go, why):
    got, reason = wanted(mode, device, per_node, world, gpus)
    assert got is go and why in reason


def test_an_unknown_mode_is_refused_by_config_and_chooser():
    with pytest.raises(ValueError, match="all_reduce"):
        EngineConfig(model="m", all_reduce="mpi")
    with pytest.raises(ValueError, match="all_reduce"):
        wanted("mpi", "cuda", 2, 2, 2)
    with pytest.raises(ValueError, match="all_reduce_max_kib"):
        EngineConfig(model="m", all_reduce_max_kib=0)


def test_the_flags_reach_the_ranks():
    from phaseflip.cli import add_config_flags

    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    args = parser.parse_args(["--all-reduce", "symm-mem", "--all-reduce-max-kib", "64"])
    assert (args.all_reduce, args.all_reduce_max_kib) == ("symm-mem", 64)
    cfg = EngineConfig(model="m", tp_size=2, all_reduce="nccl", all_reduce_max_kib=64)
    got = DistSpec.from_config(cfg, ModelConfig.from_dir(EMBEDDED_MODEL))
    assert (got.all_reduce, got.device, got.all_reduce_max_bytes) == ("nccl", "auto", 64 * KIB)
    assert EngineConfig(model="m").all_reduce == "nccl"  # symm-mem opt-in until run one per GPU


def test_no_cuda_falls_back_with_the_reason_and_no_collective():
    """A CPU launch forcing symm-mem logs why and takes the process group; it runs no
    collective (cpu_group None would fail one), so the ranks cannot wait on each other."""
    setup = setup_symm_all_reduce(0, spec(), {(2, 1): None, (1, 2): None}, None)
    assert setup.buffers == {(2, 1): None, (1, 2): None}
    assert setup.path((2, 1)) == "nccl"
    assert "nccl" in setup.line and "no CUDA" in setup.line


@pytest.mark.parametrize("dtype, numel, routes", [
    (torch.bfloat16, 4096, True),
    (torch.float32, 1024, True),
    (torch.float32, CAP // 4, True),  # exactly the buffer
    (torch.float32, CAP // 4 + 1, False),  # over it: the process group
    (torch.float16, 4096, False),  # torch's kernels dispatch float and bfloat16 only
    (torch.int32, 4096, False),
    (torch.bfloat16, 3, False),  # 6 bytes: the kernels need a multiple of 4
    (torch.bfloat16, 0, False),
])
def test_which_messages_route_to_symmetric_memory(dtype, numel, routes):
    assert symm_routes(torch.zeros(numel, dtype=dtype), CAP) is routes


def test_a_strided_or_misaligned_message_takes_the_process_group():
    assert not symm_routes(torch.zeros(64, 64).t(), CAP)
    assert symm_routes(torch.zeros(64, 64)[1:], CAP)  # contiguous, 256 bytes in: routes
    assert not symm_routes(torch.zeros(65)[1:], CAP)  # 4 bytes in: the result's vector
    # stores would fault (torch checks the input's alignment only)


# ---- real ranks ---------------------------------------------------------------------------

def run_ranks(fn: Callable, args: tuple, world: int = 2, deadline_s: float = 120) -> dict:
    """`fn(rank, out, *args)` on `world` spawned ranks; each puts (rank, result). A rank that
    does not answer before the deadline fails the test; every rank is killed at the end."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=fn, args=(r, out, *args), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    got, end = {}, time.monotonic() + deadline_s
    try:
        while len(got) < world:
            try:
                rank, res = out.get(timeout=max(0.1, end - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"ranks did not answer within {deadline_s} s: {got}")
            got[rank] = res
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
    errors = {r: v for r, v in got.items() if isinstance(v, str)}
    assert not errors, errors
    return got


def _answer(out, rank: int, body: Callable[[], object]) -> None:
    try:
        res = body()
    except Exception as e:  # noqa: BLE001 — the test reports it
        import traceback

        res = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    out.put((rank, res))
    out.close()
    out.join_thread()
    os._exit(0)  # no teardown: a peer that failed must not hang this one


def _cpu_launch(rank: int, out, s: DistSpec) -> None:
    def body():
        import torch.distributed as dist

        fabric = join(rank, s)
        comm = fabric.groups(2, 1).layout().tp_comm
        x = torch.full((8,), float(rank + 1))
        comm.all_reduce(x)
        dist.barrier(group=fabric.cpu_group)
        return type(comm).__name__, x.tolist(), fabric.symm.line
    _answer(out, rank, body)


def test_a_cpu_launch_forcing_symm_mem_runs_on_the_process_group():
    got = run_ranks(_cpu_launch, (spec(),))
    for name, x, line in got.values():
        assert name == "ProcessGroupCommunicator" and x == [3.0] * 8
        assert "no CUDA" in line



def _warm(rank: int, out, s: DistSpec) -> None:
    def body():
        from phaseflip.distributed.group import warm_communicators

        fabric = join(rank, s)
        return warm_communicators(fabric, torch.device("cpu"), force=True)
    _answer(out, rank, body)


def test_every_layouts_communicators_are_made_at_launch_without_a_deadlock():
    """Four ranks, tp4 / pp4 / tp2×pp2: each TP group, each pair of neighbouring stages and
    each logits pair carries one element, in one global order (on NCCL that makes the
    communicators at launch, not on a layout's first step after a seam). A wrong order
    would hang, and the deadline fails it."""
    s = spec(world_size=4, tp_size=4, ranks_per_node=4, layouts=((4, 1), (1, 4), (2, 2)))
    got = run_ranks(_warm, (s,), world=4, deadline_s=90)
    assert got[0] == ["tp4xpp1 tp group", "tp1xpp4 stages 0->1", "tp1xpp4 logits 3->0",
                      "tp2xpp2 tp group", "tp2xpp2 stages 0->2", "tp2xpp2 logits 2->0"]
    assert got[3] == ["tp4xpp1 tp group", "tp1xpp4 stages 2->3", "tp1xpp4 logits 3->0",
                      "tp2xpp2 tp group", "tp2xpp2 stages 1->3"]

def _agreement(rank: int, out, port: int) -> None:
    def body():
        import torch.distributed as dist

        deadline = datetime.timedelta(seconds=60)
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=deadline)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=deadline)
        tp = dist.new_group([0, 1])
        attempts = []

        def attempt(group) -> SymmBuffer:  # rank 1's rendezvous of the tp2 layout fails
            attempts.append(rank)
            if rank == 1 and len(attempts) == 1:
                raise RuntimeError("CUDA driver error: invalid device\nmore lines")
            return SymmBuffer(torch.zeros(16, dtype=torch.uint8), "fake")

        groups = {(2, 1): tp, (1, 2): None, (2, 2): tp}
        buffers, notes = agree_per_layout(groups, dist.group.WORLD, attempt)
        return {k: v is not None for k, v in buffers.items()}, notes
    _answer(out, rank, body)


def test_a_rendezvous_that_fails_on_one_rank_turns_every_rank_to_the_process_group():
    """Rank 0's rendezvous of tp2×pp1 succeeded, rank 1's failed: both run that layout on the
    process group (alone, rank 0 would spin in the symm-mem barrier while rank 1 calls NCCL),
    and the next layout, where both succeed, runs symm-mem on both."""
    got = run_ranks(_agreement, (free_port(),))
    for rank, (paths, notes) in got.items():
        assert paths == {(2, 1): False, (1, 2): False, (2, 2): True}, (rank, paths)
        assert notes[1] == "tp1×pp2 no TP" and notes[2] == "tp2×pp2 symm-mem"
    assert "invalid device" in got[1][1][0] and "more lines" not in got[1][1][0]
    assert "another rank failed" in got[0][1][0]


# ---- on the GPU: the kernels against the process group ------------------------------------

SIZES = [1 * KIB, 4 * KIB, 8 * KIB, 64 * KIB, 512 * KIB, CAP]


def _gpu_ranks(rank: int, out, s: DistSpec) -> None:
    _answer(out, rank, lambda: _gpu_checks(rank, s))


def _gpu_checks(rank: int, s: DistSpec) -> dict:
    """Every size in bf16 and fp32: symm-mem against the process group, eagerly with each of
    torch's kernels (one-shot with the copy-in fused, one-shot after a copy, two-shot), then
    all sizes captured in one graph, replayed 3 times with new inputs. Returns the largest
    error of each case and the launch's line."""
    from phaseflip.distributed import symm_allreduce as sa

    fabric = join(rank, s)
    comm = fabric.groups(2, 1).layout().tp_comm
    if not isinstance(comm, SymmMemCommunicator):
        return {"line": fabric.symm.line, "symm": False}
    device = comm.buffer.data.device
    torch.cuda.set_device(device)
    ref = ProcessGroupCommunicator(comm.group, comm.size, comm.staged)
    gen = torch.Generator(device).manual_seed(rank)
    cases = [(dt, n // dt.itemsize) for dt in (torch.bfloat16, torch.float32) for n in SIZES]
    errs: dict[str, float] = {}

    def inputs() -> list[torch.Tensor]:
        return [torch.randn(n, device=device, dtype=dt, generator=gen) for dt, n in cases]

    def check(tag: str, got: list[torch.Tensor], xs: list[torch.Tensor]) -> None:
        for (dt, n), g, x in zip(cases, got, xs):
            want = ref.all_reduce(x.clone())
            key = f"{tag} {str(dt)[6:]} {n * dt.itemsize // KIB} KiB"
            errs[key] = max(errs.get(key, 0.0), (g.float() - want.float()).abs().max().item())

    kernels = {"one-shot": {}, "one-shot after a copy": {"_copy_in_kernel": lambda f: False},
               "two-shot": {"one_shot_limit": lambda size: 0}}
    for tag, patch in kernels.items():
        saved = {k: getattr(sa, k) for k in patch}
        vars(sa).update(patch)
        xs = inputs()
        check(f"eager {tag}", [comm.all_reduce(x.clone()) for x in xs], xs)
        vars(sa).update(saved)
    static = [x.clone() for x in inputs()]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # (NCCL's watchdog)
        for x in static:
            comm.all_reduce(x)
    for _ in range(3):
        fresh = inputs()
        for x, f in zip(static, fresh):
            x.copy_(f)
        graph.replay()
        torch.cuda.synchronize(device)
        check("graph", [x.clone() for x in static], fresh)
    return {"line": fabric.symm.line, "symm": True, "errs": errs}


def _gpu_case(shared: bool, monkeypatch) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if not shared and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    if shared:  # the spawned ranks see one GPU, so both take it
        first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", first)
    s = spec(device="cuda", backend="gloo" if shared else "nccl", layouts=((2, 1),))
    got = run_ranks(_gpu_ranks, (s,), deadline_s=100)
    for rank, res in got.items():
        assert res["symm"], (rank, res["line"])
        assert "tp2×pp1 symm-mem" in res["line"]
        assert len(res["errs"]) == 4 * 2 * len(SIZES)
        bad = {k: e for k, e in res["errs"].items() if e > (0.0625 if "bfloat16" in k else 1e-5)}
        assert not bad, (rank, bad)


@pytest.mark.gpu
@pytest.mark.timeout(115, method="thread")
def test_symm_mem_equals_the_process_group_on_ranks_sharing_a_gpu(monkeypatch):
    _gpu_case(True, monkeypatch)


@pytest.mark.gpu
@pytest.mark.timeout(115, method="thread")
def test_symm_mem_equals_nccl_one_rank_per_gpu(monkeypatch):
    _gpu_case(False, monkeypatch)


def test_server_info_names_the_running_path(tmp_path):
    """/server_info's `all_reduce` (engine_process's info) says which path the running
    layout's TP all-reduce takes: a CPU engine forcing symm-mem serves over gloo."""
    from phaseflip import Engine, SamplingParams
    from phaseflip.distributed.symm_allreduce import all_reduce_path
    from tests.conftest import build_model, prompts_for

    model = build_model(tmp_path / "llama", "llama")
    params = SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True)
    with Engine(str(model), device="cpu", dtype="float32", max_total_tokens=2048,
                dist_timeout_s=60, tp_size=2, all_reduce="symm-mem") as e:
        assert len(e.generate(prompts_for(100)[:2], params, use_tqdm=False)) == 2
        assert all_reduce_path(e.core.runner) == "gloo"
    assert all_reduce_path(None) is None
    buf = SymmBuffer(torch.zeros(CAP, dtype=torch.uint8), "g")
    comm = SymmMemCommunicator(None, 2, buffer=buf)
    layout = type("Layout", (), {"tp_comm": comm})()
    assert all_reduce_path(type("ModelRunner", (), {"layout": layout})()) == (
        "symm-mem (up to 2048 KiB, the process group above)")
    assert comm.graph_addresses() == (buf.data.data_ptr(), CAP)


def test_the_comm_benchmarks_symm_mode_needs_cuda():
    """`bench_comm --all-reduce symm-mem` (the GPU comparison) refuses a CPU run up front."""
    from benchmarks import bench_comm

    with pytest.raises(SystemExit, match="needs CUDA"):
        bench_comm.main(["--device", "cpu", "--all-reduce", "symm-mem"])
    args = bench_comm.parse_args(["--device", "cpu"])
    assert bench_comm.build_spec(args).sizes_bytes == bench_comm.parse_sizes(
        bench_comm.DEFAULT_SIZES)


@pytest.mark.gpu
@pytest.mark.timeout(115, method="thread")
def test_a_tp2_engine_on_one_gpu_gives_the_same_tokens_over_symm_mem(tmp_path):
    """The engine end to end, 2 ranks sharing one GPU: forcing symm-mem, its layers'
    all-reduces go through torch's kernels (/server_info says so) and greedy fp32 tokens
    equal the gloo path's (a sum of two fp32 partials rounds the same on either)."""
    if not torch.cuda.is_available() or torch.cuda.device_count() != 1:
        pytest.skip("needs exactly one CUDA device (ranks sharing it)")
    from phaseflip import Engine, SamplingParams
    from phaseflip.distributed.symm_allreduce import all_reduce_path
    from tests.conftest import build_model, prompts_for

    model = build_model(tmp_path / "llama", "llama")
    params = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    runs = {}
    for mode in ("nccl", "symm-mem"):
        with Engine(str(model), device="cuda", dtype="float32", max_total_tokens=4096,
                    dist_timeout_s=60, tp_size=2, all_reduce=mode) as e:
            outs = e.generate(prompts_for(200)[:4], params, use_tqdm=False)
            runs[mode] = ([o.token_ids for o in outs], all_reduce_path(e.core.runner))
    assert runs["nccl"][1] == "gloo"
    assert runs["symm-mem"][1].startswith("symm-mem")
    assert runs["symm-mem"][0] == runs["nccl"][0]
