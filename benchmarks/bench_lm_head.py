"""The TP LM head's logits: gathered to the sampling rank now, all-gathered to every rank before.

    python3 -m benchmarks.bench_lm_head --world-size 2 --batch 1,64,256 --out lm_head.json

One process per rank (rank r on cuda:r, NCCL; `--device cpu --backend gloo` runs on the CPU).
Each rank holds a `ParallelLMHead` shard of `--vocab` × `--hidden` (random weights) and times,
as the median over `--iters` iterations after a barrier, per batch size:
  - `local only`: its shard's matmul widened to float32, no communication (the floor);
  - `all_gather (before)`: the head as it was: float32 shards all-gathered and concatenated on
    EVERY rank (each received (tp-1)/tp × rows × vocab × 4 bytes);
  - `gather (now)`: `ParallelLMHead.logits`: shards in the weights' dtype gathered to TP rank
    0 and widened there; the other ranks send and receive nothing;
  - CUDA only, `gather in a graph`: the same captured in one CUDA graph and replayed (how a
    decode step runs it: `model/cuda_graph.py`).
Times are per rank: rank 0 (the sampler) and the slowest other rank. Rank 0 checks that the
gathered logits equal the all-gathered ones bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.bench_comm import CommBenchError, elapsed_s, spawn_ranks
from benchmarks.common import join_rank_group, print_table, write_json
from phaseflip.distributed.group import free_port
from phaseflip.layout import Layout, ProcessGroupCommunicator
from phaseflip.model.layers import linear
from phaseflip.model.lm_head import ParallelLMHead


@dataclass(frozen=True)
class HeadSpec:
    """What every rank runs (picklable: sent to the spawned ranks)."""

    world_size: int
    backend: str
    device: str  # cuda or cpu
    dtype: str
    vocab: int
    hidden: int
    batches: tuple[int, ...]
    iters: int
    warmup: int
    timeout_s: float
    init_method: str


def all_gather_logits(head: ParallelLMHead, hidden: torch.Tensor) -> torch.Tensor:
    """The LM head before issue 16 item 4, verbatim: every rank gets the full float32 logits."""
    local = linear(hidden, head.weight).float()
    parts = [torch.empty_like(local) for _ in range(head.layout.tp_size)]
    dist.all_gather(parts, local.contiguous())
    return torch.cat(parts, dim=-1)[:, : head.vocab_size]


def _median_s(fn: Callable[[], object], device: torch.device, spec: HeadSpec) -> float:
    """This rank's median seconds per call (a barrier before each: no late start counted)."""
    for _ in range(spec.warmup):
        fn()
    times = []
    for _ in range(spec.iters):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(elapsed_s(fn, device))
    return statistics.median(times)


def _per_rank(seconds: float, device: torch.device, world: int) -> list[float]:
    mine = torch.tensor([seconds], dtype=torch.float64, device=device)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    return [t.item() for t in every]


def _graphed(head: ParallelLMHead, hidden: torch.Tensor, out: torch.Tensor | None
             ) -> Callable[[], None]:
    """The gather captured in a CUDA graph (after an eager warm-up on the capture stream)."""
    side = torch.cuda.Stream(hidden.device)
    side.wait_stream(torch.cuda.current_stream(hidden.device))
    with torch.cuda.stream(side):
        head.logits(hidden, out)
    torch.cuda.current_stream(hidden.device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
        head.logits(hidden, out)
    torch.cuda.synchronize(hidden.device)
    return graph.replay


def _cases(head: ParallelLMHead, hidden: torch.Tensor, device: torch.device
           ) -> dict[str, Callable[[], object]]:
    cases: dict[str, Callable[[], object]] = {
        "local only": lambda: linear(hidden, head.weight).float(),
        "all_gather (before)": lambda: all_gather_logits(head, hidden),
        "gather (now)": lambda: head.logits(hidden),
    }
    if device.type == "cuda":
        out = (torch.empty(hidden.shape[0], head.padded_vocab, dtype=torch.float32,
                           device=device) if head.layout.tp_rank == 0 else None)
        cases["gather in a graph"] = _graphed(head, hidden, out)
    return cases


def _rows_for(head: ParallelLMHead, rows: int, device: torch.device, spec: HeadSpec
              ) -> list[dict[str, Any]]:
    rank, world = head.layout.tp_rank, spec.world_size
    hidden = torch.randn(rows, spec.hidden, dtype=head.weight.dtype, device=device)
    new, old = head.logits(hidden), all_gather_logits(head, hidden)
    if rank == 0 and not torch.equal(new, old):
        raise CommBenchError(f"gathered logits differ from all-gathered ones at batch {rows}")
    shard = rows * (head.end - head.start)
    received = {"all_gather (before)": [(world - 1) * shard * 4] * world,
                "gather (now)": [(world - 1) * shard * head.weight.element_size()]
                + [0] * (world - 1)}
    received["gather in a graph"] = received["gather (now)"]
    out = []
    for name, fn in _cases(head, hidden, device).items():
        times = _per_rank(_median_s(fn, device, spec), device, world)
        got = received.get(name, [0] * world)
        out.append({"case": name, "batch": rows, "rank0_us": times[0] * 1e6,
                    "others_max_us": max(times[1:]) * 1e6,
                    "rank0_received_bytes": got[0], "others_received_bytes": max(got[1:])})
    return out


def rank_main(rank: int, spec: HeadSpec, out_path: str) -> None:
    """One rank: join, build its shard, time every case; rank 0 writes the result file."""
    device = join_rank_group(rank, spec)
    comm = ProcessGroupCommunicator(dist.group.WORLD, spec.world_size)
    with torch.device(device):
        head = ParallelLMHead(spec.vocab, spec.hidden, Layout(rank, spec.world_size,
                                                              tp_comm=comm),
                              getattr(torch, spec.dtype))
    torch.manual_seed(rank)
    head.weight.data.normal_(0, spec.hidden ** -0.5)
    rows = [r for b in spec.batches for r in _rows_for(head, b, device, spec)]
    if rank == 0:
        Path(out_path).write_text(json.dumps(rows))
    dist.barrier()  # every rank done talking before any leaves
    os._exit(0)  # no teardown: a gloo rank whose peer has gone may abort in it (SIGABRT seen)


def run_ranks(spec: HeadSpec, deadline_s: float) -> list[dict[str, Any]]:
    """This benchmark's ranks (`bench_comm.spawn_ranks`)."""
    return spawn_ranks(rank_main, spec, deadline_s)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    ap.add_argument("--backend", default="auto", choices=["auto", "nccl", "gloo"])
    ap.add_argument("--dtype", default="auto", help="auto: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--vocab", type=int, default=128256, help="Llama 3's")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--batch", default="1,64,256", help="comma-separated rows")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--deadline-s", type=float, default=600.0)
    ap.add_argument("--out", default=None, help="write the result as JSON here")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = args.device if args.device != "auto" else (
        "cuda" if torch.cuda.device_count() >= args.world_size else "cpu")
    backend = args.backend if args.backend != "auto" else (
        "nccl" if device == "cuda" else "gloo")
    dtype = args.dtype if args.dtype != "auto" else (
        "bfloat16" if device == "cuda" else "float32")
    spec = HeadSpec(args.world_size, backend, device, dtype, args.vocab, args.hidden,
                    tuple(int(b) for b in args.batch.split(",")), args.iters, args.warmup,
                    min(args.deadline_s, 600.0), f"tcp://127.0.0.1:{free_port()}")
    rows = run_ranks(spec, args.deadline_s)
    print_table(["case", "batch", "rank 0 µs", "others µs", "rank 0 recv MB", "others recv MB"],
                [[r["case"], r["batch"], r["rank0_us"], r["others_max_us"],
                  r["rank0_received_bytes"] / 1e6, r["others_received_bytes"] / 1e6]
                 for r in rows],
                title=f"LM head logits, tp{spec.world_size} {backend} {dtype}, "
                      f"vocab {spec.vocab} x hidden {spec.hidden}")
    return write_json(args.out, {**asdict(spec), "rows": rows})


if __name__ == "__main__":
    main()
