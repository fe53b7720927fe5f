"""The phase flip's seam: re-lay a running engine out (TP ⇄ PP) between two steps.

Design law 6, in order: fence (HiCache persists every cached prefix to its tiers) → retract
every resident request → drop the device prefix tree, evicting first so its slots return to the
allocator → re-layout (every rank releases its layout and builds the new one on the same
processes and the communicators made at launch, with a new KV pool) → cutover → re-admit.
Nothing of the KV pool is carried across (`rows_moved`, read off the new pool before anything
is re-admitted, is 0): retracted requests sit at the front of the waiting queue, in their
admission order, and the next steps re-admit them, their prompt and output so far read through
from the host tier (re-prefilled only past the last full page it holds). Retraction comes
strictly before the tree reset: a reset first would orphan the nodes the requests still lock.
The pool accounting (`total = free + evictable + locked`) is checked after the drop and after
the re-layout, the host tier's own (every frame free, mapped or reserved) after the re-layout.

The seam talks to the engine only through `LayoutHost` (`flip/host.py`): it retracts, drops the
device tree, retires the old layout bundle and installs a new one, and never assigns an
engine's fields. What crosses the seam: the HiCache controller with its host tier (the frames,
layout-free canonical pages, shared by the node's ranks), its index and its disk tier. It is
unbound from the old layout once nothing is in flight and the tree is gone (it refuses
otherwise), and bound to the new one; only the ranks, their KV pools and the transfer channel
are new.

Weights strategy (`--flip-weights`, chosen at launch by `flip/weights.py`): `resident` — every
layout's shards stay on the devices and the new layout builds on the ones parked at launch
(nothing moves); `peer` — each rank keeps the slices it holds and receives the rest from the
ranks holding them (`distributed/reshard.py`); `host-image` — the engine holds an image of the
checkpoint in shared host memory (built once at launch; it crosses the seam like the host
frames), and the ranks copy their shards from it, checksummed, instead of reading the
checkpoint from disk; `reload` — they load as at start (from the checkpoint, or re-initialised
for dummy weights). The census reports which, with rank 0's load timings and bytes moved (the
other ranks log theirs). The new layout's decode graphs are captured each on its first use, not
in the seam (`graph_capture`). Each segment is timed (the seam census); the DONE line names the
worst segment and its share. What follows the cutover (the refill of the retracted requests,
the warm-up of served latency) is measured by `flip/ledger.py`, which completes the census's
refill fields in place."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

from phaseflip.errors import InvalidRequestError
from phaseflip.flip.census import SeamCensus, layout_name
from phaseflip.flip.host import LayoutHost
from phaseflip.flip.weights import device_free_bytes, record_weights

log = logging.getLogger("phaseflip.engine.flip")  # the operators' greppable name (docs)

HELD_WARN_BYTES = 2**30  # device memory still allocated after a teardown worth a warning


def check_target(cfg, model_cfg, tp_size: int, pp_size: int) -> None:
    """A flip re-lays the same ranks out: refuse anything else before touching the engine.
    `cfg`: the running layout's config; `model_cfg`: the model's."""
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
    misfit = model_cfg.layout_error(tp_size, pp_size)
    if misfit is not None:
        raise InvalidRequestError(misfit, "layout")
    _check_flip_layouts(cfg, tp_size, pp_size)
    # the new layout's config passes its own checks (e.g. --flip-layouts) now, not half-way
    # through the seam, where a refusal would leave no layout
    cfg.with_layout(tp_size, pp_size)


def _check_flip_layouts(cfg, tp_size: int, pp_size: int) -> None:
    """With --flip-layouts (or the auto policy's default pair) a flip goes only between the
    two: say so, naming them, instead of the config check's "the launch layout … must be one
    of the two; pass --flip-layouts with it", which blamed a launch flag for the target."""
    if cfg.flip_layouts is None and cfg.flip_policy != "auto":
        return
    pair = cfg.flip_layout_pair
    if (tp_size, pp_size) not in pair:
        allowed = " and ".join(layout_name(*lay) for lay in pair)
        why = (f"--flip-layouts {cfg.flip_layouts}" if cfg.flip_layouts
               else "the default --flip-layouts of --flip-policy auto")
        raise InvalidRequestError(
            f"cannot flip to {layout_name(tp_size, pp_size)}: this server flips only between "
            f"{allowed} ({why})", "layout")


def run_seam(host: LayoutHost, tp_size: int, pp_size: int) -> SeamCensus:
    """Flips `host` to tp_size × pp_size; see the module docstring for the order."""
    cfg = host.cfg
    check_target(cfg, host.model_cfg, tp_size, pp_size)
    census = SeamCensus(layout_name(cfg.tp_size, cfg.pp_size), layout_name(tp_size, pp_size))

    @contextmanager
    def segment(name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        yield
        census.segments[name] = time.perf_counter() - t0

    if host.hicache is not None:
        _fence(host, census, segment)
    try:
        _mutate(host, census, segment, cfg.with_layout(tp_size, pp_size))
    except BaseException as e:
        # half a seam is no engine: say so on every later call instead of failing obscurely
        host.mark_dead(f"the engine stopped: a phase flip to {census.target} failed after "
                       f"{', '.join(census.segments) or 'the start'} ({type(e).__name__}: {e})")
        raise
    log.info(census.done_line())
    return census


def _fence(host: LayoutHost, census: SeamCensus, segment) -> None:
    """Every cached prefix into the host tier; a fence that fails abandons the flip before
    anything changed (law 9), unless it stopped the rank group: then no layout is left."""
    try:
        with segment("fence"):
            host.hicache.fence()
    except Exception as e:
        if host.layout_stopped():
            host.mark_dead(f"the engine stopped: the fence of a phase flip to {census.target} "
                           f"stopped its rank group ({type(e).__name__}: {e})")
            raise
        raise InvalidRequestError(f"flip abandoned: the fence did not complete ({e})",
                                  "layout") from e
    census.fence_s = census.segments["fence"]


def _mutate(host: LayoutHost, census: SeamCensus, segment, target_cfg) -> None:
    """The seam from the retract on: from here a failure leaves no usable engine."""
    with segment("retract"):
        census.retracted = host.retract_all()
        if host.hicache is not None:  # the stores the retractions published hold tree nodes
            host.hicache.quiesce()
    with segment("drop"):
        census.tree_slots_freed = host.drop_device_tree()
        census.kv_slots_before = host.check_pool().total
    with segment("teardown"):
        census.held_after_teardown_bytes = held = host.retire_layout()
        if held is not None and held > HELD_WARN_BYTES:
            log.warning("flip teardown: %.2f GiB still allocated (a leaked reference to the old "
                        "layout?); the new layout sizes its KV pool from what is free",
                        held / 2**30)
    with segment("relayout"):
        runner = host.install_layout(target_cfg)
        record_weights(census, runner.weights_load)
        census.ranks = getattr(runner, "rank_builds", None)  # one process: rank 0's above
        census.relayout_parts = dict(runner.build_s)
        census.graph_capture = runner.graph_capture
        census.graphs_kept_bytes = getattr(runner, "graphs_kept_bytes", None)
        census.device_free_after_bytes = device_free_bytes(runner.device)
        acc = host.check_pool()
        census.kv_slots_after = acc.total
        census.rows_moved = acc.total - acc.free  # nothing is re-admitted yet (law 6)
        if host.hicache is not None:
            host.hicache.host.check()
    # what rank 0's build parts do not cover: the order to the ranks, the KV manager and the
    # HiCache binding, the checks above (no communicator is made at a seam: all are launch's)
    parts = census.relayout_parts
    parts["other"] = max(0.0, census.segments["relayout"] - sum(parts.values()))
