"""The phase flip's seam: re-lay a running engine out (TP ⇄ PP) between two steps.

Design law 6, in order: fence (HiCache persists every cached prefix to its tiers) → retract
every resident request → drop the device prefix tree, evicting first so its slots return to the
allocator → re-layout (the old ranks are stopped, new ones start with the new layout and their
own KV pool) → cutover → re-admit. Nothing of the KV pool is carried across (`rows_moved`, read
off the new pool before anything is re-admitted, is 0): retracted requests sit at the front of
the waiting queue, in their admission order, and the next steps re-admit them, their prompt and
output so far read through from the host tier (re-prefilled only past the last full page it
holds). Retraction comes strictly before the tree reset: a reset first would orphan the nodes
the requests still lock. The pool accounting (`total = free + evictable + locked`) is checked
after the drop and after the re-layout, the host tier's own (every frame free, mapped or
reserved) after the re-layout.

What crosses the seam: the HiCache controller with its host tier (the frames, layout-free
canonical pages, shared by the node's ranks), its index and its disk tier. It is unbound from
the old layout once nothing is in flight and the tree is gone (it refuses otherwise), and bound
to the new one; only the ranks, their KV pools and the transfer channel are new.

Weights strategy (`--flip-weights`, `model/weight_image.py`): `host-image` — the engine
holds an image of the checkpoint in shared host memory (built once at launch; it crosses the
seam like the host frames), and the new ranks copy their shards from it, checksummed, instead
of reading the checkpoint from disk; `reload` — they load as at start (from the checkpoint, or
re-initialised for dummy weights, which have no checkpoint). The census reports which, with
rank 0's load timings (`weights_read_s`, `weights_h2d_wait_s`, `weights_drain_s`; the other
ranks load alike and log theirs). The dual-resident and device-to-device strategies of
MISSION C6, and a planner choosing among more than these two, are not built yet. Each
segment is timed (the seam census); the DONE line names the worst segment and its share.
What follows the cutover (the refill of the retracted requests, the warm-up of served
latency) is measured by `engine/flip_ledger.py`, which completes the census's refill fields
in place.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from phaseflip.errors import InvalidRequestError

if TYPE_CHECKING:
    from phaseflip.engine.core import EngineCore

log = logging.getLogger(__name__)


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
    weights: str = "reload"  # how the new ranks got their weights: "host-image" or "reload"
    # rank 0's load of its shard inside the relayout (`WeightsLoad`): the whole load; the
    # image's checksum pass (the read), the copies into the device parameters, the final
    # synchronize. None when unmeasured (law 5): the split on reload, h2d and drain off CUDA
    weights_load_s: float | None = None
    weights_read_s: float | None = None
    weights_h2d_wait_s: float | None = None
    weights_drain_s: float | None = None
    # device memory this process still had allocated once the old layout was torn down
    # (None off CUDA): the old rank 0's weights and pool must be gone before the new ranks
    # size their pools from what is free
    held_after_teardown_bytes: int | None = None
    # After the cutover (`engine/flip_ledger.py` completes these in place as steps run): what
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
        return (f"flip {self.source} → {self.target} DONE in {self.total_s:.3f} s: worst "
                f"segment {name} {self.segments[name]:.3f} s ({100 * share:.0f} %); retracted "
                f"{self.retracted}, rows moved {_or_unmeasured(self.rows_moved)}, fence "
                f"{fence}, weights {self.weights}{self._weights_detail()}{held}")

    def _weights_detail(self) -> str:
        if self.weights_load_s is None:
            return ""

        def s(v: float | None) -> str:
            return "unmeasured" if v is None else f"{v:.3f} s"

        split = ("" if self.weights != "host-image" else
                 f": read {s(self.weights_read_s)}, h2d {s(self.weights_h2d_wait_s)}, drain "
                 f"{s(self.weights_drain_s)}")
        return f" (rank 0 {self.weights_load_s:.3f} s{split})"

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
        d["warmup"] = None if self.warmup is None else self.warmup.as_dict()
        d["total_s"] = self.total_s
        d["worst_segment"], d["worst_share"] = self.worst()
        return d


def _or_unmeasured(value: object) -> str:
    return "unmeasured" if value is None else str(value)


def check_target(core: EngineCore, tp_size: int, pp_size: int) -> None:
    """A flip re-lays the same ranks out: refuse anything else before touching the engine."""
    cfg = core.cfg
    if not cfg.enable_flip:
        raise InvalidRequestError("phase flips are off: start the engine with --enable-flip "
                                  "(and --enable-hicache)", "enable_flip")
    if tp_size < 1 or pp_size < 1 or tp_size * pp_size != cfg.world_size:
        raise InvalidRequestError(
            f"cannot flip to {layout_name(tp_size, pp_size)}: a flip keeps the "
            f"{cfg.world_size} ranks of {layout_name(cfg.tp_size, cfg.pp_size)} "
            "(tp_size × pp_size must equal them)", "layout")
    if (tp_size, pp_size) == (cfg.tp_size, cfg.pp_size):
        raise InvalidRequestError(
            f"already running {layout_name(tp_size, pp_size)}", "layout")
    if pp_size > core.model_cfg.num_layers:
        raise InvalidRequestError(
            f"pp_size={pp_size} exceeds the model's {core.model_cfg.num_layers} layers", "layout")
    m = core.model_cfg
    kv_ok = m.num_kv_heads % tp_size == 0 or tp_size % m.num_kv_heads == 0
    for what, ok in ((f"{m.num_heads} attention heads", m.num_heads % tp_size == 0),
                     (f"{m.num_kv_heads} key/value heads", kv_ok),
                     (f"intermediate size {m.intermediate_size}",
                      m.intermediate_size % tp_size == 0)):
        if not ok:
            raise InvalidRequestError(
                f"tp_size={tp_size} does not split the model's {what}", "layout")
    # the new layout's config passes its own checks (e.g. --flip-layouts) now, not half-way
    # through the seam, where a refusal would leave no layout
    dataclasses.replace(cfg, tp_size=tp_size, pp_size=pp_size)


def run_seam(core: EngineCore, tp_size: int, pp_size: int) -> SeamCensus:
    """Flips `core` to tp_size × pp_size; see the module docstring for the order."""
    check_target(core, tp_size, pp_size)
    census = SeamCensus(layout_name(core.cfg.tp_size, core.cfg.pp_size),
                        layout_name(tp_size, pp_size))

    @contextmanager
    def segment(name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        yield
        census.segments[name] = time.perf_counter() - t0

    if core.hicache is not None:
        try:
            with segment("fence"):
                core.hicache.fence()
        except Exception as e:
            if getattr(core.runner, "closed", False):
                # a stalled or dead rank stopped the group inside the fence: no layout is left
                core.dead = (f"the engine stopped: the fence of a phase flip to "
                             f"{census.target} stopped its rank group ({type(e).__name__}: "
                             f"{e})")
                raise
            # nothing is changed yet: abandon the flip (law 9, C6)
            raise InvalidRequestError(f"flip abandoned: the fence did not complete ({e})",
                                      "layout") from e
        census.fence_s = census.segments["fence"]
    try:
        _mutate(core, census, segment, tp_size, pp_size)
    except BaseException as e:
        # half a seam is no engine: say so on every later call instead of failing obscurely
        core.dead = (f"the engine stopped: a phase flip to {census.target} failed after "
                     f"{', '.join(census.segments) or 'the start'} ({type(e).__name__}: {e})")
        raise
    log.info(census.done_line())
    return census


def _mutate(core: EngineCore, census: SeamCensus, segment, tp_size: int, pp_size: int
            ) -> None:
    """The seam from the retract on: from here a failure leaves no usable engine."""
    with segment("retract"):
        census.retracted = core.scheduler.retract_all()
        if core.hicache is not None:  # the stores the retractions published hold tree nodes
            core.hicache.quiesce()
    with segment("drop"):
        census.tree_slots_freed = core.kv.tree.evict_all_and_reset()
        core.kv.check([])
    with segment("teardown"):
        census.held_after_teardown_bytes = _teardown(core)
    with segment("relayout"):
        core.build_layout(dataclasses.replace(core.cfg, tp_size=tp_size, pp_size=pp_size))
        load = core.runner.weights_load  # rank 0's
        census.weights = "host-image" if load.source == "host-image" else "reload"
        census.weights_load_s, census.weights_read_s = load.load_s, load.read_s
        census.weights_h2d_wait_s, census.weights_drain_s = load.h2d_wait_s, load.drain_s
        acc = core.kv.check([])
        census.rows_moved = acc.total - acc.free
        if core.hicache is not None:
            core.hicache.host.check()


def _teardown(core: EngineCore) -> int | None:
    """Stops the old layout: the ranks, the device memory. HiCache's controller is unbound,
    not closed: its host tier and index serve the new layout (`build_layout` binds it).
    Returns the device bytes this process still has allocated (None off CUDA)."""
    if core.hicache is not None:
        core.hicache.unbind()
    close = getattr(core.runner, "close", None)  # the ranks only: the controller stays
    if close is not None:
        close()
    device = core.runner.device
    core.runner = core.kv = None  # type: ignore[assignment]
    core.scheduler.hicache = None
    gc.collect()
    if device.type != "cuda":
        return None
    torch.cuda.empty_cache()
    held = torch.cuda.memory_allocated(device)
    if held > 2**30:
        log.warning("flip teardown: %.2f GiB still allocated on %s (a leaked reference to the "
                    "old layout?); the new layout sizes its KV pool from what is free",
                    held / 2**30, device)
    return held
