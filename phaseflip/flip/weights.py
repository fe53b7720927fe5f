"""Weight strategies of a flip (MISSION C6): how the new layout's ranks get their weights.

Built today: `host-image` (the checkpoint in a shared, page-locked host image, checksummed per
tensor; `model/weight_image.py`, chosen by `--flip-weights`) and `reload` (as at launch: the
checkpoint, or re-initialised dummy weights). The dual-resident and device-to-device
strategies, and a planner choosing among them, are the live flip's (issue 15). Whatever the
strategy, rank 0's `WeightsLoad` is what the census reports: the whole load and, for the
image, its read / host-to-device wait / drain split (None where unmeasured, law 5).
"""

from __future__ import annotations

from typing import Any

STRATEGIES = ("host-image", "reload")


def strategy_of(load: Any) -> str:
    """The strategy a `WeightsLoad` used."""
    return "host-image" if load.source == "host-image" else "reload"


def record_weights(census: Any, load: Any) -> None:
    """Rank 0's load of its shard, into the seam census."""
    census.weights = strategy_of(load)
    census.weights_load_s, census.weights_read_s = load.load_s, load.read_s
    census.weights_h2d_wait_s, census.weights_drain_s = load.h2d_wait_s, load.drain_s
