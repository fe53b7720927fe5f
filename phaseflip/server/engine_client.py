"""The front end's handle on the engine process: submit, stream back, abort, control calls.

One asyncio task reads the engine's output socket and routes each delta to the queue of the
request it belongs to; HTTP handlers only ever await their own queue.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing as mp
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from phaseflip.engine.outputs import StreamDelta
from phaseflip.errors import InvalidRequestError, PhaseflipError
from phaseflip.sampling.params import SamplingParams
from phaseflip.server import messages as m


class EngineDeadError(PhaseflipError):
    """The engine process exited; the server is unhealthy."""


class ShutdownError(EngineDeadError):
    """The server ended the request: it is shutting down and the drain time ran out."""


@dataclass
class EngineState:
    ready: m.Ready | None = None
    running: int = 0
    waiting: int = 0
    dead: str | None = None  # why the engine is gone, once it is
    unhealthy: str | None = None  # why the engine says it cannot serve (EngineHealth), if so
    flipping_to: str | None = None  # the target of the seam the engine is in (FlipState)
    in_flight: dict[str, asyncio.Queue] = field(default_factory=dict)
    widths: dict[str, int] = field(default_factory=dict)  # sequences (n) of each in flight
    # an HTTP request of several prompts: its id -> its prompts' engine ids, while it runs
    groups: dict[str, list[str]] = field(default_factory=dict)
    # requests whose consumer left (client gone) and whose end the engine has not sent yet:
    # their ids stay taken, or a new request of the same id would get the old one's end
    leaving: set[str] = field(default_factory=set)

    @property
    def problem(self) -> str | None:
        """Why new requests are refused (503): the engine is gone or says it is unhealthy."""
        if self.dead:
            return self.dead
        if self.unhealthy:
            return f"the engine is unhealthy: {self.unhealthy}"
        return None


class EngineClient:
    def __init__(self, requests_addr: str, outputs_addr: str, process: mp.Process | None):
        self.ctx = zmq.asyncio.Context()
        self.out = self.ctx.socket(zmq.PUSH)
        self.out.bind(requests_addr)
        self.inp = self.ctx.socket(zmq.PULL)
        self.inp.bind(outputs_addr)
        self.process = process
        self.state = EngineState()
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._ready = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._watch())]

    async def wait_ready(self, timeout_s: float | None = None) -> m.Ready:
        await asyncio.wait_for(self._ready.wait(), timeout_s)
        if self.state.ready is None:
            # the engine's own reason (it reports why it failed before exiting), else its exit
            raise EngineDeadError(self.state.unhealthy or self.state.dead
                                  or "engine failed to start")
        return self.state.ready

    async def _read(self) -> None:
        while True:
            msg = m.decode(await self.inp.recv())
            if isinstance(msg, m.Deltas):
                self.state.running, self.state.waiting = msg.running, msg.waiting
                for d in msg.deltas:
                    q = self.state.in_flight.get(d.request_id)
                    if q is not None:
                        q.put_nowait(d)
                    if d.usage is not None:  # (a request's last delta carries its usage)
                        self.state.leaving.discard(d.request_id)
            elif isinstance(msg, m.RequestFailed):
                q = self.state.in_flight.get(msg.rid)
                if q is not None:
                    q.put_nowait(msg)
                if msg.ends_later and not self.state.dead:  # taken until its end comes
                    self.state.leaving.add(msg.rid)
                else:
                    self.state.leaving.discard(msg.rid)
            elif isinstance(msg, m.ControlReply):
                fut = self._calls.pop(msg.call_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
            elif isinstance(msg, m.Ready):
                self.state.ready = msg
                self._ready.set()
            elif isinstance(msg, m.EngineHealth):
                self.state.unhealthy = None if msg.healthy else (msg.reason or "no reason given")
            elif isinstance(msg, m.FlipState):
                self.state.flipping_to = msg.flipping_to

    async def _watch(self) -> None:
        """Turns an engine exit into a named failure for everyone waiting on it."""
        if self.process is None:
            return
        while self.process.is_alive():
            await asyncio.sleep(0.5)
        for _ in range(50):  # its last messages (why it failed) go to the reader first
            if not await self.inp.poll(0):
                break
            await asyncio.sleep(0.01)
        self.state.dead = f"engine process exited with code {self.process.exitcode}"
        self.state.flipping_to = None  # no seam outlives the engine
        self.state.leaving.clear()  # (nothing more will end them)
        self._ready.set()
        err = m.RequestFailed("", "server_error", self.state.dead)
        for q in self.state.in_flight.values():
            q.put_nowait(err)
        for fut in list(self._calls.values()):
            if not fut.done():
                fut.set_exception(EngineDeadError(self.state.dead))

    async def generate(
        self, rid: str, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[StreamDelta]:
        """Streams the request's deltas; leaving early (client gone) aborts it in the engine."""
        if self.state.problem:
            raise EngineDeadError(self.state.problem)
        if rid in self.state.in_flight or rid in self.state.leaving:
            raise InvalidRequestError(f"request id {rid!r} is already in flight", "rid")
        q: asyncio.Queue = asyncio.Queue()
        self.state.in_flight[rid] = q
        self.state.widths[rid] = params.n
        done = sent = False
        carry = None  # taken from `q` while joining, not joinable: the next item
        try:
            # a send cancelled while the socket is full sends nothing (nothing to abort); one
            # the socket completed just as the consumer was cancelled did go out
            fut = self.out.send(m.encode(m.AddRequest(rid, prompt_ids, params)))
            try:
                await fut
            finally:
                sent = fut.done() and not fut.cancelled() and fut.exception() is None
            while not done:
                item = carry if carry is not None else await q.get()
                carry = None
                if isinstance(item, m.RequestFailed):
                    done = True
                    if item.kind == "shutdown":
                        raise ShutdownError(item.message)
                    if item.kind == "server_error":
                        raise EngineDeadError(item.message)
                    raise InvalidRequestError(item.message, item.param)
                # the consumer fell behind (deltas of several steps wait): one delta, so one
                # chunk and one socket write, instead of one per step
                parts = [item]
                while carry is None and not q.empty():
                    later = q.get_nowait()
                    if isinstance(later, m.RequestFailed) or not parts[-1].joins(later):
                        carry = later
                    else:
                        parts.append(later)
                if len(parts) > 1:
                    item = StreamDelta.joined(parts)
                done = item.usage is not None
                yield item
        finally:
            self.state.in_flight.pop(rid, None)
            self.state.widths.pop(rid, None)
            if sent and not done and self._leave(rid, q, carry):
                await self.abort(rid)

    def _leave(self, rid: str, q: asyncio.Queue, taken: object = None) -> bool:
        """The consumer of `rid` stops before its end: whether the engine still runs it (to
        be aborted next). The id stays in `leaving` until the engine's end of it arrives;
        an end already in `q`, or `taken` from it (by a join), means nothing is left to abort."""
        items = [] if taken is None else [taken]
        while not q.empty():
            items.append(q.get_nowait())
        if any(isinstance(i, m.RequestFailed) or i.usage is not None for i in items):
            return False
        if self.state.dead:
            return False
        self.state.leaving.add(rid)
        return True

    async def abort(self, rid: str) -> None:
        if not self.state.dead:
            await self.out.send(m.encode(m.AbortRequest(rid)))

    def in_use(self, rid: str) -> bool:
        """Whether `rid` names a request in flight (or one left and not yet ended by the
        engine), or the group of one of several prompts."""
        st = self.state
        return rid in st.in_flight or rid in st.leaving or rid in st.groups

    def matching(self, rid: str) -> list[str]:
        """The engine requests in flight for `rid`: itself, or the prompts of the request of
        several prompts that it names (exact ids only: "gen" names no "gen-…" request)."""
        if rid in self.state.in_flight:
            return [rid]
        return [r for r in self.state.groups.get(rid, ()) if r in self.state.in_flight]

    async def end_all(self, message: str) -> list[str]:
        """Ends every request in flight with `message` (a `ShutdownError` for its consumer)
        and aborts it in the engine; returns their ids."""
        rids = list(self.state.in_flight)
        for rid in rids:
            self.state.in_flight[rid].put_nowait(m.RequestFailed(rid, "shutdown", message))
            await self.abort(rid)
        return rids

    async def send_control(self, op: str, args: dict | None = None) -> asyncio.Future:
        """Sends a control call; the future gets its `ControlReply` whenever the engine answers
        (or `EngineDeadError`), also after its caller stopped waiting, unless cancelled."""
        if self.state.dead:
            raise EngineDeadError(self.state.dead)
        call_id = next(self._call_ids)
        fut = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        # answered, failed or cancelled: no entry is left, and a failure nobody awaits any
        # more is not logged as "never retrieved"
        fut.add_done_callback(lambda f: (self._calls.pop(call_id, None),
                                         f.cancelled() or f.exception()))
        try:
            await self.out.send(m.encode(m.Control(call_id, op, args)))
        except BaseException:
            fut.cancel()
            raise
        return fut

    async def control(self, op: str, timeout_s: float = 30.0, args: dict | None = None
                      ) -> m.ControlReply:
        """`send_control` and its reply, both within `timeout_s` (TimeoutError, the call
        cancelled): the send too, since with no engine connected it would wait for ever."""
        async def call() -> m.ControlReply:
            return await (await self.send_control(op, args))

        return await asyncio.wait_for(call(), timeout_s)

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        self.out.close(linger=0)
        self.inp.close(linger=0)
        self.ctx.term()
