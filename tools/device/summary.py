"""What a device call's results say, printed for its stdout and summary.txt.

    python3 tools/device/summary.py DIR [link|flips|offline|workload|comm|fp8 ...]

Reads the JSON the call's steps wrote into DIR (bench_comm, bench_flip, bench_offline,
bench_flip_workload, linear_kernels) and prints, per kind: the link (send 0->1's best busbw),
each flip's seam against its target (2 x the busiest rank's bytes / link + 0.1 s) with its
breakdown and every rank's bytes and free memory, the offline runs with each GPU's busy
share, the workload's auto over the best static run, the 1 GiB bandwidths. Standard
library only: it runs before anything is installed, and on any machine afterwards.
"""

from __future__ import annotations

import glob
import json
import statistics
import sys
from pathlib import Path
from typing import Any


def _load(path: str) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def _files(d: str, prefix: str) -> list[str]:
    return sorted(glob.glob(f"{d}/{prefix}*.json"))


def _name(path: str) -> str:
    return Path(path).stem


def link_gbps(d: str) -> float | None:
    """send 0->1's best busbw over NVLink (comm_nvl.json), GB/s; None when not measured."""
    try:
        rows = _load(f"{d}/comm_nvl.json")["rows"]
        return max(r["busbw_GBps"] for r in rows if r["op"] == "send 0->1")
    except (OSError, KeyError, ValueError):
        return None


def flip_line(c: dict[str, Any], link: float | None) -> str:
    ranks = c.get("ranks") or [{"bytes_moved": c["weights_bytes_moved"]}]  # older: rank 0
    moved = max(r["bytes_moved"] or 0 for r in ranks)  # the busiest rank's bytes
    target = 2 * moved / 1e9 / link + 0.1 if link else float("nan")
    parts = {k: v for k, v in c["segments"].items() if k != "relayout"}
    parts |= c.get("relayout_parts") or {}
    free = [r.get("device_free_after_bytes") for r in ranks]
    return (f"{c['source']}->{c['target']} {c['weights']} {c['wall_s']:.3f} s "
            f"({', '.join(f'{k} {v:.3f}' for k, v in parts.items())}); busiest rank "
            f"{moved / 2**30:.2f} GiB, rank 0 at {c.get('weights_gbps') or 0:.1f} GB/s; per rank "
            f"GiB {[round((r['bytes_moved'] or 0) / 2**30, 2) for r in ranks]}, free after "
            f"{[f and round(f / 2**30, 2) for f in free]}; target {target:.3f} s: "
            f"{'met' if c['wall_s'] <= target else 'MISSED'}")


def flips(d: str, first: int = 4) -> None:
    link = link_gbps(d)
    print(f"link: send 0->1, best size: {link and round(link, 1)} GB/s")
    for f in _files(d, "flip_"):
        fl = _load(f)["flips"]
        if not fl:
            continue
        seams = [c["wall_s"] for c in fl]
        free = [(c["device_free_after_bytes"] or 0) / 2**30 for c in fl]
        kv = [c["kv_slots_after"] for c in fl if c["kv_slots_after"] is not None]
        print(f"{_name(f)}: {len(fl)} flips {sorted({c['weights'] for c in fl})}, seam median "
              f"{statistics.median(seams):.3f} max {max(seams):.3f} s; rank 0 device free "
              f"{free[0]:.3f} -> {free[-1]:.3f} GiB; KV slots {min(kv, default=None)}.."
              f"{max(kv, default=None)}")
        for c in fl[:first]:
            print("  " + flip_line(c, link))


def offline(d: str) -> None:
    for f in _files(d, "off"):
        r = _load(f)
        p = r["phaseflip"]
        busy = [(g.get("ranks"), g["mean_pct"] and round(g["mean_pct"], 1))
                for g in (r.get("gpu_busy") or {}).get("devices") or []]
        print(f"{_name(f)}: {p['output_tokens_per_s']:.0f} out tok/s, "
              f"{p['total_tokens_per_s']:.0f} total, {p['duration_s']:.2f} s, complete "
              f"{p.get('complete')}, busy {busy}")


def workload(d: str) -> None:
    for f in _files(d, "wl_"):
        r = _load(f)
        runs = {x["run"]: x for x in r["runs"] if "ok" in x}
        for key in ("", "sim", "sim_scaled"):
            got = {s: (x.get(key) or {}) if key else x for s, x in runs.items()}
            tps = {s: g.get("throughput_tps") and round(g["throughput_tps"])
                   for s, g in got.items()}
            static = [v for s, v in tps.items() if not s.startswith("auto") and v]
            ratio = tps.get("auto") / max(static) if tps.get("auto") and static else None
            print(f"{_name(f)} {key or 'measured'}: auto / best static "
                  f"{ratio and round(ratio, 3)}; tok/s {tps}; flips "
                  f"{ {s: g.get('flips') for s, g in got.items()} }")
        for a in r.get("auto_vs_static") or []:  # tokens per busy second: the map's measure
            print(f"  {a['run']} / best static: throughput {_ratio(a['throughput'])}, busy "
                  f"tok/s {_ratio(a['busy'])} ({a['best_static']}), sim busy tok/s "
                  f"{_ratio(a['sim_busy'])}")
        print("  timing", r.get("timing"), "calibration",
              "ok" if r.get("calibration") else r.get("calibration_error"))


def _ratio(v: float | None) -> str:
    """A ratio the JSON may hold as null (NaN written by `write_json`)."""
    return "n/a" if v is None else f"{v:.3f}"


def comm(d: str) -> None:
    for f in _files(d, "comm_"):
        rows = [x for x in _load(f)["rows"] if x["size_bytes"] == 1 << 30]
        print(_name(f), "1 GiB busbw GB/s:", {x["op"]: round(x["busbw_GBps"], 1) for x in rows})


def fp8(d: str) -> None:
    """linear_kernels runs: the skinny kernel's µs per (projection, rows) and its config."""
    for f in _files(d, "lk_"):
        data = _load(f)
        if not isinstance(data, dict):  # a tuned table (lk_*.tuned.json), not a run
            continue
        print(_name(f), {(x["shapes"][0].split(".")[1], x["m"]):
                         (round(x["skinny_graph_us"], 1), x.get("config_label"))
                         for x in data["rows"]})


KINDS = {"link": lambda d: print(f"link: {link_gbps(d)} GB/s"), "flips": flips,
         "offline": offline, "workload": workload, "comm": comm, "fp8": fp8}


def main(argv: list[str]) -> None:
    d, kinds = argv[0], argv[1:] or list(KINDS)
    for k in kinds:
        KINDS[k](d)


if __name__ == "__main__":
    main(sys.argv[1:])
