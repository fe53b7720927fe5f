"""Multi-node rendezvous: how a `serve --node-rank k` host finds node 0, shows that it was
started with node 0's flags, and stays visible to rank 0 while it serves.

What a bare TCPStore rendezvous left to chance (each seen with two `serve` processes on one
host as node 0 and node 1):
- A node started before node 0 waited without a word and, when node 0 never came, died with
  a C++ store traceback. The node now waits for node 0's port itself, says so, and fails
  naming --dist-init-addr and --dist-timeout-s.
- Nodes started with different flags formed no group (other world sizes: rank 0 waited five
  minutes for a rank numbered for another world) or a broken one (tp2 on node 0, pp2 on
  node 1: an obscure error on each side). A node checks its flags in with rank 0 before it
  starts any rank; a difference is named on both sides at once.
- A node that died while the server idled left /health at 200 until the next request
  failed. The node's process beats through the store once a second, with the names of its
  ranks that exited; rank 0 reads the beats at its idle checks (`RemoteNodes`).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import multiprocessing.connection
import socket
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist

from phaseflip.errors import InvalidRequestError, PhaseflipError

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

    from phaseflip.config import EngineConfig
    from phaseflip.model.config import ModelConfig

log = logging.getLogger(__name__)

# flags every node must share: they shape the group or say which weights the ranks hold
AGREED_FLAGS = ("model", "dtype", "quantization", "kv_cache_dtype", "load_format", "device",
                "tp_size", "pp_size", "nnodes", "all_reduce", "all_reduce_max_kib",
                "enable_flip", "flip_layouts", "flip_weights")
ARRIVALS = "phaseflip/node_arrivals"  # a counter: one per node check-in
ARRIVAL, VERDICT, BEAT = "phaseflip/node_arrival/", "phaseflip/node_verdict/", "phaseflip/beat/"
OK = "ok"
BEAT_S = 1.0  # a node's beat period
SILENCE_S = 10.0  # rank 0 counts a node silent this long as gone
LOG_EVERY_S = 15.0  # "still waiting" lines
READ_S = 5.0  # how long a refusing rank 0 waits for the node to read its verdict


class GroupFormationError(RuntimeError):
    """The rank group did not form: a rank died while joining, missed the deadline, or a node
    was started with other flags than node 0."""


class NodeJoinError(PhaseflipError):
    """A `serve --node-rank k` host could not join node 0's group (the message says why)."""


def split_addr(addr: str) -> tuple[str, int]:
    """(host, port) of --dist-init-addr `host:port` (`[v6]:port` too)."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidRequestError(f"--dist-init-addr {addr!r}: expected host:port of node 0, "
                                  "port 1-65535", "dist_init_addr")
    return host.removeprefix("[").removesuffix("]"), int(port)


def agreed_flags(cfg: EngineConfig, model_cfg: ModelConfig,
                 backend: str) -> tuple[tuple[str, str], ...]:
    """What every node must have in common, as (name, value) pairs for a `DistSpec`."""
    flags = [(f"--{name.replace('_', '-')}", str(getattr(cfg, name))) for name in AGREED_FLAGS]
    flags.append(("the process-group backend", backend))
    flags.append(("the model's config.json and weight files", model_fingerprint(model_cfg)))
    return tuple(flags)


def model_fingerprint(model_cfg: ModelConfig) -> str:
    """A digest of config.json and the weight files' names and sizes: the same path on two
    hosts may hold two checkpoints (hashing the weights would take minutes)."""
    root = Path(model_cfg.model_dir)
    h = hashlib.sha256()
    for f in sorted(root.iterdir()) if root.is_dir() else []:
        if f.name == "config.json":
            h.update(f.read_bytes())
        elif f.suffix in (".safetensors", ".bin", ".pt"):
            h.update(f"{f.name}:{f.stat().st_size};".encode())
    return h.hexdigest()[:16]


def differences(mine: dict[str, str], theirs: dict[str, str], here: str,
                there: str) -> list[str]:
    """`--tp-size 4 on node 1, 2 on node 0` for each flag whose values differ."""
    return [f"{name} {theirs.get(name, '(unset)')} {there}, {value} {here}"
            for name, value in mine.items() if theirs.get(name) != value]


def wait_for_port(host: str, port: int, timeout_s: float, who: str, addr: str) -> None:
    """Returns once something listens at host:port; NodeJoinError after `timeout_s`. Says
    that it waits (node 0 may be started minutes later, by hand)."""
    start = time.monotonic()
    last_log = None
    while True:
        try:
            with socket.create_connection((host, port), timeout=2):
                break
        except OSError:
            pass
        waited = time.monotonic() - start
        if waited >= timeout_s:
            raise NodeJoinError(
                f"{who}: node 0 did not open its rendezvous at {addr} (--dist-init-addr) "
                f"within {timeout_s:g} s (--dist-timeout-s): start `phaseflip serve "
                f"--node-rank 0` with the same flags, check the address and the firewall, "
                f"or give a larger --dist-timeout-s")
        if last_log is None or time.monotonic() - last_log >= LOG_EVERY_S:
            verb = "waiting" if last_log is None else "still waiting"
            log.info("%s: %s for node 0's rendezvous at %s (--dist-init-addr): %.0f s of "
                     "up to %g s (--dist-timeout-s)", who, verb, addr, waited, timeout_s)
            last_log = time.monotonic()
        time.sleep(0.5)
    if last_log is not None:
        log.info("%s: node 0 answered at %s after %.1f s", who, addr, time.monotonic() - start)


class NodeLink:
    """A `serve --node-rank k` host's line to rank 0's store: its check-in, then its beats."""

    def __init__(self, store: dist.Store, node: int) -> None:
        self.store, self.node = store, node
        self.beats, self.gone = 0, False

    @classmethod
    def open(cls, addr: str, node: int, flags: tuple[tuple[str, str], ...],
             timeout_s: float) -> NodeLink:
        """Waits for node 0, checks this node's flags in; NodeJoinError if refused."""
        who = f"node {node}"
        host, port = split_addr(addr)
        wait_for_port(host, port, timeout_s, who, addr)
        try:
            store = dist.TCPStore(host, port, is_master=False,
                                  timeout=datetime.timedelta(seconds=timeout_s))
        except (dist.DistError, RuntimeError) as e:
            raise NodeJoinError(f"{who}: {addr} (--dist-init-addr) answered but is no "
                                f"phaseflip rendezvous: {e}") from None
        link = cls(store, node)
        link.check_in(flags, timeout_s, addr)
        return link

    def check_in(self, flags: tuple[tuple[str, str], ...], timeout_s: float,
                 addr: str) -> None:
        """Hands rank 0 this node's flags and waits for its verdict (acknowledged, so that a
        rank 0 that refuses the node stays until the node has read why)."""
        try:
            n = self.store.add(ARRIVALS, 1)
            self.store.set(f"{ARRIVAL}{n}", json.dumps({"node": self.node,
                                                        "flags": dict(flags)}))
            self.store.wait([f"{VERDICT}{n}"], datetime.timedelta(seconds=timeout_s))
            verdict = self.store.get(f"{VERDICT}{n}").decode()
            self.store.set(f"{VERDICT}{n}/read", "1")
        except (dist.DistError, RuntimeError) as e:
            raise NodeJoinError(f"node {self.node}: node 0 at {addr} gave no answer to this "
                                f"node's check-in within {timeout_s:g} s (--dist-timeout-s): "
                                f"{str(e).splitlines()[0]}") from None
        if verdict != OK:
            raise NodeJoinError(verdict)

    def beat(self, exited: list[str]) -> None:
        """Tells rank 0 this node lives (and which of its ranks exited); after node 0 is gone
        (a failed write) it stops."""
        if self.gone:
            return
        self.beats += 1
        try:
            self.store.set(f"{BEAT}{self.node}", json.dumps({"beat": self.beats,
                                                             "exited": exited}))
        except (dist.DistError, RuntimeError):
            self.gone = True

    def watch(self, procs: list[BaseProcess]) -> int:
        """Beats until every rank exited; returns 0, or 1 if any rank failed."""
        pending = list(procs)
        while pending:
            self.beat(_failed(procs))
            multiprocessing.connection.wait([p.sentinel for p in pending], timeout=BEAT_S)
            pending = [p for p in pending if p.exitcode is None]
        self.beat(_failed(procs))  # the last rank's death too: rank 0 names it, not a silence
        return int(any(p.exitcode for p in procs))


def _failed(procs: list[BaseProcess]) -> list[str]:
    return [f"{p.name} (exit code {p.exitcode})" for p in procs if p.exitcode not in (None, 0)]


class NodeCheckIns:
    """Rank 0's side of the check-ins: each arriving node's flags compared with its own, a
    verdict written back, a GroupFormationError on any difference."""

    def __init__(self, store: dist.Store, nnodes: int, flags: tuple[tuple[str, str], ...],
                 addr: str) -> None:
        self.store, self.nnodes, self.flags, self.addr = store, nnodes, dict(flags), addr
        self.seen = 0
        self.nodes: set[int] = set()

    def poll(self) -> None:
        """Answers every check-in that arrived since the last call."""
        if self.nnodes < 2:
            return
        count = self.store.add(ARRIVALS, 0)
        while self.seen < count and self.store.check([f"{ARRIVAL}{self.seen + 1}"]):
            self.seen += 1
            arrival = json.loads(self.store.get(f"{ARRIVAL}{self.seen}"))
            error = self._judge(arrival["node"], arrival["flags"])
            self.store.set(f"{VERDICT}{self.seen}", OK if error is None else error[1])
            if error is not None:
                self._await_read(self.seen)
                raise GroupFormationError(error[0])
            self.nodes.add(arrival["node"])

    def _await_read(self, arrival: int) -> None:
        """Up to READ_S for the refused node to read its verdict (this store goes with rank 0)."""
        try:
            self.store.wait([f"{VERDICT}{arrival}/read"], datetime.timedelta(seconds=READ_S))
        except (dist.DistError, RuntimeError):
            pass  # it went away: rank 0's own message still names the difference

    def _judge(self, node: int, flags: dict[str, str]) -> tuple[str, str] | None:
        """None if `node` may join, else (rank 0's message, the node's message)."""
        if node in self.nodes:
            why = f"two hosts checked in as node {node} (--node-rank {node} on both?)"
            return f"the rank group did not form: {why}", f"node {node}: {why}"
        diff = differences(self.flags, flags, "on node 0", f"on node {node}")
        if not diff:
            return None
        listed = "; ".join(diff)
        return (f"the rank group did not form: node {node} was started with other flags than "
                f"node 0: {listed}; start every node with the same flags",
                f"node {node}: this node's flags differ from node 0's (rank 0 at "
                f"{self.addr}): {listed}; start every node with the same flags")


class RemoteNodes:
    """Rank 0's view of the other nodes' beats, read at most once a second (idle checks)."""

    def __init__(self, addr: str, nnodes: int, silence_s: float = SILENCE_S) -> None:
        host, port = split_addr(addr)
        self.store = dist.TCPStore(host, port, is_master=False,
                                   timeout=datetime.timedelta(seconds=5))
        now = time.monotonic()
        self.last = dict.fromkeys(range(1, nnodes), (0, now))  # node: (beat, when it changed)
        self.silence_s = silence_s
        self._read_at, self._failed = 0.0, []
        self._lock = threading.Lock()

    def failed(self) -> list[str]:
        """Lines naming each node whose ranks exited or whose beats stopped."""
        with self._lock:
            now = time.monotonic()
            if now - self._read_at >= BEAT_S:
                self._read_at, self._failed = now, self._read(now)
            return list(self._failed)

    def _read(self, now: float) -> list[str]:
        out = []
        for node, (beat, since) in self.last.items():
            try:
                key = f"{BEAT}{node}"
                state = json.loads(self.store.get(key)) if self.store.check([key]) else {}
            except (dist.DistError, RuntimeError, ValueError):
                return []  # the store is going away with the group: nothing to say
            if state.get("exited"):
                out.append(f"node {node}: {', '.join(state['exited'])}")
            if state.get("beat", 0) != beat:
                self.last[node] = (state["beat"], now)
            elif now - since > self.silence_s:
                out.append(f"node {node} (its `phaseflip serve --node-rank {node}` sent no "
                           f"heartbeat for {now - since:.0f} s)")
        return out
