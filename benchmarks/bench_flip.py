"""What a phase flip costs a running engine: the seam's segments and the steps around it.

    python -m benchmarks.bench_flip --model llama-3.1-8b --load-format dummy \\
        --layouts tp2,pp2,tp2 --num-prompts 64 --flip-every 40 --out flip.json --plot flip.png

Starts the engine in the first layout (HiCache on, as flips require), submits the workload,
steps its core and, every `--flip-every` steps, flips to the next layout of `--layouts`
(`tpN` = N-way tensor parallel, `ppN` = N pipeline stages, `tpNxppM` both) until the list is
done, then runs the workload to its end. Reported per flip: the seam census (each segment's
seconds, requests retracted, tree slots freed, fence time, weights strategy), the seam's wall
time, and the first step after it (which re-admits and re-prefills what was retracted, from
the host tier). Every step's wall time is kept, so `--plot` draws the timeline with the flips.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from benchmarks.common import (
    add_model_args,
    add_workload_args,
    engine_with_workload,
    print_table,
    release_engine,
    write_json,
)
from benchmarks.plot import pyplot, save
from phaseflip.config import parse_layout


def _layout(text: str) -> tuple[int, int]:
    try:
        return parse_layout(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(ap)
    add_workload_args(ap)
    ap.add_argument("--layouts", type=lambda v: [_layout(x) for x in v.split(",")],
                    default=[(2, 1), (1, 2), (2, 1)],
                    help="the starting layout, then each flip's target (default tp2,pp2,tp2)")
    ap.add_argument("--flip-every", type=int, default=40, help="steps between flips")
    ap.add_argument("--max-running-requests", type=int, default=64)
    ap.add_argument("--hicache-host-gb", type=float, default=8.0)
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--plot", default=None, help="write the step timeline PNG here (and the "
                    "seams' breakdown beside it, NAME_breakdown.png)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if len(args.layouts) < 2:
        ap.error("--layouts needs a starting layout and at least one target")
    return args


def run(core: Any, args: argparse.Namespace, total_out: int) -> tuple[list, list, int]:
    """Steps the core to the end, flipping on schedule; returns (step records, flip records,
    output tokens seen)."""
    steps, flips, produced = [], [], 0
    targets = list(args.layouts[1:])
    t_start = time.perf_counter()
    bar = tqdm(total=total_out, unit="tok", desc="flip run")
    step = 0
    while core.has_work():
        deltas = []
        if targets and step > 0 and step % args.flip_every == 0:
            tp, pp = targets.pop(0)
            t0 = time.perf_counter()
            census, deltas = core.flip(tp, pp)
            flips.append({"step": step, "at_s": t0 - t_start,
                          "wall_s": time.perf_counter() - t0} | census.as_dict())
            print(census.done_line())
        t0 = time.perf_counter()
        deltas += core.step()
        n = sum(len(d.token_ids) for d in deltas)
        steps.append({"step": step, "at_s": t0 - t_start, "seconds": time.perf_counter() - t0,
                      "tokens": n, "running": len(core.scheduler.running),
                      "after_flip": bool(flips) and flips[-1]["step"] == step})
        produced += n
        bar.update(n)
        step += 1
    bar.close()
    return steps, flips, produced


def plot_breakdown(flips: list[dict], path: Path) -> None:
    """One stacked bar per flip: the seam's segments, the relayout split into rank 0's build
    parts (weights, waiting for the ranks, KV pool, graphs, other)."""
    fig, ax = pyplot().subplots(figsize=(max(5, 1.4 * len(flips) + 3), 4))
    labels = [f"{i + 1}: {f['source']}→{f['target']}" for i, f in enumerate(flips)]
    names = list(dict.fromkeys(n for f in flips for n in f["segments"] if n != "relayout"))
    parts = list(dict.fromkeys(k for f in flips for k in (f.get("relayout_parts") or {})))
    bottom = [0.0] * len(flips)
    for name, get in [(n, lambda f, n=n: f["segments"].get(n, 0.0)) for n in names] + [
            (f"relayout: {p}", lambda f, p=p: (f.get("relayout_parts") or {}).get(p, 0.0))
            for p in parts]:
        heights = [1e3 * get(f) for f in flips]
        ax.bar(labels, heights, bottom=bottom, label=name)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_ylabel("ms")
    ax.set_title("seam breakdown")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.tick_params(axis="x", labelsize=7)
    save(fig, path)


def plot_timeline(steps: list[dict], flips: list[dict], path: str) -> None:
    fig, ax = pyplot().subplots(figsize=(10, 4))
    ax.scatter([s["at_s"] for s in steps], [1e3 * s["seconds"] for s in steps], s=4,
               label="step")
    for f in flips:
        ax.axvspan(f["at_s"], f["at_s"] + f["wall_s"], color="tab:red", alpha=0.2)
        ax.text(f["at_s"], ax.get_ylim()[1], f"{f['source']}→{f['target']}", fontsize=7,
                va="top")
    ax.set_xlabel("seconds since the first step (shaded: flip seams)")
    ax.set_ylabel("step time (ms)")
    ax.set_yscale("log")
    save(fig, Path(path))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    tp, pp = args.layouts[0]
    engine, work = engine_with_workload(args, tp_size=tp, pp_size=pp, enable_hicache=True,
                                        enable_flip=True, hicache_host_gb=args.hicache_host_gb)
    core = engine.core
    t0 = time.perf_counter()
    try:
        steps, flips, produced = run(core, args, work.output_tokens)
    finally:
        seconds = time.perf_counter() - t0
        release_engine(engine)
    if produced != work.output_tokens:
        raise RuntimeError(f"expected {work.output_tokens} output tokens, got {produced}")
    after = {s["step"]: s["seconds"] for s in steps if s["after_flip"]}
    for f in flips:
        f["first_step_after_s"] = after.get(f["step"])
    result = {"benchmark": "flip", "model": args.model, "dataset": args.dataset,
              "num_prompts": args.num_prompts, "layouts": args.layouts,
              "flip_every": args.flip_every, "seconds": seconds, "output_tokens": produced,
              "flips": flips, "steps": steps}
    _print(result)
    result = write_json(args.out, result)  # before the plots: a failed plot keeps the figures
    if args.plot:
        plot_timeline(steps, flips, args.plot)
        if flips:
            plot = Path(args.plot)
            plot_breakdown(flips, plot.with_name(plot.stem + "_breakdown" + plot.suffix))
    return result


def _print(result: dict[str, Any]) -> None:
    flips = result["flips"]
    names = list(dict.fromkeys(k for f in flips for k in f["segments"]))
    parts = list(dict.fromkeys(k for f in flips for k in (f.get("relayout_parts") or {})))
    rows = [[f"{f['source']}→{f['target']}", f["step"], f["retracted"], f["wall_s"],
             *(f["segments"].get(n, 0.0) for n in names),
             *((f.get("relayout_parts") or {}).get(n, "") for n in parts),
             f.get("weights"), _gib(f.get("weights_bytes_moved")),
             "-" if f.get("weights_gbps") is None else f"{f['weights_gbps']:.2f}",
             f.get("graph_capture") or "eager",
             f"{f.get('kv_slots_before')}→{f.get('kv_slots_after')}",
             _gib(f.get("device_free_after_bytes")), f["first_step_after_s"]]
            for f in flips]
    print_table(["flip", "at step", "retracted", "seam s", *(f"{n} s" for n in names),
                 *(f"relayout: {n} s" for n in parts), "weights", "GiB moved", "GB/s",
                 "graphs", "KV slots", "device free GiB", "next step s"], rows,
                title=f"phase flips: {result['output_tokens']} output tokens in "
                      f"{result['seconds']:.1f} s")


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.3f}"


if __name__ == "__main__":
    main()
