"""What handing a step's plan to the other ranks costs: the driver's `broadcast_object_list` of a
`StepMessage` over the gloo plan group, as `DistributedRunner` does every step.

    python -m benchmarks.bench_plan_broadcast --batch-sizes 1,64,256 --context 1024 --out b.json

Two processes on this host (CPU; no GPU needed). For decode plans of each batch size with
`--context`-token contexts it reports the pickled message size, the time rank 0 spends in the
broadcast, and the time until rank 1 holds the unpickled message (both from a barrier; median
of `--iters`). Why it matters: a TP rank cannot launch its step before it has the plan, so the
receive time sits on every step's critical path (the tp2 batch-1 profile on the H200 pair shows
~2.2 ms of host time per step). The plan carries every sequence's whole `kv_indices`, so the
message grows with batch × context.
"""

from __future__ import annotations

import argparse
import pickle
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.common import print_table, write_json
from phaseflip.distributed.group import free_port
from phaseflip.distributed.stage import StepMessage
from phaseflip.forward_batch import ForwardBatch


def decode_plan(batch: int, context: int, seed: int = 0) -> ForwardBatch:
    g = torch.Generator().manual_seed(seed)
    seq = context + 1
    return ForwardBatch(
        input_ids=torch.randint(0, 128_000, (batch,), generator=g),
        positions=torch.full((batch,), context), out_cache_loc=torch.arange(batch),
        extend_lens=[1] * batch, prefix_lens=[context] * batch,
        kv_indptr=torch.arange(batch + 1) * seq,
        kv_indices=torch.randint(1, 2_000_000, (batch * seq,), generator=g),
        logits_indices=torch.arange(batch), max_position=context,
    )


def _rank(rank: int, port: int, args: argparse.Namespace, out: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        for bs in args.batch_sizes:
            plan = decode_plan(bs, args.context)
            times = []
            for i in range(args.warmup + args.iters):
                dist.barrier()
                t0 = time.perf_counter()
                box = [StepMessage(i, plan) if rank == 0 else None]
                dist.broadcast_object_list(box, src=0)
                if i >= args.warmup:
                    times.append(time.perf_counter() - t0)
            times.sort()
            out.put((rank, bs, times[len(times) // 2]))
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", default="1,64,256")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    args.batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, args, q)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=600)
        if p.exitcode != 0:
            raise RuntimeError(f"a broadcast rank failed (exit code {p.exitcode})")
    got: dict[tuple[int, int], float] = {}
    while not q.empty():
        rank, bs, t = q.get()
        got[(rank, bs)] = t
    rows = []
    for bs in args.batch_sizes:
        size = len(pickle.dumps(StepMessage(0, decode_plan(bs, args.context))))
        rows.append({"batch_size": bs, "message_bytes": size, "rank0_ms": 1e3 * got[(0, bs)],
                     "rank1_ms": 1e3 * got[(1, bs)]})
    print_table(["batch", "message bytes", "rank 0 broadcast ms", "rank 1 has it ms"],
                [[r["batch_size"], r["message_bytes"], r["rank0_ms"], r["rank1_ms"]]
                 for r in rows],
                title=f"plan broadcast over gloo, decode plans with {args.context}-token contexts")
    return write_json(args.out, {"benchmark": "plan_broadcast", "context": args.context,
                                 "iters": args.iters, "rows": rows})


if __name__ == "__main__":
    main()
