"""How much work the host can queue ahead of the GPU before a launch blocks.

Why: in FP8 offline runs an eager mixed step's `forward` returns only when the GPU is nearly
through the step before it, and the GPU then idles while the host prepares the next step.
If the launch queue holds a fixed number of launches, a step of ~650 small launches leaves
little GPU time queued; a CUDA graph (one launch for many kernels) queues more. This probe
parks the GPU on a long sleep kernel, then times each of many tiny launches (a torch add, a
Triton RMSNorm, a CUDA-graph replay of 20 adds): the launch count at which one first blocks is
the queue's depth for that kind of launch.

    python -m benchmarks.launch_queue_probe --out queue.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def _depth(launch, n_max: int, sleep_cycles: int) -> dict:
    torch.cuda.synchronize()
    torch.cuda._sleep(sleep_cycles)
    times = []
    t_all = time.perf_counter()
    for _ in range(n_max):
        t = time.perf_counter()
        launch()
        times.append(time.perf_counter() - t)
        if times[-1] > 5e-3:
            break
    total = time.perf_counter() - t_all
    torch.cuda.synchronize()
    first_block = next((i for i, s in enumerate(times) if s > 1e-3), None)
    return {"launches_before_block": first_block, "tried": len(times),
            "blocked_ms": times[-1] * 1e3, "host_s": total,
            "median_launch_us": sorted(times)[len(times) // 2] * 1e6}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n-max", type=int, default=20000)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev = torch.device("cuda")
    cycles = int(3e9)  # ~1.5-2 s at the H200's clocks: longer than any queue fills
    x = torch.zeros(16, device=dev)
    out = {}
    out["torch add"] = _depth(lambda: x.add_(1), args.n_max, cycles)
    from phaseflip.kernels.norm import rms_norm

    h = torch.randn(4, 4096, device=dev, dtype=torch.bfloat16)
    w = torch.ones(4096, device=dev, dtype=torch.bfloat16)
    rms_norm(h, w, 1e-6)
    out["triton rms_norm"] = _depth(lambda: rms_norm(h, w, 1e-6), args.n_max, cycles)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        x.add_(1)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        for _ in range(20):
            x.add_(1)
    g.replay()
    out["graph of 20 adds"] = _depth(g.replay, args.n_max, cycles)
    for k, v in out.items():
        print(k, v, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"torch": torch.__version__, "results": out}, f, indent=1)


if __name__ == "__main__":
    main()
