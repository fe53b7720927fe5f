"""PNG figures from the JSON files the benchmark scripts write.

    python -m benchmarks.plot lat.json offline.json serving.json --out-dir figs/

Per input (recognised by its `benchmark` field):
  latency  -> latency_steps.png (decode step-time CDF per batch size, transformers dashed) and
              latency_throughput.png (decode tokens/s and MBU vs batch size)
  offline  -> offline_throughput.png (the input/output lengths used, as histograms, and
              tokens/s, phaseflip vs transformers when measured)
  serving  -> serving_latency.png (TTFT / ITL / E2E histograms and CDFs)
Each figure's title carries the model, device and commit, so a PNG is never anonymous.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np


def _plt():
    import matplotlib

    matplotlib.use("Agg")  # no display on the benchmark machines
    import matplotlib.pyplot as plt

    return plt


def _subtitle(d: dict[str, Any]) -> str:
    env = d.get("env", {})
    return (f"{d.get('model')} | {env.get('gpu') or 'cpu'} | {d.get('dtype', '')} | "
            f"commit {str(env.get('commit', '?'))[:10]} | {str(env.get('date', ''))[:10]}")


def _cdf(ax, values: list[float], label: str, scale: float = 1e3, **kw: Any) -> None:
    v = np.sort(np.asarray([x for x in values if x is not None], dtype=float)) * scale
    if v.size:
        ax.plot(v, np.arange(1, v.size + 1) / v.size, label=label, **kw)


def plot_latency(d: dict[str, Any], out: Path) -> list[Path]:
    plt = _plt()
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
    fig.tight_layout()
    p1 = out / "latency_steps.png"
    fig.savefig(p1, dpi=120)
    plt.close(fig)

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
    fig.tight_layout()
    p2 = out / "latency_throughput.png"
    fig.savefig(p2, dpi=120)
    plt.close(fig)
    return [p1, p2]


def plot_offline(d: dict[str, Any], out: Path) -> list[Path]:
    plt = _plt()
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
    fig.tight_layout()
    p = out / "offline_throughput.png"
    fig.savefig(p, dpi=120)
    plt.close(fig)
    return [p]


def plot_serving(d: dict[str, Any], out: Path) -> list[Path]:
    plt = _plt()
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
    fig.tight_layout()
    p = out / "serving_latency.png"
    fig.savefig(p, dpi=120)
    plt.close(fig)
    return [p]


PLOTTERS = {"latency": plot_latency, "offline": plot_offline, "serving": plot_serving}


def main(argv: list[str] | None = None) -> list[Path]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="JSON files written by the benchmark scripts")
    ap.add_argument("--out-dir", default=".", help="where the PNGs go")
    ap.add_argument("--prefix", default="", help="prepended to every PNG name")
    args = ap.parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for f in args.files:
        d = json.loads(Path(f).read_text())
        kind = d.get("benchmark")
        if kind not in PLOTTERS:
            raise SystemExit(f"{f}: not a benchmark result (benchmark={kind!r})")
        for p in PLOTTERS[kind](d, out):
            if args.prefix:
                p = p.rename(p.with_name(args.prefix + p.name))
            written.append(p)
            print(f"wrote {p}")
    return written


if __name__ == "__main__":
    main()
