"""The driver's side of a multi-rank layout: spawn the local worker ranks, then for every step
broadcast the forward plan, run stage 0 / TP rank 0 itself and collect the logits (or, with
PP, the ids the last stage sampled for the rows the plan marked: `sampling/last_stage.py`).

`DistributedRunner` stands in for `ModelRunner` inside `EngineCore`, so the scheduler (the one
decider) does not know how many ranks execute its plans. With HiCache it is handed the node's
shared host frames (made and freed by the HiCache controller, which outlives this runner across
phase flips), has every local rank map them, and carries the controller's transfer orders to
every rank (`DistributedChannel`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections import deque
from collections.abc import Callable

import torch

from phaseflip.cache.hicache.frames import HostFrames
from phaseflip.cache.hicache.transfer import TransferChannel, TransferOrders
from phaseflip.config import EngineConfig
from phaseflip.distributed.micro_batch import MicroBatchSizer, PartClock
from phaseflip.distributed.plan_codec import PlanEncoder
from phaseflip.distributed.rank_set import RankSet
from phaseflip.distributed.stage import StepMessage
from phaseflip.forward_batch import ForwardBatch
from phaseflip.model.weight_image import WeightImage
from phaseflip.sampling.last_stage import SampledTokens, SampleSpec

log = logging.getLogger(__name__)
# Without stage pipes (NCCL, or gloo across nodes), each launched step's logits land in a
# buffer of their own on rank 0: the most bytes of them in flight at once (with the last
# received one, still being sampled). A new allocation outside the KV pool's budget, within
# the device's share that --mem-fraction leaves over (a 128k vocabulary: 2 048 rows).
IN_FLIGHT_LOGITS_BYTES = 1 << 30
# Set (to anything) in the engine's environment: with PP, every step's logits travel to the
# driver, which samples them (before the last stage sampled; benchmarks and tests compare)
DRIVER_SAMPLES_ENV = "PHASEFLIP_PP_DRIVER_SAMPLES"
# Set (to anything): every PP prompt step is cut by the token rule, not by rank 0's measured
# stage time (`micro_batch.py`; benchmarks compare)
PARTS_BY_TOKENS_ENV = "PHASEFLIP_PP_PARTS_BY_TOKENS"


class DistributedChannel(TransferChannel):
    """HiCache transfer orders ride the next message rank 0 broadcasts (a plan, or a fence when
    nothing runs); a ticket is that message's number.

    Why completion is known without any extra message: every rank executes a message's orders
    before its forward and orders that forward after the copies of all EARLIER messages
    (`StageExecutor.run`). The logits of step m (or the ids the last stage sampled from them)
    reach the driver only after every rank ran its part of forward m: TP ranks all-reduce in
    every layer, stage s+1 needs stage s's hidden states, and the logits come from the last
    stage. So when forward m has returned, the copies of every message < m are done on every
    rank; a fence (all ranks synchronise their copies,
    then meet in a barrier) completes its own message too. Loads of message t are *visible* as
    soon as t is sent: any later forward is ordered after them on every rank.
    """

    def __init__(self, runner: DistributedRunner) -> None:
        self.runner = runner
        self._staged = TransferOrders()
        self.completed = 0  # every message <= this is done on every rank

    def dispatch(self, orders: TransferOrders) -> object:
        self._staged.extend(orders)
        return self.runner.step_no + 1

    def take(self) -> TransferOrders | None:
        orders, self._staged = self._staged, TransferOrders()
        return orders or None

    def visible(self, ticket: object) -> bool:
        return ticket <= self.runner.step_no  # type: ignore[operator]

    def done(self, ticket: object) -> bool:
        return ticket <= self.completed  # type: ignore[operator]

    def fence(self) -> None:
        self.runner.fence()


class DistributedRunner:
    def __init__(self, cfg: EngineConfig, hicache_frames: HostFrames | None = None,
                 weight_image: WeightImage | None = None, ranks: RankSet | None = None
                 ) -> None:
        """Runs `cfg`'s layout on `ranks` (every rank builds it now). `ranks`: the engine's
        rank processes, which outlive this runner across phase flips; None: start a set for
        this runner alone, stopped with it. `hicache_frames`: HiCache's host tier as shared
        memory of the node (None: no HiCache), owned by the controller: this runner never
        frees it. `weight_image`: the checkpoint in shared memory of the node, which every
        rank loads its shard from (None: from the checkpoint); its owner is the engine."""
        self.owns_ranks = ranks is None
        self.ranks = ranks or RankSet(cfg, hicache_frames, weight_image)
        self.spec = self.ranks.spec.with_layout(cfg.tp_size, cfg.pp_size)
        self.step_no = 0
        # each row's new slots only, to ranks that mirror the rest (checked when accounting is)
        self.encoder = PlanEncoder(check=cfg.check_accounting)
        self.hicache_frames = hicache_frames
        self.hicache_channel = DistributedChannel(self) if hicache_frames is not None else None
        # launched steps whose logits are not received yet, oldest first (received in order)
        self._awaited: deque[_AwaitedLogits] = deque()
        self._held_bytes = 0  # the last logits received in place: still in the pipe
        self.closed = False
        try:
            layout = self.ranks.relayout(cfg)
        except BaseException:
            self.closed = True
            raise
        self.groups, self.runner, self.stage = layout.groups, layout.runner, layout.stage
        self.rank_builds = layout.rank_builds  # every rank's build report (`build_report`)
        self.decode_depth = self._decode_depth(cfg)
        # the last stage is another rank: it samples the steps whose rows allow it
        # (`sampling/last_stage.py`), and only their ids cross to rank 0
        self.last_stage_samples = cfg.pp_size > 1 and not os.environ.get(DRIVER_SAMPLES_ENV)
        # prompt steps cut by stage time: rank 0 times its own parts (`micro_batch.py`)
        self.sizer = (MicroBatchSizer(cfg.pp_size, cfg.pp_min_micro_batch_tokens)
                      if cfg.pp_size > 1 and not os.environ.get(PARTS_BY_TOKENS_ENV) else None)
        if self.sizer is not None:
            self.stage.part_clock = PartClock(self.sizer, self.runner.device)

    # the `Runner` protocol (model/runner.py), as rank 0 sees it
    @property
    def num_slots(self) -> int:
        return self.runner.num_slots

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def dtype(self) -> torch.dtype:
        return self.runner.dtype

    @property
    def build_s(self) -> dict[str, float]:
        """Rank 0's build of this layout by part (the other ranks log theirs)."""
        return self.runner.build_s

    @property
    def weights_load(self):
        """Rank 0's `WeightsLoad` (how it loaded its shard, timed)."""
        return self.runner.weights_load

    @property
    def graphs(self):
        """Rank 0's decode graphs (each rank captures its own)."""
        return self.runner.graphs

    @property
    def graph_capture(self) -> str | None:
        return self.runner.graph_capture

    @property
    def graphs_kept_bytes(self) -> int | None:
        """Reserved device bytes of rank 0's parked decode graphs (other layouts')."""
        return self.runner.graphs_kept_bytes

    @property
    def numerics(self) -> dict[str, str | None]:
        return self.runner.numerics

    def transfer_channel(self, frames: HostFrames, geometry: object) -> DistributedChannel:
        """HiCache's channel to every rank: orders ride the plan broadcast (`Runner`)."""
        if self.hicache_channel is None or frames is not self.hicache_frames:
            raise RuntimeError("HiCache: the ranks map other host frames than the controller's")
        return self.hicache_channel

    def forward(self, plan: ForwardBatch, future: torch.Tensor | None = None,
                sample: SampleSpec | None = None) -> torch.Tensor | SampledTokens:
        """The `Runner` forward. `future`: a run-ahead step's previous sampled tokens, on rank
        0's device, which the plan's placeholders name (`StepMessage.future_len`). `sample`:
        the rows the last stage samples (`last_stage_samples`): their ids come back, as
        `SampledTokens`, instead of the logits."""
        logits = self._send(plan, fence=False, future=future, sample=sample)
        return self._arrived(logits, self.step_no)

    def launch(self, plan: ForwardBatch, future: torch.Tensor | None = None,
               sample: SampleSpec | None = None
               ) -> Callable[[], torch.Tensor | SampledTokens]:
        """`forward` for a run-ahead step, handing back a wait for the logits: when they come
        from another rank (PP), the driver makes the previous step's outputs while the later
        stages run, and waits only when it samples. With `decode_depth` > 1 up to that many
        launched steps are in flight at once (the engine samples the oldest); else anything
        rank 0 sends first completes the receive (`_send`; law 3)."""
        out = self._send(plan, fence=False, future=future, defer=True, sample=sample)
        if not callable(out):  # rank 0 is the last stage: the logits are here
            logits = self._arrived(out, self.step_no)
            return lambda: logits
        sample = sample if self.last_stage_samples else None
        if sample is not None:  # the ids (and a mixed step's logits of the driver's rows)
            shape, dtype = sample.message(self.runner.model_cfg.vocab_size)
            nbytes = shape[0] * dtype.itemsize
        else:
            nbytes = int(plan.logits_indices.numel()) * self._row_bytes
        awaited = _AwaitedLogits(self, out, self.step_no, nbytes + 8)
        self._awaited.append(awaited)
        return awaited

    def _decode_depth(self, cfg: EngineConfig) -> int:
        """How many launched PP steps may be in flight at once (`--pp-async-decode`): pp_size
        when pp_size + 1 decode groups' logits fit where they wait for rank 0, else 1 (one
        step at a time, each cut into micro-batches).

        Through a shared-memory pipe (gloo, one node) they must fit the pipe: the last stage
        writes a step's logits before it reads the next step's hidden states, and rank 0
        reads logits only after it has sent a step's hidden states. A last stage blocked on
        a full logits pipe while rank 0 is blocked on a full hidden-state pipe is a
        deadlock; a pipe that holds every logits message not yet read (and the one read in
        place) never blocks (`_may_overlap`). Without pipes (NCCL, or across nodes) the
        logits have a group of their own, rank 0 posts each step's receive into a buffer of
        its own at launch, and no send blocks its rank (`StageExecutor._irecv_logits`):
        they must fit IN_FLIGHT_LOGITS_BYTES."""
        self._row_bytes = 4 * self.runner.model_cfg.vocab_size  # float32 logits
        p = cfg.pp_size
        if not cfg.pp_async_decode or p == 1:
            return 1
        group_rows = -(-cfg.max_running_requests // p)
        capacity = self._logits_capacity()
        if (p + 1) * group_rows * self._row_bytes > capacity:
            where = ("stage pipe" if self.stage.pipes is not None
                     else "budget for logits in flight")
            log.warning("--pp-async-decode: %d decode groups of %d rows of logits do not fit "
                        "the %d MiB %s; PP steps run one at a time (lower "
                        "--max-running-requests)", p + 1, group_rows, capacity >> 20, where)
            return 1
        return p

    def _logits_capacity(self) -> int:
        """Bytes of logits that may wait for rank 0 at once (`_decode_depth`)."""
        pipes = self.stage.pipes
        return pipes.capacity if pipes is not None else IN_FLIGHT_LOGITS_BYTES

    def _may_overlap(self, plan: ForwardBatch | None, fence: bool, defer: bool = True) -> bool:
        """Whether this message may go out while launched steps' logits are not received:
        only a launched (`defer`) plan, only with `decode_depth` > 1, and only while the
        logits pipe (or the budget, without pipes) holds every unread logits message with
        the one read in place (see `_decode_depth`). A synchronous step receives its logits
        at once, so nothing older may be unread: it would read a launched step's as its own."""
        if not self._awaited:
            return True
        if self.decode_depth == 1 or fence or plan is None or not defer:
            return False
        unread = sum(a.nbytes for a in self._awaited)
        return unread + self._held_bytes <= self._logits_capacity()

    def _receive_until(self, target: _AwaitedLogits | None) -> None:
        """Receives launched steps' logits in launch order, up to `target` (None: all). From
        a pipe, each but the last is copied out: the next receive from the same rank hands
        the pipe's bytes back to the writer (without pipes each has a buffer of its own)."""
        piped = self.stage.pipes is not None
        while self._awaited:
            awaited = self._awaited.popleft()
            logits = self._collect(awaited.receive, awaited.step)
            self._held_bytes = awaited.nbytes
            last = awaited is target or not self._awaited
            awaited.logits = logits.clone() if piped and not last else logits
            if awaited is target:
                return

    def _arrived(self, logits: torch.Tensor, step: int) -> torch.Tensor:
        """Step `step`'s logits are on rank 0: every rank ran its part of that forward."""
        if self.hicache_channel is not None:
            self.hicache_channel.completed = max(self.hicache_channel.completed, step - 1)
        return logits.to(self.runner.device)

    def _collect(self, receive: Callable[[], torch.Tensor], step: int) -> torch.Tensor:
        try:
            logits = receive()
        except Exception as e:
            err = self.ranks.stall_error(e)
            self.close(graceful=False)
            raise err from e
        finally:
            self.stage.tracker.set("idle")
        return self._arrived(logits, step)

    def fence(self) -> None:
        """Deliver pending HiCache orders and wait until every rank has done all its copies."""
        self._send(None, fence=True)
        if self.hicache_channel is not None:
            self.hicache_channel.completed = self.step_no

    def _send(self, plan: ForwardBatch | None, fence: bool, future: torch.Tensor | None = None,
              defer: bool = False, sample: SampleSpec | None = None
              ) -> torch.Tensor | Callable[[], torch.Tensor] | None:
        overlap = self._may_overlap(plan, fence, defer)
        if not overlap:  # launched steps' logits first (law 3)
            self._receive_until(None)
        # a decode group of a run-ahead step, with the others in flight: one micro-batch
        whole = (defer and overlap and self.decode_depth > 1 and plan is not None
                 and plan.num_tokens == plan.batch_size)
        self.step_no += 1
        tracker = self.stage.tracker
        channel = self.hicache_channel
        n_future = 0 if future is None or plan is None else int(future.numel())
        ids = self.tokens_on_host(future) if n_future else None
        msg = StepMessage(self.step_no, plan, channel.take() if channel else None, fence,
                          n_future, ids, whole,
                          sample if self.last_stage_samples and plan is not None else None,
                          self._parts(plan, whole))
        wire = dataclasses.replace(msg, plan=self.encoder.encode(plan)) if plan else msg
        try:
            with tracker.at("broadcasting the plan", self.step_no):
                self.ranks.broadcast(wire)
            return self.stage.run(msg, future if n_future else None, defer)
        except Exception as e:
            err = self.ranks.stall_error(e)
            self.close(graceful=False)
            raise err from e
        finally:
            tracker.set("idle")

    def forget_timings(self) -> None:
        """The prompt parts' stage times start over (after a launch warm-up, whose parts
        carried the kernels' compile)."""
        if self.sizer is not None:
            self.stage.part_clock.forget()

    def _parts(self, plan: ForwardBatch | None, whole: bool) -> int:
        """The micro-batches of a step with prompt tokens, by rank 0's measured stage time
        (0: decode steps, and every step with `PHASEFLIP_PP_PARTS_BY_TOKENS=1`)."""
        if self.sizer is None or plan is None or whole or plan.num_tokens == plan.batch_size:
            return 0
        self.stage.part_clock.harvest()
        return self.sizer.parts(plan.num_tokens)

    @staticmethod
    def tokens_on_host(future: torch.Tensor):
        """A run-ahead step's tokens as host values when they are already (rank 0 on the CPU):
        they ride the message. On a GPU they are still being sampled: None, and stage 0's
        TP ranks get them by a broadcast queued on the device (`StageExecutor.run`)."""
        return future.numpy() if future.device.type == "cpu" else None

    def report_ranks(self) -> list[str]:
        return self.ranks.report_ranks()

    def check_alive(self) -> None:
        if self.ranks.exited_workers():
            self.closed = True
        self.ranks.check_alive()

    def close(self, graceful: bool = True) -> None:
        """Ends this layout on every rank: its device memory is freed in place on each (a stray
        reference to this runner must not keep rank 0's weights and KV pool from the next
        layout, whose ranks size their pools from what is free: seen on the H200 pair after
        tp2 → pp2, "-8.10 GiB left for the KV cache"). The rank processes stay for the next
        layout unless this runner owns them; a failed group (not graceful) is stopped whole."""
        if self.closed:
            return
        self.closed = True
        if graceful and not self.owns_ranks:
            self.ranks.release()
        else:
            self.ranks.close(graceful)


class _AwaitedLogits:
    """A launched step's logits, received at the first call (then kept); the steps launched
    before it are received first, in order. `nbytes`: its message in the logits pipe."""

    def __init__(self, runner: DistributedRunner, receive: Callable[[], torch.Tensor],
                 step: int, nbytes: int) -> None:
        self.runner, self.receive, self.step, self.nbytes = runner, receive, step, nbytes
        self.logits: torch.Tensor | None = None

    def __call__(self) -> torch.Tensor:
        if self.logits is None:
            self.runner._receive_until(self)
        return self.logits
