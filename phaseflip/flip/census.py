"""The seam census (docs/design.md): what one flip did and what each segment of its seam cost.

Every field is None until something measured it (law 5). The seam (`flip/seam.py`) fills the
segments and the relayout's readings; the ledger (`flip/ledger.py`) completes the refill
fields in place as the steps after the cutover run.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


def layout_name(tp_size: int, pp_size: int) -> str:
    return f"tp{tp_size}×pp{pp_size}"


@dataclass
class SeamCensus:
    """What one flip did and what each segment of its seam cost."""

    source: str
    target: str
    segments: dict[str, float] = field(default_factory=dict)  # seconds, in seam order
    retracted: int = 0  # requests taken off the device, re-admitted after the cutover
    tree_slots_freed: int = 0  # cached slots the drop returned to the allocator
    fence_s: float | None = None  # None: no host tier, no fence ran (law 5: not 0)
    # KV rows carried across the seam: the new pool's occupied slots right after the relayout,
    # before anything is re-admitted (0 by law 6); None until that reading ran (law 5)
    rows_moved: int | None = None
    # how the new ranks got their weights: "resident", "host-image" or "reload"
    weights: str = "reload"
    weights_bytes_moved: int | None = None  # rank 0's shard bytes moved onto its device
    # those bytes over rank 0's whole load, GB/s (None: nothing moved, or unmeasured); the
    # link it ran on is the strategy's (host image: host to device; peer: the ranks' group)
    weights_gbps: float | None = None
    # rank 0's load of its shard inside the relayout (`WeightsLoad`): the whole load; the
    # image's checksum pass (the read), the copies into the device parameters, the final
    # synchronize. None when unmeasured (law 5): the split on reload, h2d and drain off CUDA
    weights_load_s: float | None = None
    weights_read_s: float | None = None
    weights_h2d_wait_s: float | None = None
    weights_drain_s: float | None = None
    # rank 0's relayout by part (weights, wait_for_ranks, kv_pool, graphs, other), seconds;
    # the ranks are the same processes before and after (none start or join at a seam) and
    # their communicators were all made at launch (no part for them)
    relayout_parts: dict[str, float] | None = None
    # the new layout's decode graphs: "on first use" (a seam captures none: each size is
    # captured by the first step that needs it), "parked" (the graphs this layout had at its
    # last seam, every address they captured unchanged: resident weights), "on first use
    # (parked stale)" (parked ones whose addresses moved), "at build", None (eager)
    graph_capture: str | None = None
    # device bytes rank 0 keeps in the decode graphs parked for its other layouts (static
    # buffers, private memory pools; reserved), after the relayout. None: none parked
    graphs_kept_bytes: int | None = None
    kv_slots_before: int | None = None  # the KV slot space of the old layout and the new
    kv_slots_after: int | None = None
    # device memory this process still had allocated once the old layout was torn down,
    # beyond the weights it keeps on purpose (resident shards; None off CUDA): the old rank
    # 0's weights and pool must be gone before the new ranks size their pools from what is free
    held_after_teardown_bytes: int | None = None
    # free memory of rank 0's device, every process on it counted, once the new layout is
    # built (None off CUDA): flat from flip to flip when nothing leaks anywhere on the device
    device_free_after_bytes: int | None = None
    # every rank's build of the new layout (`flip.weights.build_report`: strategy, bytes
    # moved, load seconds and GB/s, its device's free bytes), rank order; None with one process
    ranks: list[dict[str, Any]] | None = None
    # After the cutover (`flip/ledger.py` completes these in place as steps run): what
    # refilling the retracted requests cost. None until the last of them is refilled (law 5);
    # the loads' fields also without a host tier, the rate also when nothing was loaded.
    refill_state: str = "pending"  # "pending", "done", "cut short" (by the next flip)
    refill_tokens_loaded: int | None = None  # read back from the host (or disk) tier
    refill_bytes: int | None = None  # KV bytes of those loads
    refill_tokens_prefilled: int | None = None  # tokens they held before, computed again
    refill_s: float | None = None  # cutover → the end of the step refilling the last of them
    refill_rate_gbps: float | None = None  # refill_bytes / the loads' own seconds
    warmup: Any = None  # this flip's warm-up ledger (`flip_ledger.Warmup`), set at cutover

    @property
    def total_s(self) -> float:
        return sum(self.segments.values())

    def worst(self) -> tuple[str, float]:
        """The costliest segment and its share of the seam."""
        name = max(self.segments, key=self.segments.__getitem__)
        return name, self.segments[name] / (self.total_s or 1.0)

    def done_line(self) -> str:
        name, share = self.worst()
        fence = "none" if self.fence_s is None else f"{self.fence_s:.3f} s"
        held = ("" if self.held_after_teardown_bytes is None else
                f", {self.held_after_teardown_bytes / 2**30:.2f} GiB held after teardown")
        parts = ("" if not self.relayout_parts else " (" + ", ".join(
            f"{k} {v:.3f} s" for k, v in self.relayout_parts.items()) + ")")
        kv = ("" if self.kv_slots_after is None else
              f", KV slots {_or_unmeasured(self.kv_slots_before)} → {self.kv_slots_after}")
        graphs = "" if self.graph_capture is None else f", graphs {self.graph_capture}"
        if self.graphs_kept_bytes is not None:
            graphs += f" ({self.graphs_kept_bytes / 2**20:.1f} MiB kept in parked graphs)"
        return (f"flip {self.source} → {self.target} DONE in {self.total_s:.3f} s: worst "
                f"segment {name} {self.segments[name]:.3f} s ({100 * share:.0f} %){parts}; "
                f"retracted {self.retracted}, rows moved {_or_unmeasured(self.rows_moved)}, "
                f"fence {fence}, weights {self.weights}{self._weights_detail()}{kv}{held}"
                f"{graphs}")

    def _weights_detail(self) -> str:
        if self.weights_load_s is None:
            return ""

        def s(v: float | None) -> str:
            return "unmeasured" if v is None else f"{v:.3f} s"

        split = ("" if self.weights != "host-image" else
                 f": read {s(self.weights_read_s)}, h2d {s(self.weights_h2d_wait_s)}, drain "
                 f"{s(self.weights_drain_s)}")
        moved = ("" if self.weights_bytes_moved is None else
                 f", {self.weights_bytes_moved / 2**30:.2f} GiB moved")
        return f" (rank 0 {self.weights_load_s:.3f} s{split}{moved})"

    def refill_line(self) -> str:
        loaded = ("no host tier" if self.refill_tokens_loaded is None else
                  f"{self.refill_tokens_loaded} tokens loaded ("
                  + ("rate unmeasured" if self.refill_rate_gbps is None else
                     f"{self.refill_rate_gbps:.3f} GB/s") + ")")
        return (f"flip {self.source} → {self.target} refill done in {self.refill_s:.3f} s: "
                f"{loaded}, {self.refill_tokens_prefilled} re-prefilled")

    def as_dict(self) -> dict:
        """JSON-safe: plain numbers and strings, the warm-up ledger as its own dict."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["segments"] = dict(self.segments)
        d["relayout_parts"] = None if self.relayout_parts is None else dict(self.relayout_parts)
        d["warmup"] = None if self.warmup is None else self.warmup.as_dict()
        d["total_s"] = self.total_s
        d["worst_segment"], d["worst_share"] = self.worst()
        return d


def _or_unmeasured(value: object) -> str:
    return "unmeasured" if value is None else str(value)
