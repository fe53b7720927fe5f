"""PNG figures from the JSON files the benchmark scripts write.

    python -m benchmarks.plot lat.json offline.json serving.json --out-dir figs/

Per input (recognised by its `benchmark` field):
  latency  -> latency_steps.png (decode step-time CDF per batch size, transformers dashed) and
              latency_throughput.png (decode tokens/s and MBU vs batch size)
  offline  -> offline_throughput.png (the input/output lengths used, as histograms, and
              tokens/s, phaseflip vs transformers when measured)
  serving  -> serving_latency.png (TTFT / ITL / E2E histograms and CDFs)
Each figure's title carries the model, device and commit, so a PNG is never anonymous.

    python -m benchmarks.plot multi-gpu docs/results/2026-11-29/multi_gpu --out-dir docs/figs

draws multi_gpu_layouts.png (tp1 / tp2 / pp2 per workload: the JSON in that folder plus the
figures of runs whose JSON did not come back, MULTI_GPU_TABLE, drawn hatched) and
multi_gpu_bandwidth.png (bus bandwidth vs message size, from comm.json).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np


def pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display on the benchmark machines
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: Path) -> Path:
    """Lays the figure out, writes it as a PNG and frees it."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    pyplot().close(fig)
    return path


def _subtitle(d: dict[str, Any]) -> str:
    env = d.get("env", {})
    return (f"{d.get('model')} | {env.get('gpu') or 'cpu'} | {d.get('dtype', '')} | "
            f"commit {str(env.get('commit', '?'))[:10]} | {str(env.get('date', ''))[:10]}")


def _cdf(ax, values: list[float], label: str, scale: float = 1e3, **kw: Any) -> None:
    v = np.sort(np.asarray([x for x in values if x is not None], dtype=float)) * scale
    if v.size:
        ax.plot(v, np.arange(1, v.size + 1) / v.size, label=label, **kw)


def plot_latency(d: dict[str, Any], out: Path) -> list[Path]:
    plt = pyplot()
    rows = d["results"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        (line,) = ax.plot([], [])
        color = line.get_color()
        _cdf(ax, r["decode_step_times_s"], f"phaseflip bs={r['batch_size']}", color=color)
        if r.get("hf"):
            _cdf(ax, r["hf"]["decode_step_times_s"], f"transformers bs={r['batch_size']}",
                 color=color, linestyle="--")
    ax.set_xscale("log")
    ax.set_xlabel("decode step time (ms)")
    ax.set_ylabel("fraction of steps")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(f"Decode step time, input {d['input_len']}, output {d['output_len']}")
    ax.set_title(_subtitle(d), fontsize=8)
    p1 = save(fig, out / "latency_steps.png")

    bs = [r["batch_size"] for r in rows]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    a1.plot(bs, [r["decode_tokens_per_s"] for r in rows], "o-", label="phaseflip")
    hf = [(r["batch_size"], r["hf"]["decode_tokens_per_s"]) for r in rows if r.get("hf")]
    if hf:
        a1.plot(*zip(*hf), "s--", label="transformers")
    a1.set_xlabel("batch size")
    a1.set_ylabel("decode tokens/s (1 / median step × batch)")
    a1.set_xscale("log", base=2)
    a1.grid(True, alpha=0.3)
    a1.legend(fontsize=8)
    a2.plot(bs, [100 * (r["mbu_decode"] or 0) for r in rows], "o-", label="MBU decode")
    a2.plot(bs, [100 * (r["mfu_prefill"] or 0) for r in rows], "^-", label="MFU prefill")
    a2.set_xlabel("batch size")
    a2.set_ylabel("% of H200 ceiling")
    a2.set_xscale("log", base=2)
    a2.grid(True, alpha=0.3)
    a2.legend(fontsize=8)
    fig.suptitle(f"Throughput vs batch size — {_subtitle(d)}", fontsize=9)
    p2 = save(fig, out / "latency_throughput.png")
    return [p1, p2]


def plot_offline(d: dict[str, Any], out: Path) -> list[Path]:
    plt = pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    a1.hist(d["input_lens"], bins=40, alpha=0.6, label="input")
    a1.hist(d["output_lens"], bins=40, alpha=0.6, label="output")
    a1.set_xlabel("tokens")
    a1.set_ylabel("requests")
    a1.legend(fontsize=8)
    a1.set_title(f"{d['dataset']} lengths (n={len(d['input_lens'])})", fontsize=9)
    engines = [("phaseflip", d["phaseflip"])] + ([("transformers", d["hf"])] if d.get("hf")
                                                  else [])
    keys = ["input_tokens_per_s", "output_tokens_per_s", "total_tokens_per_s"]
    x = np.arange(len(keys))
    width = 0.8 / len(engines)
    for i, (name, r) in enumerate(engines):
        a2.bar(x + i * width, [r[k] for k in keys], width,
               label=f"{name} ({r['num_requests']} req)")
    a2.set_xticks(x + width * (len(engines) - 1) / 2, ["input", "output", "total"])
    a2.set_ylabel("tokens/s")
    a2.legend(fontsize=8)
    a2.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"Offline throughput — {_subtitle(d)}", fontsize=9)
    p = save(fig, out / "offline_throughput.png")
    return [p]


def plot_serving(d: dict[str, Any], out: Path) -> list[Path]:
    plt = pyplot()
    ok = [r for r in d["requests"] if r["ok"]]
    series = {
        "TTFT": [r["ttft"] for r in ok],
        "ITL": [x for r in ok for x in r["itls"]],
        "E2E": [r["e2e"] for r in ok],
    }
    fig, axes = plt.subplots(2, 3, figsize=(12, 6))
    for col, (name, values) in enumerate(series.items()):
        v = np.asarray(values, dtype=float) * 1e3
        if v.size:
            axes[0, col].hist(v, bins=40)
            _cdf(axes[1, col], values, name)
        axes[0, col].set_title(f"{name} (n={v.size})", fontsize=9)
        axes[1, col].set_xlabel(f"{name} (ms)")
        axes[1, col].set_ylabel("fraction")
        axes[1, col].grid(True, alpha=0.3)
    fig.suptitle(f"Serving at {d['request_rate']} req/s, {d['dataset']} — "
                 f"{_subtitle(d)}", fontsize=9)
    p = save(fig, out / "serving_latency.png")
    return [p]


# Llama-3.1-8B shape, bf16, dummy weights. Printed tables only, no JSON (docs/benchmarks.md,
# "Multi-GPU: TP and PP on an H200 pair"); tp1 decode is the single-H200 run (`3e4d590`).
MULTI_GPU_TABLE = {
    "decode_p50_ms_tp1": {1: 4.98, 64: 8.32, 256: 17.78},
    "prefill_32k_s": {"tp1": 1.53, "tp2": 0.833, "pp2": 0.918},
    "long_prompt_total_tok_s": {"tp1": 33156, "tp2": 49740, "pp2": 46913},
}
LAYOUTS = ("tp1", "tp2", "pp2")


def _grouped(ax, groups: list[str], values: dict[str, list[float]],
             table_only: set[tuple[str, int]], fmt: str) -> None:
    """One bar per layout in each group; (layout, group) pairs in table_only are hatched."""
    x = np.arange(len(groups))
    width = 0.8 / len(LAYOUTS)
    for i, lay in enumerate(LAYOUTS):
        bars = ax.bar(x + i * width, values[lay], width, label=lay, color=f"C{i}")
        for g, bar in enumerate(bars):
            if (lay, g) in table_only:
                bar.set_hatch("//")
                bar.set_edgecolor("white")
        ax.bar_label(bars, fmt=fmt, fontsize=7)
    ax.set_xticks(x + width * (len(LAYOUTS) - 1) / 2, groups)
    ax.grid(True, axis="y", alpha=0.3)


def plot_multi_gpu(src: Path, out: Path) -> list[Path]:
    plt = pyplot()
    from matplotlib.patches import Patch

    tab = MULTI_GPU_TABLE
    lat = {k: json.loads((src / f"latency_llama8b_{k}.json").read_text()) for k in LAYOUTS[1:]}
    off = {k: json.loads((src / f"offline_decode_heavy_{k}.json").read_text()) for k in LAYOUTS}
    bs = [1, 64, 256]
    decode = {"tp1": [tab["decode_p50_ms_tp1"][b] for b in bs]}
    for k, d in lat.items():
        p50 = {r["batch_size"]: 1e3 * r["decode_step_s"]["p50"] for r in d["results"]}
        decode[k] = [p50[b] for b in bs]
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(13, 4.5),
                                     gridspec_kw={"width_ratios": [3, 1.3, 2]})
    _grouped(a1, [f"batch {b}" for b in bs], decode, {("tp1", g) for g in range(3)}, "%.2f")
    a1.set_ylabel("decode step p50 (ms), context 1k — lower is better")
    a1.legend(handles=[Patch(color=f"C{i}", label=k) for i, k in enumerate(LAYOUTS)]
              + [Patch(facecolor="grey", edgecolor="white", hatch="//",
                       label="printed table only")], fontsize=8)
    _grouped(a2, ["one 32k prompt"], {k: [v] for k, v in tab["prefill_32k_s"].items()},
             {(k, 0) for k in LAYOUTS}, "%.3g")
    a2.set_ylabel("prefill (s) — lower is better")
    offline = {k: [off[k]["phaseflip"]["output_tokens_per_s"],
                   tab["long_prompt_total_tok_s"][k]] for k in LAYOUTS}
    _grouped(a3, ["decode-heavy\n128→512, output", "long-prompt\n4096→64, total"],
             offline, {(k, 1) for k in LAYOUTS}, "%.0f")
    a3.set_ylabel("offline tokens/s — higher is better")
    env = lat["tp2"]["env"]
    fig.suptitle(f"Llama-3.1-8B shape, bf16, dummy weights | 2× {env['gpu']} (NVLink) | "
                 f"{env['date'][:10]} | commits {lat['pp2']['env']['commit']}, {env['commit']}\n"
                 "hatched: printed tables only (no JSON); tp1 decode: the single-H200 run",
                 fontsize=9)
    p1 = save(fig, out / "multi_gpu_layouts.png")

    comm = json.loads((src / "comm.json").read_text())
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for op in ("all_reduce", "all_gather", "send 0->1", "sendrecv 0<->1 (per direction)"):
        rows = [r for r in comm["rows"] if r["op"] == op]
        ax.plot([r["size_bytes"] for r in rows], [r["busbw_GBps"] for r in rows], "o-",
                label=op)
    ax.set_xscale("log", base=2)
    ax.minorticks_off()
    sizes = comm["sizes_bytes"]
    ax.set_xticks(sizes, [f"{n >> 30} GiB" if n >= 2**30 else f"{n >> 20} MiB" if n >= 2**20
                          else f"{n >> 10} KiB" for n in sizes], fontsize=8, rotation=30)
    small = {r["op"]: r["time_us"] for r in comm["rows"] if "x64" in r["op"]}
    ax.set_xlabel("message size")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, title=(f"8 KiB all-reduce: {small['all_reduce x64 eager']:.1f} µs "
                                 f"eager, {small['all_reduce x64 cuda graph']:.1f} µs "
                                 "in a graph (64/replay)"), title_fontsize=8)
    e = comm["env"]
    ax.set_title(f"NCCL {comm['nccl_version']}, 2× {e['gpu']}, bf16 | commit {e['commit']} | "
                 f"{e['date'][:10]}", fontsize=8)
    p2 = save(fig, out / "multi_gpu_bandwidth.png")
    return [p1, p2]


PLOTTERS = {"latency": plot_latency, "offline": plot_offline, "serving": plot_serving}


def main(argv: list[str] | None = None) -> list[Path]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="JSON files written by the benchmark scripts, "
                    "or `multi-gpu DIR` (the layout comparison from DIR's JSON)")
    ap.add_argument("--out-dir", default=".", help="where the PNGs go")
    ap.add_argument("--prefix", default="", help="prepended to every PNG name")
    args = ap.parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    multi = args.files[0] == "multi-gpu"
    for f in args.files[1:] if multi else args.files:
        if multi:
            paths = plot_multi_gpu(Path(f), out)
        else:
            d = json.loads(Path(f).read_text())
            kind = d.get("benchmark")
            if kind not in PLOTTERS:
                raise SystemExit(f"{f}: not a benchmark result (benchmark={kind!r})")
            paths = PLOTTERS[kind](d, out)
        for p in paths:
            if args.prefix:
                p = p.rename(p.with_name(args.prefix + p.name))
            written.append(p)
            print(f"wrote {p}")
    return written


if __name__ == "__main__":
    main()
