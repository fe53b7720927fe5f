"""Two nano-batches in flight: does one half's decode attention run under the other half's GEMMs?

    python -m benchmarks.nano_overlap_probe --out probe.json
    python -m benchmarks.nano_overlap_probe --quantization fp8 --kv-cache-dtype fp8_e4m3

The offline workload's decode steps at hundreds of sequences spend about as long in attention
(memory-bound: the pool's K/V) as in the projections (compute-bound): run one after the other,
each leaves the other's resource idle. This probe measures, before any engine change, whether
running them side by side pays: Llama-3.1-8B's first `--layers` layers (dummy weights) and a
decode batch of B sequences with contexts around a mean, each as a CUDA graph of the layers:

- serial: the batch through every layer as the engine runs it today;
- halves: two halves of the batch one after the other on one stream (what halving the GEMM
  rows costs: the weights are read twice);
- overlap: the halves pipelined, each half's rotary + attention on a side stream while the
  main stream runs the other half's projections (main: pre(A, l), post(B, l-1), pre(B, l),
  post(A, l), ...), with the side stream at normal or high priority.

Prints µs per layer of each and the overlap's gain over serial, and the largest difference of
the hidden states against serial (the halves' GEMMs may pick other kernels: not bitwise).

Measured on an H100 (2026-12-07, docs/benchmarks.md "Two decode halves in flight"): the
overlap was 1.03-1.47x slower a layer than serial at 64-1024 sequences, bf16 and FP8; the
engine path built on it was reverted.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
from collections.abc import Callable

import torch

from benchmarks.common import write_json
from phaseflip.attention.triton_backend import TritonAttention
from phaseflip.config import EngineConfig
from phaseflip.forward_batch import ForwardBatch
from phaseflip.kernels.gemm_rows import empty_rows
from phaseflip.model.config import ModelConfig
from phaseflip.model.quant.fp8 import output_rows
from phaseflip.model.resolve import resolve_model
from phaseflip.model.runner import ModelRunner

# (sequences, mean context): the offline run's decode phase (all resident, then finishing)
# and its tail
CASES = ((1024, 450), (768, 550), (512, 650), (256, 900), (128, 1200), (64, 1500))


def make_batch(b: int, mean: int, num_slots: int, seed: int = 0) -> ForwardBatch:
    """B one-token sequences, contexts uniform in [mean/4, 7 mean/4], on shuffled 16-slot
    pages; each new token's slot is its sequence's last."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(max(1, mean // 4), 2 * mean - mean // 4 + 1, (b,), generator=gen)
    pages = [-(-int(n) // 16) for n in lens]
    if sum(pages) * 16 > num_slots:
        raise SystemExit(f"{b} x {mean}: {sum(pages) * 16} slots, the pool has {num_slots}")
    perm = torch.randperm(num_slots // 16, generator=gen)[: sum(pages)]
    slots, start = [], 0
    for n, p in zip(lens.tolist(), pages):
        s = (perm[start:start + p, None] * 16 + torch.arange(16)).reshape(-1)[:n]
        slots.append(s)
        start += p
    indptr = torch.zeros(b + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(lens, 0)
    return ForwardBatch(
        input_ids=torch.randint(0, 1000, (b,), generator=gen),
        positions=lens - 1, out_cache_loc=torch.stack([s[-1] for s in slots]),
        extend_lens=[1] * b, prefix_lens=(lens - 1).tolist(), kv_indptr=indptr,
        kv_indices=torch.cat(slots), logits_indices=torch.arange(b),
        max_position=int(lens.max()) - 1)


class Layers:
    """The unfolded decoder layer (`model.llama.DecoderLayer.forward`) cut at attention:
    `pre` (norm, qkv), `attend` (rotary, KV store, attention), `post` (o, norm, MLP)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.model, self.pool = runner.model, runner.pool

    def pre(self, i: int, x, residual):
        layer = self.model.layers[i]
        quantize = layer.self_attn.qkv_proj.takes_fp8_input(output_rows(x))
        if residual is None:
            residual, x = x, layer.input_layernorm(x, quantize=quantize)
        else:
            x, residual = layer.input_layernorm(x, residual, quantize=quantize)
        return layer.self_attn.qkv_proj(x), residual

    def attend(self, i: int, qkv, batch, rotary, backend, out):
        attn = self.model.layers[i].self_attn
        q, k, v = qkv
        q = q.view(-1, attn.num_heads, attn.head_dim)
        k = k.view(-1, attn.num_kv_heads, attn.head_dim)
        v = v.view(-1, attn.num_kv_heads, attn.head_dim)
        q = rotary.rotate_and_store_(q, k, v, self.pool, attn.layer_id, batch.out_cache_loc)
        return backend.forward(attn.layer_id, q, k, v, batch, self.pool, attn.scale,
                               attn.sliding_window, out=out, kv_stored=True)

    def post(self, i: int, o, residual, fold_out: bool):
        layer = self.model.layers[i]
        x = layer.self_attn.o_proj(o, fold=True)
        quantize = layer.mlp.gate_up_proj.takes_fp8_input(output_rows(x))
        x, residual = layer.post_attention_layernorm(x, residual, quantize=quantize)
        return layer.mlp(x, fold=fold_out), residual

    def out_buffer(self, rows: int, like: torch.Tensor) -> torch.Tensor:
        attn = self.model.layers[0].self_attn
        return empty_rows(rows, attn.num_heads * attn.head_dim, like.dtype, like.device,
                          fp8=False)


def serial(layers: Layers, batch: ForwardBatch, backend: TritonAttention) -> torch.Tensor:
    model = layers.model
    x, residual = model.embed_tokens(batch.input_ids), None
    rotary = model.rope.for_batch(batch.positions, x.dtype, max_position=batch.max_position)
    last = len(model.layers) - 1
    for i in range(len(model.layers)):
        qkv, residual = layers.pre(i, x, residual)
        out = layers.out_buffer(qkv[0].shape[0], qkv[0])
        o = layers.attend(i, qkv, batch, rotary, backend, out)
        x, residual = layers.post(i, o, residual, fold_out=i < last)
    return x + residual  # the last layer's output is never left scaled (fold_out False)


def pipelined(layers: Layers, halves: list[ForwardBatch], backends: list[TritonAttention],
              side: torch.cuda.Stream | None) -> torch.Tensor:
    """The halves through the layers, each half's attention on `side` (None: one stream,
    the halves' work in the same order: the `halves` arm)."""
    model = layers.model
    n = len(model.layers)
    main = torch.cuda.current_stream() if side is not None else None
    xs = [model.embed_tokens(h.input_ids) for h in halves]
    rs: list = [None, None]
    rot = [model.rope.for_batch(h.positions, xs[0].dtype, max_position=h.max_position)
           for h in halves]
    pending: list = [None, None]  # (qkv held alive, attention out, its event) per half

    def launch(h: int, i: int) -> None:
        qkv, rs[h] = layers.pre(i, xs[h], rs[h])
        out = layers.out_buffer(qkv[0].shape[0], qkv[0])  # allocated on main: freed in order
        if side is None:
            pending[h] = (qkv, layers.attend(i, qkv, halves[h], rot[h], backends[h], out), None)
            return
        side.wait_stream(main)
        with torch.cuda.stream(side):
            layers.attend(i, qkv, halves[h], rot[h], backends[h], out)
            done = torch.cuda.Event()
            done.record(side)
        pending[h] = (qkv, out, done)

    def finish(h: int, i: int) -> None:
        _, out, done = pending[h]
        if done is not None:
            main.wait_event(done)
        xs[h], rs[h] = layers.post(i, out, rs[h], fold_out=i < n - 1)
        pending[h] = None

    launch(0, 0)
    launch(1, 0)
    for i in range(n):
        finish(0, i)
        if i + 1 < n:
            launch(0, i + 1)
        finish(1, i)
        if i + 1 < n:
            launch(1, i + 1)
    return torch.cat([x + r for x, r in zip(xs, rs)])


def halve(batch: ForwardBatch) -> list[ForwardBatch]:
    """Two halves of a decode batch, each its own tensors (the split's views re-based)."""
    return [dataclasses.replace(p, kv_indptr=p.kv_indptr.contiguous(),
                                kv_indices=p.kv_indices.contiguous()) for p in batch.split(2)]


def timed(fn: Callable[[], torch.Tensor], graph: bool, reps: int) -> tuple[float, torch.Tensor]:
    """(median ms of `reps` replays, the output) of `fn` captured as a CUDA graph."""
    out = fn()  # warm: plans, workspaces, compiles
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            out = fn()
        run = g.replay
    else:
        run = fn
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times[2:] or times), out


def carveout(sms: int | None) -> None:
    """cuBLAS(Lt) GEMMs captured from here leave `sms` SMs free (None: all SMs)."""
    torch._C._set_sm_carveout_experimental(sms)


def gemm_us(rows: int, carve: tuple[int, ...]) -> dict[str, float]:
    """µs of one bf16 gate_up-shaped GEMM at each carveout: whether cuBLAS honours it."""
    from triton.testing import do_bench

    x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(28672, 4096, device="cuda", dtype=torch.bfloat16)
    out = {}
    for c in (0, *carve):
        carveout(c or None)
        out[str(c)] = round(do_bench(lambda: torch.nn.functional.linear(x, w)) * 1e3, 1)
    carveout(None)
    return out


def probe_case(layers: Layers, b: int, mean: int, reps: int, graph: bool,
               carve: tuple[int, ...] = ()) -> dict:
    runner_slots = layers.pool.num_slots
    dev = layers.model.embed_tokens.weight.device
    batch = make_batch(b, mean, runner_slots).to(dev)
    torch.cuda.synchronize()
    halves = halve(batch)
    n = len(layers.model.layers)
    row = {"batch": b, "mean_ctx": mean, "layers": n}
    backend = TritonAttention()
    t, ref = timed(lambda: serial(layers, batch, backend), graph, reps)
    row["serial_us"] = t * 1e3 / n
    arms = {"halves": None, "overlap": torch.cuda.Stream(),
            "overlap_hi": torch.cuda.Stream(priority=-1)}
    for name, side in arms.items():
        backends = [TritonAttention(), TritonAttention()]
        t, out = timed(functools.partial(pipelined, layers, halves, backends, side), graph,
                       reps)
        row[f"{name}_us"] = t * 1e3 / n
        row[f"{name}_max_diff"] = float((out.float() - ref.float()).abs().max())
    for c in carve:  # the projections leave c SMs to the other half's attention
        backends = [TritonAttention(), TritonAttention()]
        carveout(c)
        try:
            t, out = timed(functools.partial(pipelined, layers, halves, backends,
                                             torch.cuda.Stream()), graph, reps)
        finally:
            carveout(None)
        row[f"overlap_c{c}_us"] = t * 1e3 / n
    best = min(v for k, v in row.items() if k.startswith("overlap") and k.endswith("_us"))
    row["overlap_gain"] = row["serial_us"] / best
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--quantization", default=None, choices=[None, "fp8"])
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--slots", type=int, default=1_200_000)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--cases", default=None, help="B:MEAN,... (default: CASES)")
    ap.add_argument("--carveouts", default="",
                    help="SM counts the overlap's GEMMs leave free, e.g. 16,32,48 (cuBLAS)")
    ap.add_argument("--cublaslt", action="store_true", help="prefer cuBLASLt for GEMMs")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    cfg = resolve_model(EngineConfig(
        model=args.model, load_format="dummy", device="cuda", quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype, disable_cuda_graph=True, max_running_requests=1024,
        max_total_tokens=args.slots, piecewise_graph_max_tokens=0, attention_backend="triton"))
    model_cfg = dataclasses.replace(ModelConfig.from_dir(cfg.model), num_layers=args.layers)
    layers = Layers(ModelRunner(cfg, model_cfg))
    cases = CASES if args.cases is None else [tuple(map(int, c.split(":")))
                                              for c in args.cases.split(",")]
    carve = tuple(int(c) for c in args.carveouts.split(",") if c)
    if args.cublaslt:
        torch.backends.cuda.preferred_blas_library("cublaslt")
    rows = []
    result = {"quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype,
              "cublaslt": args.cublaslt, "rows": rows}
    if carve:
        result["gemm_us_by_carveout"] = {r: gemm_us(r, carve) for r in (256, 512)}
        print("gate_up GEMM us by carveout:", result["gemm_us_by_carveout"], flush=True)
    with torch.inference_mode():
        for b, mean in cases:
            row = probe_case(layers, b, mean, args.reps, not args.eager, carve)
            rows.append(row)
            arms = "  ".join(f"{k[:-3]} {v:7.1f}" for k, v in row.items() if k.endswith("_us"))
            print(f"B={b:5d} ctx~{mean:5d}: {arms} us/layer  gain {row['overlap_gain']:.3f}x  "
                  f"diff {row['overlap_max_diff']:.3g}", flush=True)
            write_json(args.out, result)


if __name__ == "__main__":
    main()
