"""The answers `/v1/responses` keeps for `previous_response_id`, `GET` and `DELETE`.

Each kept answer holds its own turn (its input as chat messages, then the answer) and a link to
the answer it continued: a conversation is its chain of turns, so a chain of n turns costs n
turns, not n(n+1)/2. An answer dropped as the oldest stays reachable through the later answers
that continue it (their conversations stay whole); a deleted one is emptied at once, and a
follow-up whose chain runs through it is refused, naming it, rather than answered with a
conversation that silently lost a turn.

Two bounds, newest kept first (a follow-up or a GET counts as use): `capacity` answers, and
`max_bytes` of memory held by every turn still reachable — one answer can hold a context's worth
of input, so 1000 answers of a long-context model can hold gigabytes.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from phaseflip.errors import PhaseflipError

log = logging.getLogger("phaseflip.server")

DEFAULT_MAX_BYTES = 512 * 2**20
"""The store's memory bound: a kept answer costs its text (a byte a character of ASCII, 2-4 of
other scripts) and ~4 KiB of fields, so 1000 answers (the default --responses-kept) of ~500 k
characters each, a 128k-token conversation, fit."""
DROP_LOG_EVERY_S = 60.0
"""The least time between two log lines about answers dropped for the memory bound."""


class ResponseNotFoundError(PhaseflipError):
    """No kept response has this id (never stored, dropped as the oldest, or deleted): 404."""

    def __init__(self, response_id: str, param: str | None) -> None:
        super().__init__(f"no response with id {response_id!r} is kept here (never stored, "
                         "deleted, or dropped as the oldest: --responses-kept, "
                         "--responses-kept-bytes)")
        self.param = param


class ResponseDeletedError(ResponseNotFoundError):
    """A follow-up's conversation runs through a deleted response: its turn is gone (404)."""

    def __init__(self, response_id: str, deleted_id: str, param: str | None) -> None:
        PhaseflipError.__init__(
            self, f"the conversation through response {response_id!r} includes response "
            f"{deleted_id!r}, which was deleted: its turn is gone. Continue from a response "
            f"before {deleted_id!r}, or send the whole conversation as input")
        self.param = param


@dataclass(eq=False)
class Kept:
    """One kept answer. Held while it is in the store's index or a held answer continues it
    (`holders` counts both); its bytes count against the bound while held."""

    body: dict[str, Any]  # the response as answered
    messages: list[dict[str, Any]]  # this turn: its input as chat messages, then the answer
    input_items: list[dict[str, Any]] = field(default_factory=list)  # its own input, as items
    previous: Kept | None = None  # the answer it continued (`previous_response_id`)
    deleted: bool = field(default=False, init=False)
    holders: int = field(default=0, init=False)
    size_bytes: int = field(default=0, init=False)  # counted while held (0 once deleted)

    def conversation(self, param: str | None = None) -> list[dict[str, Any]]:
        """The messages of every turn through this one, oldest first (instructions left out);
        `ResponseDeletedError` if one of them was deleted."""
        turns: list[Kept] = []
        link: Kept | None = self
        while link is not None:
            if link.deleted:
                raise ResponseDeletedError(self.body["id"], link.body["id"], param)
            turns.append(link)
            link = link.previous
        return [m for turn in reversed(turns) for m in turn.messages]


def footprint_bytes(*objs: Any) -> int:
    """About what `objs` hold in memory: the `sys.getsizeof` of each string, dict and list
    reached, each object once (dict keys left out: field names, shared by every answer)."""
    seen: set[int] = set()
    stack, total = list(objs), 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen or not isinstance(obj, str | dict | list):
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        if isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, list):
            stack.extend(obj)
    return total


class ResponseStore:
    """The kept answers, in this front end's memory (lost on restart): the `capacity` newest
    within `max_bytes` (see the module docstring)."""

    def __init__(self, capacity: int, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.capacity, self.max_bytes = capacity, max_bytes
        self.held_bytes = 0  # of every held answer (indexed, or continued by a held one)
        self._index: OrderedDict[str, Kept] = OrderedDict()
        self._dropped = (0, 0)  # (answers, bytes) dropped for max_bytes, not logged yet
        self._logged_at = -float("inf")

    def __len__(self) -> int:
        return len(self._index)

    def put(self, response_id: str, kept: Kept) -> None:
        if self.capacity <= 0:
            return
        kept.size_bytes = footprint_bytes(kept.body, kept.messages, kept.input_items)
        if (old := self._index.pop(response_id, None)) is not None:
            self._release(old)
        self._index[response_id] = kept
        self._hold(kept)
        while len(self._index) > self.capacity:
            self._release(self._index.popitem(last=False)[1])
        dropped, before = 0, self.held_bytes
        while self.held_bytes > self.max_bytes and self._index:
            self._release(self._index.popitem(last=False)[1])
            dropped += 1
        if dropped:
            self._log_dropped(dropped, before - self.held_bytes)

    def get(self, response_id: str, param: str | None = None) -> Kept:
        kept = self._index.get(response_id)
        if kept is None:
            raise ResponseNotFoundError(response_id, param)
        self._index.move_to_end(response_id)
        return kept

    def delete(self, response_id: str) -> None:
        """Drops the answer and empties it: a follow-up through it is refused from now on."""
        kept = self._index.pop(response_id, None)
        if kept is None:
            raise ResponseNotFoundError(response_id, None)
        self._release(kept)
        if kept.holders:  # still continued by held answers: hollow, it holds nothing
            self.held_bytes -= kept.size_bytes
            if kept.previous is not None:
                self._release(kept.previous)
        # (unheld, `_release` let go already) hollow either way: an answer still running from
        # it, `put` later, must hold neither its bytes nor the turns before it
        kept.size_bytes, kept.previous = 0, None
        kept.deleted = True
        kept.body = {"id": response_id}
        kept.messages, kept.input_items = [], []

    def _hold(self, kept: Kept) -> None:
        """One more holder; the first holds its bytes and the answer it continued."""
        link: Kept | None = kept
        while link is not None:
            link.holders += 1
            if link.holders > 1:
                return
            self.held_bytes += link.size_bytes
            link = link.previous

    def _release(self, kept: Kept) -> None:
        """One holder less; the last frees its bytes and its hold on the answer it continued."""
        link: Kept | None = kept
        while link is not None:
            link.holders -= 1
            if link.holders > 0:
                return
            self.held_bytes -= link.size_bytes
            link = link.previous

    def _log_dropped(self, dropped: int, freed_bytes: int) -> None:
        count, size = self._dropped
        self._dropped = count + dropped, size + freed_bytes
        now = time.monotonic()
        if now - self._logged_at < DROP_LOG_EVERY_S:
            return
        count, size = self._dropped
        log.warning(
            "responses store: dropped %d of the oldest answers (%.1f MiB) to stay within "
            "%.1f MiB; %d kept, %.1f MiB held (raise --responses-kept-bytes to keep more; "
            "a follow-up to a dropped one gets 404 response_not_found)", count, size / 2**20,
            self.max_bytes / 2**20, len(self._index), self.held_bytes / 2**20)
        self._dropped, self._logged_at = (0, 0), now
