"""Tuning the skinny GEMM on the GPU: time candidate configs as CUDA-graph replays over weights
larger than L2 and keep the winners in `linear_configs.TUNED` (benchmarks/linear_kernels.py --tune;
the H200 table ships in phaseflip/assets/kernel_configs)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from functools import partial

import torch
from triton.errors import TritonError

from phaseflip.kernels.linear import DEFAULT_M_VALUES, skinny_linear
from phaseflip.kernels.linear_configs import TUNED, ConfigTable, SkinnyConfig, candidate_configs


def graph_time_us(calls: Sequence[Callable[[], object]], replays: int = 20) -> float:
    """Median GPU µs per call of `calls` replayed back to back from one CUDA graph (no host
    launch overhead: what a captured decode step pays). Calls are run once eagerly first."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    times_ms = []
    for _ in range(replays):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times_ms.append(start.elapsed_time(end))
    del graph
    return statistics.median(times_ms) * 1e3 / len(calls)


def weight_copies(n: int, k: int, dtype: torch.dtype, device: torch.device) -> int:
    """How many distinct weights a timing loop cycles through so that together they are >= 4x
    the L2 (each call then streams from HBM, as in a real decode step)."""
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 << 20)
    return max(1, min(16, math.ceil(4 * l2 / (n * k * dtype.itemsize))))


def fp8_weights(n: int, k: int, copies: int, device: torch.device
                ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`copies` random FP8 weights [n, k] with their float32 row scales, quantized per row as
    the model's are (`model.quant.fp8.quantize_rows`; not imported: kernels sit below model)."""
    fp8 = torch.float8_e4m3fn
    out = []
    for _ in range(copies):
        w = torch.randn(n, k, device=device) * k**-0.5
        scale = w.abs().amax(dim=1).clamp_min(1e-12) / torch.finfo(fp8).max
        out.append(((w / scale[:, None]).to(fp8), scale))
    return out


def _rows(m: int, k: int, dtype: torch.dtype, device: torch.device, w8a8: bool
          ) -> tuple[torch.Tensor, torch.Tensor | None, torch.dtype | None]:
    """Random x [m, k] as `tune` feeds it: `dtype` rows, or (W8A8) FP8 rows with per-row
    scales (the per-token quantization of `model.quant.fp8`, not imported: kernels sit below
    model) and the output dtype."""
    x = torch.randn(m, k, device=device)
    if not w8a8:
        return x.to(dtype), None, None
    fp8 = torch.float8_e4m3fn
    scale = x.abs().amax(dim=1).clamp_min(1e-12) / torch.finfo(fp8).max
    return (x / scale[:, None]).to(fp8), scale, dtype


def tune(shapes: Iterable[tuple[int, int]], dtype: torch.dtype, device: torch.device, *,
         m_values: Sequence[int] = DEFAULT_M_VALUES, table: ConfigTable = TUNED,
         calls: int = 16, weight_dtype: torch.dtype | None = None, w8a8: bool = False
         ) -> dict[tuple[int, int, int], tuple[SkinnyConfig, float]]:
    """Time `candidate_configs` for each (M bucket, N, K) with `graph_time_us` over up to
    `calls` calls cycling through L2-busting weight copies (4 per copy: a weight far larger than
    the L2 needs few); store the fastest in `table`. Returns {(m, n, k): (best config, µs per
    call)}. Allocates real-size weights; not for capture. ~100 compiles on a cold Triton cache
    for all M buckets, then well under a second per (shape, M). `weight_dtype`: the weights'
    when not x's (FP8, with row scales); its table entries are keyed by it. `w8a8`: x is FP8
    as well, with row scales (`dtype` is then the output's); keyed apart (`W8A8_SUFFIX`)."""
    if device.type != "cuda":
        raise ValueError("tune needs a CUDA device")
    wdtype = weight_dtype or dtype
    best: dict[tuple[int, int, int], tuple[SkinnyConfig, float]] = {}
    for n, k in dict.fromkeys(shapes):
        copies = weight_copies(n, k, wdtype, device)
        ws = (fp8_weights(n, k, copies, device) if wdtype.itemsize == 1 else
              [(torch.randn(n, k, device=device).to(dtype), None) for _ in range(copies)])
        for m in dict.fromkeys(m_values):
            x, xs, out_dtype = _rows(m, k, dtype, device, w8a8)
            y = torch.empty(m, n, dtype=dtype, device=device)
            timed: list[tuple[float, SkinnyConfig]] = []
            for cfg in candidate_configs(m, n, k, wdtype, device, w8a8=w8a8):
                fns = [partial(skinny_linear, x, ws[i % copies][0], None, y,
                               weight_scale=ws[i % copies][1], x_scale=xs,
                               out_dtype=out_dtype, config=cfg)
                       for i in range(min(calls, 4 * copies))]
                try:
                    timed.append((graph_time_us(fns, replays=5), cfg))
                except (RuntimeError, TritonError):  # e.g. out of shared memory: skip
                    continue
            us, cfg = min(timed, key=lambda t: t[0])
            table.put(m, n, k, wdtype, cfg, w8a8)
            best[(m, n, k)] = (cfg, us)
        del ws
    return best
