"""What the soak (`benchmarks/soak.py`) reads from `/metrics` and how it prints its result."""

from __future__ import annotations

import re
from typing import Any

from benchmarks.common import print_table


def parse_metrics(text: str) -> dict[str, float]:
    """`name{labels}` -> value of every sample."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def ended_counts(metrics: dict[str, float]) -> dict[str, float]:
    """phaseflip_requests_total by finish reason, and aborted_requests_total by reason."""
    out = {}
    for key, value in metrics.items():
        name, _, labels = key.partition("{")  # (labels also hold model_name="...")
        if name == "phaseflip_requests_total" and (
                m := re.search(r'\bfinish_reason="(\w+)"', labels)):
            out[f"finish:{m[1]}"] = value
        elif name == "phaseflip_aborted_requests_total" and (
                m := re.search(r'\breason="(\w+)"', labels)):
            out[f"aborted:{m[1]}"] = value
    return out


def mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.0f}"


def print_result(r: dict[str, Any]) -> None:
    print_table(["request kind", "sent"], sorted(r["sent"].items()),
                f"soak: {r['duration_s']:.0f} s, {r['concurrency']} clients, "
                f"{r['requests']} requests")
    print_table(["ended (server, /metrics delta)", "count"], sorted(r["server_ended"].items()))
    warm, end = r["rss"].get("warm", {}), r["rss"].get("end", {})
    print_table(["process", "private RSS after warm-up (MiB)", "at the end (MiB)", "growth",
                 "shared RSS (MiB)"],
                [(p, mib(warm.get(p)), mib(end.get(p)),
                  "-" if r["rss_growth"].get(p) is None else f"{r['rss_growth'][p]:+.1%}",
                  f"{mib(warm.get(p + '_shmem'))} -> {mib(end.get(p + '_shmem'))}")
                 for p in ("front_end", "engine", "worker_ranks")])
    rows = [(s["requests"], *(f"{s[p]['rss'] / 2**20:.0f} / {s[p]['fds']} / {s[p]['threads']}"
                              if s.get(p) and s[p]["rss"] else "-"
                              for p in ("front_end", "engine")))
            for s in r.get("samples", [])]
    print_table(["requests sent", "front end RSS MiB / fds / threads", "engine"], rows)
    print_table(["check", "ok", "detail"],
                [(k, "yes" if v["ok"] else "NO", v["detail"]) for k, v in r["checks"].items()])
    for e in r["errors"][:10]:
        print("error:", e)
