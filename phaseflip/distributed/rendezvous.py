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

What the first version of this left to chance (seen the same way):
- A Hugging Face id resolves to a cache path that differs between hosts (HF_HOME, the user's
  home), and the path was a checked flag: the same model was refused. The check-in now
  compares the id where both nodes name one (`HUB_ID`) and the fingerprint of config.json and
  the weight files (names, sizes and a few sampled bytes); a directory's path is no part of
  it, so a copy of the checkpoint at another path joins, a fine-tune beside its base does not.
- A node 0 that froze (SIGSTOP, a host that hangs with its sockets open) left node k's idle
  ranks waiting forever: a beat is a write, which never fails then, and every store op that
  waits for a reply blocks past its own timeout. Node k's beats run in a thread and each is a
  round trip; node k stops its ranks and exits 1 when node 0 has not answered for SILENCE_S.
- Node 0 stopped between node k's check-in and its ready line: node k's ranks waited twice
  --dist-timeout-s on a closed store, then each printed a traceback. Node k now sees the
  refused connection within a second and gives its ranks GONE_GRACE_S to end by themselves
  (after node 0's STOP they end cleanly); a rank that fails because node 0 went away exits
  NODE0_GONE_EXIT without its report, and node k says what happened in one line.
- Rank 0 waited at least 300 s for node k, node k --dist-timeout-s for node 0: both sides now
  wait --dist-timeout-s for the other to arrive (`group._await_ranks`); the ranks of a node
  that checked in get as long as a local rank to join.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import logging
import multiprocessing.connection
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import torch.distributed as dist

from phaseflip.errors import InvalidRequestError, PhaseflipError
from phaseflip.model.loader import hub_repo_id

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

    from phaseflip.config import EngineConfig
    from phaseflip.model.config import ModelConfig

log = logging.getLogger(__name__)

# flags every node must share: they shape the group or say which weights the ranks hold.
# Not --model's path: it may differ between hosts (`HUB_ID` and the fingerprint say which model)
AGREED_FLAGS = ("dtype", "quantization", "kv_cache_dtype", "load_format", "device",
                "tp_size", "pp_size", "nnodes", "all_reduce", "all_reduce_max_kib",
                "enable_flip", "flip_layouts", "flip_weights")
HUB_ID = "--model (a Hugging Face id)"  # compared only where both nodes name one
FINGERPRINT = "the model's config.json and weight files"
ARRIVALS = "phaseflip/node_arrivals"  # a counter: one per node check-in
ARRIVAL, VERDICT, BEAT = "phaseflip/node_arrival/", "phaseflip/node_verdict/", "phaseflip/beat/"
OK = "ok"
BEAT_S = 1.0  # a node's beat period
SILENCE_S = 10.0  # rank 0 counts node k silent this long as gone, node k counts node 0 so
LOG_EVERY_S = 15.0  # "still waiting" lines
READ_S = 5.0  # how long a refusing rank 0 waits for the node to read its verdict
GONE_GRACE_S = 5.0  # node k's ranks' time to end by themselves once node 0's store closed
PROBE_S = 3.0  # a failing rank's time to see node 0's port refuse (its peers may die first)
NODE0_GONE_EXIT = 3  # a node-k rank that failed because node 0 went away (no report of its own)
SAMPLE_BYTES = 4096  # each of a weight file's three sampled stretches (start, middle, end)
T = TypeVar("T")


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
    repo = hub_repo_id(model_cfg.model_dir)
    if repo is not None:
        flags.append((HUB_ID, repo))
    flags.append((FINGERPRINT, model_fingerprint(model_cfg)))
    return tuple(flags)


def model_fingerprint(model_cfg: ModelConfig) -> str:
    """A digest of config.json and of each weight file's name, size and three sampled
    stretches: the same path on two hosts may hold two checkpoints, two paths the same one,
    and a fine-tune has its base's names and sizes but not its bytes (hashing the weights
    whole would take minutes)."""
    root = Path(model_cfg.model_dir)
    h = hashlib.sha256()
    for f in sorted(root.iterdir()) if root.is_dir() else []:
        if f.name == "config.json":
            h.update(f.read_bytes())
        elif f.suffix in (".safetensors", ".bin", ".pt"):
            size = f.stat().st_size
            h.update(f"{f.name}:{size};".encode())
            with open(f, "rb") as weights:
                for at in (0, size // 2, max(size - SAMPLE_BYTES, 0)):
                    weights.seek(at)
                    h.update(weights.read(SAMPLE_BYTES))
    return h.hexdigest()[:16]


def differences(mine: dict[str, str], theirs: dict[str, str], here: str,
                there: str) -> list[str]:
    """`--tp-size 4 on node 1, 2 on node 0` for each flag whose values differ (`HUB_ID` only
    where both name a hub id: a hub snapshot copied to a directory is known by its files)."""
    return [f"{name} {theirs.get(name, '(unset)')} {there}, {value} {here}"
            for name, value in mine.items()
            if theirs.get(name) != value and (name != HUB_ID or name in theirs)]


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


def reach(host: str, port: int, timeout_s: float = 2 * BEAT_S) -> bool | None:
    """Whether node 0's port accepts a connection: True; False if refused (its process
    ended: nothing listens); None if no answer in `timeout_s` (a host that is down)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except ConnectionRefusedError:
        return False
    except OSError:
        return None


def node0_gone(addr: str, patience_s: float = PROBE_S) -> bool:
    """Whether node 0's rendezvous refuses connections within `patience_s`: asked by a rank of
    node k that failed (its peers on node 0 may be gone a moment before node 0's store)."""
    host, port = split_addr(addr)
    end = time.monotonic() + patience_s
    while True:
        if reach(host, port, timeout_s=1.0) is False:
            return True
        if time.monotonic() >= end:
            return False
        time.sleep(0.2)


def within(timeout_s: float, fn: Callable[[], T]) -> T:
    """fn() from a daemon thread, given up on (TimeoutError) after `timeout_s`: a store op
    that waits for a frozen node 0 blocks past its own timeout (torch's TCPStore waits for
    node 0's reply to its cancel)."""
    out: list = []

    def run() -> None:
        try:
            out.append((True, fn()))
        except BaseException as e:  # noqa: BLE001 — handed to the caller
            out.append((False, e))

    t = threading.Thread(target=run, name=STORE_THREADS[0], daemon=True)
    t.start()
    t.join(timeout_s)
    if not out:
        raise TimeoutError(f"no answer within {timeout_s:g} s")
    ok, value = out[0]
    if not ok:
        raise value
    return value


STORE_THREADS = ("phaseflip-store-op", "phaseflip-beat")


def end_process(code: int) -> None:
    """Ends a `--node-rank k` process with `code` now if a thread of ours may still be inside
    a store call to a frozen node 0: should node 0's connection reset while the interpreter
    finalises, that thread's C++ wakes into a finalising interpreter and aborts the process
    (exit 134, "terminate called without an active exception"). Otherwise returns (the
    ordinary exit runs finalisers)."""
    if any(t.name in STORE_THREADS and t.is_alive() for t in threading.enumerate()):
        logging.shutdown()  # (our last line is the exit line: flushed before leaving)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


class NodeLink:
    """A `serve --node-rank k` host's line to rank 0's store: its check-in, then its beats.
    `failure` says why `watch` returned 1."""

    def __init__(self, store: dist.Store, node: int, addr: str | None = None,
                 silence_s: float = SILENCE_S) -> None:
        self.store, self.node = store, node
        self.addr = addr or f"{store.host}:{store.port}"
        self.silence_s = silence_s
        self.beats, self.gone = 0, False
        self.answered_at = time.monotonic()  # node 0's last answer to a beat
        self.failure: str | None = None
        self._exited: list[str] = []  # what the beat thread reports
        self._done = threading.Event()

    @classmethod
    def open(cls, addr: str, node: int, flags: tuple[tuple[str, str], ...],
             timeout_s: float) -> NodeLink:
        """Waits for node 0, checks this node's flags in; NodeJoinError if refused, or if
        node 0 gives no answer within `timeout_s` (also when it is frozen)."""
        who = f"node {node}"
        host, port = split_addr(addr)
        wait_for_port(host, port, timeout_s, who, addr)
        try:
            return within(timeout_s + READ_S, lambda: cls._join(addr, node, flags, timeout_s))
        except TimeoutError:
            raise NodeJoinError(f"{who}: node 0 at {addr} (--dist-init-addr) gave no answer to "
                                f"this node's check-in within {timeout_s:g} s "
                                "(--dist-timeout-s): is it stopped or frozen?") from None

    @classmethod
    def _join(cls, addr: str, node: int, flags: tuple[tuple[str, str], ...],
              timeout_s: float) -> NodeLink:
        host, port = split_addr(addr)
        try:
            store = dist.TCPStore(host, port, is_master=False,
                                  timeout=datetime.timedelta(seconds=timeout_s))
        except (dist.DistError, RuntimeError) as e:
            raise NodeJoinError(f"node {node}: {addr} (--dist-init-addr) answered but is no "
                                f"phaseflip rendezvous: {e}") from None
        link = cls(store, node, addr)
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
            raise NodeJoinError(f"node {self.node}: node 0 at {addr} (--dist-init-addr) gave "
                                f"no answer to this node's check-in within {timeout_s:g} s "
                                f"(--dist-timeout-s): {str(e).splitlines()[0]}") from None
        if verdict != OK:
            raise NodeJoinError(verdict)
        self.answered_at = time.monotonic()

    def beat(self, exited: list[str]) -> None:
        """Tells rank 0 this node lives (and which of its ranks exited), and waits for the
        store's answer (a write alone never fails on a frozen node 0); after node 0 is gone
        (a failed op) it stops."""
        if self.gone:
            return
        self.beats += 1
        key = f"{BEAT}{self.node}"
        try:
            self.store.set(key, json.dumps({"beat": self.beats, "exited": exited}))
            self.store.check([key])
        except (dist.DistError, RuntimeError):
            self.gone = True
            return
        self.answered_at = time.monotonic()

    def _pulse(self) -> None:
        """The beat thread. The store is touched only while node 0's port accepts: on a
        closed connection each op prints a C++ stack; a refused one means node 0 ended."""
        host, port = split_addr(self.addr)
        while not self._done.is_set() and not self.gone:
            answer = reach(host, port)
            if answer is False:
                self.gone = True
            elif answer:
                self.beat(self._exited)
            self._done.wait(BEAT_S)

    def watch(self, procs: list[BaseProcess]) -> int:
        """Beats (from a thread) until every rank exited; returns 0, or 1 with `failure` set:
        a rank failed, node 0 went away before the ranks ended (they get GONE_GRACE_S to end
        by themselves: a clean stop ends them first), or node 0 has not answered for
        `silence_s` (frozen, or its host is down). Ranks still running then are stopped."""
        self._exited = _failed(procs)
        pulse = threading.Thread(target=self._pulse, name=STORE_THREADS[1], daemon=True)
        pulse.start()
        pending, gone_at, silent_s = list(procs), None, 0.0
        while pending:
            multiprocessing.connection.wait([p.sentinel for p in pending], timeout=BEAT_S)
            pending = [p for p in pending if p.exitcode is None]
            self._exited = _failed(procs)
            now = time.monotonic()
            if any(p.exitcode == NODE0_GONE_EXIT for p in procs):
                self.gone = True  # a rank found node 0's port closed before the beats did
            if gone_at is None and self.gone:
                gone_at = now
            if pending and gone_at is None and now - self.answered_at > self.silence_s:
                silent_s = now - self.answered_at
            if pending and (silent_s or gone_at is not None and now - gone_at > GONE_GRACE_S):
                _stop(pending)
                break
        self._done.set()
        pulse.join(0 if silent_s else 3 * BEAT_S)  # a frozen node 0 holds it for good
        if not silent_s and not self.gone and not pulse.is_alive():
            with contextlib.suppress(TimeoutError):  # the last rank's death: rank 0 names it
                within(self.silence_s, lambda: self.beat(_failed(procs)))
        self.failure = self._why(procs, gone_at is not None, silent_s)
        return int(self.failure is not None)

    def _why(self, procs: list[BaseProcess], gone: bool, silent_s: float) -> str | None:
        at = f"node 0 at {self.addr} (--dist-init-addr)"
        if silent_s:
            return (f"node {self.node}: {at} has not answered for {silent_s:.0f} s (stopped, "
                    "frozen, or its host is down); this node's ranks were stopped: restart "
                    "every node")
        if not any(p.exitcode for p in procs):
            return None
        if gone:
            return (f"node {self.node}: {at} went away before this node's ranks were done "
                    "(stopped or failed: its own log says why); this node's ranks were "
                    "stopped: restart every node")
        return f"node {self.node}'s ranks failed: {', '.join(_failed(procs))}"


def _failed(procs: list[BaseProcess]) -> list[str]:
    return [f"{p.name} (exit code {p.exitcode})" for p in procs if p.exitcode not in (None, 0)]


def _stop(procs: list[BaseProcess]) -> None:
    """Terminates `procs` (all at once), then kills whatever is left after 5 s."""
    for p in procs:
        p.terminate()
    end = time.monotonic() + 5
    for p in procs:
        p.join(max(end - time.monotonic(), 0))
        if p.exitcode is None:
            p.kill()
            p.join(5)


class NodeCheckIns:
    """Rank 0's side of the check-ins: each arriving node's flags compared with its own, a
    verdict written back, a GroupFormationError on any difference."""

    def __init__(self, store: dist.Store, nnodes: int, flags: tuple[tuple[str, str], ...],
                 addr: str) -> None:
        self.store, self.nnodes, self.flags, self.addr = store, nnodes, dict(flags), addr
        self.seen = 0
        self.nodes: dict[int, float] = {}  # node: when it checked in (time.monotonic)

    def absent(self) -> list[int]:
        """The nodes that have not checked in yet."""
        return [n for n in range(1, self.nnodes) if n not in self.nodes]

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
            self.nodes[arrival["node"]] = time.monotonic()

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
