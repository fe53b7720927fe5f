"""The flip package's two interfaces to an engine (it imports nothing from `engine/`).

`LayoutHost`: what the seam may do to an engine, and all it may do. The engine implements it
(`EngineCore`); its layout lives in one bundle, which the host retires and replaces whole.

`FlipObserver`: what the engine tells the flip's telemetry (policy feeds, the warm-up and refill
ledger) as it runs, through five hooks. With flips off the engine has no observer (law 11).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol


class LayoutHost(Protocol):
    @property
    def cfg(self) -> Any: ...  # the running layout's EngineConfig

    @property
    def model_cfg(self) -> Any: ...

    @property
    def hicache(self) -> Any: ...  # the HiCache controller (outlives layouts), or None

    def layout_stopped(self) -> bool:
        """Whether the running layout's ranks were stopped (a stall or a dead rank)."""
        ...

    def mark_dead(self, reason: str) -> None:
        """No usable layout is left: every later call of the engine raises `reason`."""
        ...

    def retract_all(self) -> int:
        """Takes every running request off the device, to the front of the queue in
        admission order; returns how many."""
        ...

    def drop_device_tree(self) -> int:
        """Evicts, then resets the device prefix tree (law 6); returns the slots returned to
        the allocator."""
        ...

    def check_pool(self) -> Any:
        """Checks the pool accounting with nothing running; returns the `PoolAccounting`."""
        ...

    def retire_layout(self) -> int | None:
        """Ends the running layout bundle (HiCache unbound, ranks stopped, device memory
        freed); returns the device bytes still allocated (None off CUDA)."""
        ...

    def install_layout(self, cfg: Any) -> Any:
        """Builds the bundle for `cfg` and makes it the running one; returns its runner
        (rank 0's `weights_load` and `build_s`, its build by part)."""
        ...


class FlipObserver(Protocol):
    def on_items(self, items: Iterable[Any]) -> None:
        """A step's scheduled items, after `Scheduler.advance`, before sampling."""
        ...

    def on_step(self, layout: tuple[int, int], prompt_tokens: int, decode_tokens: int,
                seconds: float, decode_groups: int = 1) -> None:
        """One engine step ended: the prompt and decode tokens it computed (both 0: it ran
        no batch), its wall time, and the PP decode groups in flight (a decoding request
        then waits that many steps for its next token)."""
        ...

    def before_seam(self, running: Iterable[Any]) -> None:
        """A seam is about to retract `running`."""
        ...

    def on_seam(self, source: tuple[int, int], target: tuple[int, int], census: Any) -> None:
        """A seam completed (the census holds its segments)."""
        ...

    def on_cutover(self, census: Any, hicache: Any) -> None:
        """The new layout serves from now on: the refill window opens."""
        ...
