"""What handing a step's plan to the other ranks costs: the driver's `broadcast_object_list` of a
`StepMessage` over the gloo plan group, as `DistributedRunner` does every step.

    python -m benchmarks.bench_plan_broadcast --batch-sizes 1,64,256 --context 1024 --out b.json

Two processes on this host (CPU; no GPU needed). For decode plans of each batch size with
`--context`-token contexts it reports the pickled message size, the time rank 0 spends in the
broadcast, and the time until rank 1 holds the unpickled message (both from a barrier; median
of `--iters`). Why it matters: a TP rank cannot launch its step before it has the plan, so the
receive time sits on every step's critical path (the tp2 batch-1 profile on the H200 pair shows
~2.2 ms of host time per step). A whole plan carries every sequence's `kv_indices`, so it
grows with batch × context; the encoded plan (`distributed.plan_codec`, what the driver sends)
carries each row's new slots only. Both are timed: the encoded mode includes rank 0's encode
and rank 1's rebuild.
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
from phaseflip.cache.kv_pool import ReqToTokenTable
from phaseflip.distributed.group import free_port
from phaseflip.distributed.plan_codec import PlanDecoder, PlanEncoder
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


class TableSteps:
    """Decode plans from a request table whose rows grow by one slot a step (what the
    scheduler builds), for the encoded mode."""

    def __init__(self, batch: int, context: int) -> None:
        self.table = ReqToTokenTable(batch + 1, context + 4096)
        self.rows = [self.table.alloc() for _ in range(batch)]
        for r in self.rows:
            self.table.write(r, 0, torch.randint(1, 2_000_000, (context,)))
        self.len = context - 1

    def next(self) -> ForwardBatch:
        b = len(self.rows)
        for r in self.rows:
            self.table.table[r, self.len] = 1 + r
        plan = ForwardBatch.from_table(self.table.table, self.rows, [self.len] * b, [1] * b,
                                       [1] * b, list(range(b)), self.table.epochs)
        self.len += 1
        return plan


def _time(rank: int, args: argparse.Namespace, make, send, receive) -> float:
    times = []
    for i in range(args.warmup + args.iters):
        plan = make() if rank == 0 else None  # building the plan is the scheduler's cost
        dist.barrier()
        t0 = time.perf_counter()
        box = [send(plan, i) if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        if rank != 0:
            receive(box[0])
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def _rank(rank: int, port: int, args: argparse.Namespace, out: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        for bs in args.batch_sizes:
            plan = decode_plan(bs, args.context)
            whole = _time(rank, args, lambda p=plan: p, lambda p, i: StepMessage(i, p),
                          lambda m: None)
            steps, enc, dec = TableSteps(bs, args.context), PlanEncoder(), PlanDecoder()
            encoded = _time(rank, args, steps.next,
                            lambda p, i, enc=enc: StepMessage(i, enc.encode(p)),
                            lambda m, dec=dec: dec.decode(m.plan))
            out.put((rank, bs, whole, encoded))
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
    got: dict[tuple[int, int], tuple[float, float]] = {}
    while not q.empty():
        rank, bs, whole, encoded = q.get()
        got[(rank, bs)] = (whole, encoded)
    rows = []
    for bs in args.batch_sizes:
        steps, enc = TableSteps(bs, args.context), PlanEncoder()
        enc.encode(steps.next())
        rows.append({
            "batch_size": bs,
            "message_bytes": len(pickle.dumps(StepMessage(0, decode_plan(bs, args.context)))),
            "encoded_bytes": len(pickle.dumps(StepMessage(0, enc.encode(steps.next())))),
            "rank0_ms": 1e3 * got[(0, bs)][0], "rank1_ms": 1e3 * got[(1, bs)][0],
            "encoded_rank0_ms": 1e3 * got[(0, bs)][1],
            "encoded_rank1_ms": 1e3 * got[(1, bs)][1]})
    print_table(["batch", "whole plan bytes", "rank 0 ms", "rank 1 has it ms",
                 "new slots only bytes", "rank 0 ms", "rank 1 has it ms"],
                [[r["batch_size"], r["message_bytes"], r["rank0_ms"], r["rank1_ms"],
                  r["encoded_bytes"], r["encoded_rank0_ms"], r["encoded_rank1_ms"]]
                 for r in rows],
                title=f"plan broadcast over gloo, decode plans with {args.context}-token contexts")
    return write_json(args.out, {"benchmark": "plan_broadcast", "context": args.context,
                                 "iters": args.iters, "rows": rows})


if __name__ == "__main__":
    main()
