"""Device-to-device bandwidth between GPUs: the ceiling for TP/PP serving and weight exchange.

    python3 -m benchmarks.bench_comm --world-size 2 --out comm.json

One process per rank (rank r on cuda:r, NCCL; `--device cpu --backend gloo` runs it all on the
CPU for tests). For every message size it times, as the median over `--iters` iterations of
`--ops-per-iter` back-to-back ops (after warm-up and a barrier; the slowest rank's time):
  - all_reduce (sum): algbw = bytes / time, busbw = algbw * 2(n-1)/n;
  - all_gather (into one tensor): bytes = the output size, busbw = algbw * (n-1)/n;
  - send 0->1 (the other ranks idle): busbw = algbw;
  - sendrecv 0<->1: both directions at once, bytes and GB/s per direction.
The busbw factors are the nccl-tests convention: busbw is what each link carries, so it can be
held against the link's bandwidth whatever the world size. GB/s = 1e9 bytes/s.
On CUDA it also times 64 all-reduces of 8 KiB (a TP decode step at batch 1 of a 32-layer
model: two per layer) captured in one CUDA graph and replayed, next to the same 64 eagerly.

Reading it: H200 NVLink is 450 GB/s per direction on paper (18 links; a datasheet figure, not
a measurement). Large messages' busbw approaches the link from below; small ones are latency
bound, so read their time in µs, not their GB/s. NVLink multicast (NVLS) is always off here.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tqdm.auto import tqdm

from benchmarks.common import join_rank_group, print_table, write_json
from phaseflip.distributed.group import free_port

# Mandatory on the shared GPU hosts: never NVLink multicast.
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                    "NVSHMEM_DISABLE_NVLS": "1"}
DEFAULT_SIZES = "8K,64K,512K,2M,8M,32M,128M,512M,1G"
GRAPH_OPS, GRAPH_BYTES = 64, 8 << 10  # 2 all-reduces x 32 layers of a 4096-wide bf16 row
# all_gather_single where it exists (all_gather_into_tensor is deprecated there)
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class CommBenchError(RuntimeError):
    """A rank failed or hung; the message says which and how."""


@dataclass(frozen=True)
class CommSpec:
    """What every rank runs (picklable: sent to the spawned ranks)."""

    world_size: int
    backend: str
    device: str  # cuda or cpu
    dtype: str
    sizes_bytes: tuple[int, ...]
    iters: int
    warmup: int
    ops_per_iter: int
    timeout_s: float
    init_method: str


@dataclass(frozen=True)
class Rank:
    rank: int
    spec: CommSpec
    device: torch.device

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.spec.dtype)

    def zeros(self, nbytes: int) -> torch.Tensor:
        """At least one element; zeros so repeated sums never overflow."""
        numel = max(1, nbytes // self.dtype.itemsize)
        return torch.zeros(numel, dtype=self.dtype, device=self.device)

    def barrier(self) -> None:
        dist.barrier()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def elapsed_s(fn: Callable[[], None], device: torch.device) -> float:
    """Wall time of `fn` on the device: CUDA events on GPU, perf_counter on CPU."""
    if device.type != "cuda":
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def measure(r: Rank, fn: Callable[[], None], ops: int) -> float:
    """Seconds per op: median over iterations of the slowest rank's time for `ops` ops.

    The barrier keeps one rank's late start out of another's time; every rank calls this in
    the same order (ranks that take no part pass a no-op) because it ends in a collective."""
    for _ in range(r.spec.warmup):
        fn()
    times = []
    for _ in range(r.spec.iters):
        r.barrier()
        times.append(elapsed_s(lambda: [fn() for _ in range(ops)], r.device) / ops)
    slowest = torch.tensor(times, dtype=torch.float64, device=r.device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return statistics.median(slowest.tolist())


# Each case builds its tensors for one size: (the op, bytes it moves, busbw / algbw).
def all_reduce_case(r: Rank, size: int) -> tuple[Callable[[], None], int, float]:
    x, n = r.zeros(size), r.spec.world_size
    return lambda: dist.all_reduce(x), x.nbytes, 2 * (n - 1) / n


def all_gather_case(r: Rank, size: int) -> tuple[Callable[[], None], int, float]:
    n = r.spec.world_size
    x = r.zeros(size // n)
    out = torch.empty(x.numel() * n, dtype=x.dtype, device=r.device)
    return lambda: ALL_GATHER(out, x), out.nbytes, (n - 1) / n


def send_case(r: Rank, size: int) -> tuple[Callable[[], None], int, float]:
    x = r.zeros(size)
    ops = {0: lambda: dist.send(x, dst=1), 1: lambda: dist.recv(x, src=0)}
    return ops.get(r.rank, lambda: None), x.nbytes, 1.0


def exchange_case(r: Rank, size: int) -> tuple[Callable[[], None], int, float]:
    """Ranks 0 and 1 send to each other at once; one batch so NCCL runs both directions
    together (a plain isend then irecv on both ranks would serialise, or deadlock)."""
    x, y = r.zeros(size), r.zeros(size)

    def exchange() -> None:
        peer = 1 - r.rank
        ops = [dist.P2POp(dist.isend, x, peer), dist.P2POp(dist.irecv, y, peer)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()

    return (exchange if r.rank < 2 else lambda: None), x.nbytes, 1.0


CASES = {"all_reduce": all_reduce_case, "all_gather": all_gather_case,
         "send 0->1": send_case, "sendrecv 0<->1 (per direction)": exchange_case}


def row(op: str, size: int, moved: int, seconds: float, bus_factor: float) -> dict[str, Any]:
    algbw = moved / seconds / 1e9
    return {"op": op, "size_bytes": size, "bytes": moved, "time_us": seconds * 1e6,
            "algbw_GBps": algbw, "busbw_GBps": algbw * bus_factor}


def sweep(r: Rank) -> list[dict[str, Any]]:
    """Every case at every size; tensors live only while their case is timed."""
    rows = []
    steps = [(s, name) for s in r.spec.sizes_bytes for name in CASES]
    for size, name in tqdm(steps, desc="comm", unit="case", disable=r.rank != 0):
        fn, moved, factor = CASES[name](r, size)
        rows.append(row(name, size, moved, measure(r, fn, r.spec.ops_per_iter), factor))
        del fn
    return rows


def capture_all_reduces(r: Rank, x: torch.Tensor) -> torch.cuda.CUDAGraph:
    """GRAPH_OPS all-reduces of `x` in one graph, after a warm-up on a side stream outside
    the capture (the communicator must be set up before it, as torch's NCCL capture needs)."""
    side = torch.cuda.Stream(r.device)
    side.wait_stream(torch.cuda.current_stream(r.device))
    with torch.cuda.stream(side):
        for _ in range(3):
            dist.all_reduce(x)
    torch.cuda.current_stream(r.device).wait_stream(side)
    torch.cuda.synchronize(r.device)
    graph = torch.cuda.CUDAGraph()
    # thread_local: the NCCL watchdog thread's event queries must not void the capture
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for _ in range(GRAPH_OPS):
            dist.all_reduce(x)
    return graph


def graph_rows(r: Rank) -> tuple[list[dict[str, Any]], str | None]:
    """Per all-reduce: GRAPH_OPS small ones launched eagerly, then replayed from one graph.

    A capture error is returned, not raised; all ranks agree on it first, so none is left
    waiting in a replay that the others skip."""
    x, n = r.zeros(GRAPH_BYTES), r.spec.world_size
    bus = 2 * (n - 1) / n
    eager = measure(r, lambda: dist.all_reduce(x), GRAPH_OPS)
    rows = [row(f"all_reduce x{GRAPH_OPS} eager", GRAPH_BYTES, x.nbytes, eager, bus)]
    graph, error = None, None
    try:
        graph = capture_all_reduces(r, x)
    except Exception as e:  # noqa: BLE001 - recorded in the JSON; the sweep's rows stand
        error = f"rank {r.rank}: {type(e).__name__}: {e}"
    ok = torch.tensor([error is None], dtype=torch.int32, device=r.device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if graph is None or not ok.item():
        return rows, error or "capture failed on another rank"
    per_op = measure(r, graph.replay, 1) / GRAPH_OPS
    rows.append(row(f"all_reduce x{GRAPH_OPS} cuda graph", GRAPH_BYTES, x.nbytes, per_op, bus))
    return rows, None


def rank_main(rank: int, spec: CommSpec, out_path: str) -> None:
    """One rank: join the group, run every measurement; rank 0 writes the result file."""
    device = join_rank_group(rank, spec)
    try:
        r = Rank(rank, spec, device)
        rows = sweep(r)
        graph, error = graph_rows(r) if device.type == "cuda" else ([], "CUDA only")
        if rank == 0:
            Path(out_path).write_text(json.dumps({"rows": rows + graph, "cuda_graph_error": error,
                                                  **_device_facts(spec)}))
    finally:
        dist.destroy_process_group()


def _device_facts(spec: CommSpec) -> dict[str, Any]:
    """Names of the ranks' GPUs and whether 0 and 1 reach each other directly (P2P)."""
    if spec.device != "cuda":
        return {"devices": ["cpu"] * spec.world_size, "peer_access_0_1": None}
    return {"devices": [torch.cuda.get_device_name(i) for i in range(spec.world_size)],
            "peer_access_0_1": torch.cuda.can_device_access_peer(0, 1)}


def run_ranks(spec: CommSpec, deadline_s: float) -> dict[str, Any]:
    """This benchmark's ranks (`spawn_ranks`)."""
    return spawn_ranks(rank_main, spec, deadline_s)


def spawn_ranks(fn: Callable[[int, Any, str], None], spec: Any, deadline_s: float) -> Any:
    """Spawns `fn(rank, spec, out_path)` on `spec.world_size` ranks and waits for them; rank
    0's JSON result file is returned. Raises CommBenchError (the others killed) when one
    fails or the deadline passes."""
    os.environ.update(NO_MULTICAST_ENV)  # inherited by the spawned ranks
    with tempfile.TemporaryDirectory(prefix="bench-ranks-") as tmp:
        out = Path(tmp) / "rank0.json"
        ctx = mp.start_processes(fn, args=(spec, str(out)), nprocs=spec.world_size,
                                 join=False, daemon=True, start_method="spawn")
        end = time.monotonic() + deadline_s
        try:
            while not ctx.join(timeout=max(0.0, end - time.monotonic()), grace_period=5):
                if time.monotonic() >= end:
                    raise CommBenchError(
                        f"ranks still running after --deadline-s {deadline_s:g}; a hang "
                        "(check NCCL_DEBUG=INFO output) or raise the deadline")
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            raise CommBenchError(f"rank {e.error_index} failed: {e}") from e
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join()
        return json.loads(out.read_text())


# ---- --all-reduce symm-mem: the TP communicator's symmetric-memory path against the group ----
SYMM_SIZES = "8K,32K,128K,512K,1M"


def symm_rank_main(rank: int, spec: CommSpec, out_path: str) -> None:
    """A rank of the symm-mem mode, launched as phaseflip launches its ranks (`join` forcing
    --all-reduce symm-mem: ranks share a GPU, over gloo, when there are fewer GPUs than
    ranks). Per size: the TP communicator's all-reduce (`SymmMemCommunicator`) and the
    process group's, eagerly and replayed from a graph of GRAPH_OPS (the group's only on
    NCCL: gloo staging cannot be captured)."""
    from phaseflip.distributed.group import DistSpec, join
    from phaseflip.distributed.symm_allreduce import SymmMemCommunicator
    from phaseflip.layout import ProcessGroupCommunicator

    w = spec.world_size
    fabric = join(rank, DistSpec(w, w, 1, spec.init_method.removeprefix("tcp://"), spec.backend,
                                 spec.timeout_s, w, 0, layouts=((w, 1),), all_reduce="symm-mem",
                                 device="cuda", all_reduce_max_bytes=max(spec.sizes_bytes)))
    symm = fabric.groups(w, 1).layout().tp_comm
    r = Rank(rank, spec, torch.device("cuda", rank % torch.cuda.device_count()))
    torch.cuda.set_device(r.device)
    paths = {f"{spec.backend} all_reduce": ProcessGroupCommunicator(symm.group, w, symm.staged)}
    if isinstance(symm, SymmMemCommunicator):
        paths["symm-mem all_reduce"] = symm
    rows = []
    for size in spec.sizes_bytes:
        x = r.zeros(size)
        for name, comm in paths.items():
            fn = lambda comm=comm, x=x: comm.all_reduce(x)  # noqa: E731
            rows.append(row(f"{name} eager", size, x.nbytes,
                            measure(r, fn, spec.ops_per_iter), 2 * (w - 1) / w))
            if comm is symm or not symm.staged:
                graph = graph_of(fn, r.device)
                rows.append(row(f"{name} cuda graph", size, x.nbytes,
                                measure(r, graph.replay, 1) / GRAPH_OPS, 2 * (w - 1) / w))
    if rank == 0:
        n = torch.cuda.device_count()  # (ranks may share a GPU here)
        Path(out_path).write_text(json.dumps({
            "rows": rows, "cuda_graph_error": None, "all_reduce_path": fabric.symm.line,
            "devices": [torch.cuda.get_device_name(i % n) for i in range(w)],
            "peer_access_0_1": torch.cuda.can_device_access_peer(0, 1) if n > 1 else None}))
    os._exit(0)  # (the peer-mapped buffers outlive a process-group teardown)


def graph_of(fn: Callable[[], None], device: torch.device) -> torch.cuda.CUDAGraph:
    """GRAPH_OPS calls of `fn` in one graph, after a warm-up on a side stream."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for _ in range(GRAPH_OPS):
            fn()
    return graph


def parse_size(text: str) -> int:
    """'8K', '2M', '1G' (binary units) or plain bytes."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:I?B)?\s*", text.upper())
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {text!r}; expected e.g. 8K, 2M, 1G")
    return int(m[1]) << {"": 0, "K": 10, "M": 20, "G": 30}[m[2]]


def parse_sizes(text: str) -> tuple[int, ...]:
    return tuple(parse_size(s) for s in text.split(",") if s.strip())


def format_size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    ap.add_argument("--backend", default="auto", choices=["auto", "nccl", "gloo"])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--sizes", type=parse_sizes, default=None,
                    help=f"comma-separated, binary K/M/G (default {DEFAULT_SIZES}; "
                    f"with --all-reduce symm-mem {SYMM_SIZES})")
    ap.add_argument("--all-reduce", default=None, choices=["symm-mem"],
                    help="time the TP all-reduce over symmetric memory against the process "
                    "group (CUDA; ranks share a GPU over gloo when there are fewer GPUs)")
    ap.add_argument("--iters", type=int, default=20, help="timed iterations per case")
    ap.add_argument("--warmup", type=int, default=5, help="untimed ops before each case")
    ap.add_argument("--ops-per-iter", type=int, default=10,
                    help="ops back to back per timed iteration (amortises launch latency)")
    ap.add_argument("--timeout-s", type=float, default=300, help="process-group timeout")
    ap.add_argument("--deadline-s", type=float, default=900, help="whole-run deadline")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    return ap.parse_args(argv)


def build_spec(args: argparse.Namespace) -> CommSpec:
    """Resolves auto choices and refuses layouts that cannot run."""
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    backend = args.backend if args.backend != "auto" else ("nccl" if device == "cuda" else "gloo")
    if args.world_size < 2:
        raise SystemExit("--world-size must be at least 2 (point-to-point uses ranks 0 and 1)")
    if backend == "nccl" and device != "cuda":
        raise SystemExit("--backend nccl needs --device cuda; use --backend gloo on CPU")
    symm = args.all_reduce == "symm-mem"
    if symm and device != "cuda":
        raise SystemExit("--all-reduce symm-mem needs CUDA (--device cuda)")
    if symm and args.backend == "auto" and torch.cuda.device_count() < args.world_size:
        backend = "gloo"  # ranks share a GPU: the process group stages through the host
    elif device == "cuda" and torch.cuda.device_count() < args.world_size:
        raise SystemExit(f"--world-size {args.world_size} needs that many GPUs; "
                         f"{torch.cuda.device_count()} visible")
    sizes = args.sizes or parse_sizes(SYMM_SIZES if symm else DEFAULT_SIZES)
    return CommSpec(args.world_size, backend, device, args.dtype, sizes, args.iters,
                    args.warmup, args.ops_per_iter, args.timeout_s,
                    f"tcp://127.0.0.1:{free_port()}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    spec = build_spec(args)
    measured = (spawn_ranks(symm_rank_main, spec, args.deadline_s) if args.all_reduce
                else run_ranks(spec, args.deadline_s))
    nccl = torch.cuda.nccl.version() if spec.backend == "nccl" else None  # (major, minor, patch)
    print_table(["size", "op", "time µs", "algbw GB/s", "busbw GB/s"],
                [[format_size(r["size_bytes"]), r["op"], r["time_us"], r["algbw_GBps"],
                  r["busbw_GBps"]] for r in measured["rows"]],
                title=f"{spec.world_size} ranks, {spec.backend} on {spec.device}, {spec.dtype}")
    if measured["cuda_graph_error"] and spec.device == "cuda":
        print(f"CUDA graph capture failed: {measured['cuda_graph_error']}")
    result = {"benchmark": "comm", "all_reduce": args.all_reduce, **asdict(spec),
              "nccl_version": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl,
              "no_multicast_env": NO_MULTICAST_ENV, **measured}
    return write_json(args.out, result)


if __name__ == "__main__":
    main()
