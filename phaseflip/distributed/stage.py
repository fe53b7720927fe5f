"""Executing one forward plan on one rank: its micro-batches through its stage.

Stage s receives each micro-batch's (hidden, residual) from stage s-1, runs its layers and sends
the result on to stage s+1 with a non-blocking send, so it is already working on the next
micro-batch while s+1 works on this one. Every receive has a matching send in the same step
by construction (each stage handles the same micro-batches in the same order), and a stage
posts its sends before it blocks on anything else. The last stage's TP rank 0 sends the logits
to the driver, or only the ids it sampled when the step message says which rows and how
(`StepMessage.sample`, `sampling/last_stage.py`): through a shared-memory pipe (gloo, one
node), else by point-to-point on the logits' own group (`RankGroups.logits_group`), never
blocking: rank 0 posts the receive when it launches the step, and the last stage waits for a
send only before its next one.

With HiCache, every message also carries the driver's transfer orders; `run` issues them on the
rank's `KVTransferEngine` before the forward, after ordering the forward behind the copies of
every EARLIER message (see `run`), and a fence message waits for all copies on every rank.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist

from phaseflip.cache.hicache.transfer import KVTransferEngine
from phaseflip.distributed.group import RankGroups
from phaseflip.distributed.micro_batch import PartClock, token_rule
from phaseflip.distributed.plan_channel import StagePipes
from phaseflip.distributed.plan_codec import StepMessage
from phaseflip.distributed.watchdog import PositionTracker
from phaseflip.forward_batch import ForwardBatch
from phaseflip.model.runner import ModelRunner
from phaseflip.sampling.last_stage import SampledTokens, SampleSpec, pack

# Benchmarks only (`benchmarks/bench_host_step.py`): set in the environment of the engine
# process before its ranks are spawned, every rank's stage runs no model math.
NULL_FORWARD_ENV = "PHASEFLIP_NULL_FORWARD"


class NullStage:
    """A stage without model math, for measuring the host's share of a step: zero hidden
    states of the right shape, and on the last stage rows of a fixed random logits matrix
    (the window moves each call, so sampled tokens vary as in real decoding). Everything else
    of the step (plans, sends, receives, logits to the driver, sampling) runs for real."""

    SPARE = 61  # window offsets cycle through this many values

    def __init__(self, runner: ModelRunner) -> None:
        cfg, mc = runner.cfg, runner.model_cfg
        self.last = runner.layout.pp_rank == runner.layout.pp_size - 1
        gen = torch.Generator().manual_seed(cfg.seed)
        self.table = torch.randn(cfg.max_running_requests + self.SPARE, mc.vocab_size,
                                 generator=gen) * 4.0
        self.zeros = torch.zeros(0, mc.hidden_size, dtype=runner.dtype, device=runner.device)
        self.calls = 0

    def run_stage(self, mb: ForwardBatch, hidden=None, residual=None):
        rows = int(mb.logits_indices.numel()) if self.last else mb.num_tokens
        if self.zeros.shape[0] < rows:
            self.zeros = self.zeros.new_zeros(max(rows, 2 * self.zeros.shape[0]),
                                              self.zeros.shape[1])
        return self.zeros[:rows], self.zeros[:rows]

    def stage_logits(self, mb: ForwardBatch, hidden=None, residual=None,
                     keep: bool = False) -> torch.Tensor:
        return self.logits(self.run_stage(mb)[0])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        rows, off = hidden.shape[0], self.calls % self.SPARE
        self.calls += 1
        if rows + off > self.table.shape[0]:  # a prompt step of more rows: any values do
            return torch.zeros(rows, self.table.shape[1])
        return self.table[off : off + rows]


class StageExecutor:
    def __init__(self, runner: ModelRunner, groups: RankGroups, tracker: PositionTracker,
                 transfers: KVTransferEngine | None = None):
        self.runner, self.groups, self.tracker = runner, groups, tracker
        self.transfers = transfers
        self.spec = groups.spec
        self.staged = self.spec.backend == "gloo"  # gloo cannot send CUDA tensors: stage on host
        self.hidden_size = runner.model_cfg.hidden_size
        # what runs this rank's layers: the model, or nothing at all (benchmarks)
        self.model = NullStage(runner) if os.environ.get(NULL_FORWARD_ENV) else runner
        # host-staged hand-offs between ranks of one node go through shared memory
        self.pipes = (StagePipes(None, self.spec.timeout_s) if self.staged
                      and self.spec.world_size == self.spec.ranks_per_node
                      and self.spec.stage_pipes else None)
        # point-to-point sends not known done yet: this rank's last step's hidden states, the
        # last stage's last logits (each with its buffer, kept alive until then)
        self._sends: list[tuple[object, torch.Tensor]] = []
        self._logits_send: tuple[object, torch.Tensor] | None = None
        # what crossed to rank 0 from the last stage, counted by both: logits bytes, and
        # sampled ids (`StepMessage.sample`)
        self.shipped = {"logits_bytes": 0, "token_ids": 0}
        # rank 0's: times its prompt parts for the part count by stage time (the driver's)
        self.part_clock: PartClock | None = None

    def run(self, msg: StepMessage, future: torch.Tensor | None = None,
            defer: bool = False) -> torch.Tensor | Callable[[], torch.Tensor] | None:
        """Executes one message. The forward of message m starts only after this rank's copies
        of messages < m (a load of m-1 is read by m at the earliest; a store's slots may be
        reused from m+1 on). The copies of m itself overlap m's forward: they touch no slot the
        forward reads or writes, which the driver guarantees. `future`: rank 0's previous
        sampled tokens, for a run-ahead step (`msg.future_len` of them). `defer` (rank 0):
        when the logits come from another rank, return the receive to call instead of
        waiting (`DistributedRunner.launch`)."""
        xfer = self.transfers
        if xfer is not None:
            if msg.plan is not None:
                xfer.order_before_forward()
            if msg.transfers:
                xfer.execute(msg.transfers)
        if msg.future_len and self.first:
            future = self._share_future(msg, future)
        out = (self.execute(msg.step, msg.plan, future, defer, msg.whole, msg.sample,
                            msg.parts) if msg.plan is not None else None)
        if msg.fence:
            with self.tracker.at("HiCache fence: waiting for copies and every rank", msg.step):
                self.drain_sends()
                if xfer is not None:
                    xfer.synchronize()
                dist.barrier(group=self.groups.cpu_group)
        return out

    @property
    def first(self) -> bool:
        return self.groups.pp_rank == 0

    @property
    def last(self) -> bool:
        return self.groups.pp_rank == self.spec.pp_size - 1

    def micro_batches(self, plan: ForwardBatch, parts: int = 0) -> list[ForwardBatch]:
        """The plan cut for the pipeline; every stage cuts the same plan the same way: into
        `parts` (rank 0's choice by stage time, `StepMessage.parts`) when given.

        Decode-only steps: pp_size parts, as a decode micro-batch costs a full read of the
        stage's weights for few FLOPs, so more parts only add time. Steps with prompt tokens
        are compute bound: m parts over p stages leave a bubble of (p-1)/(m+p-1), so cut into
        T // pp_min_micro_batch_tokens parts, clamped to [p, 4p] (p=2: 1/3 of the step idle at
        m=2, 1/9 at m=8); the floor keeps each part's matmuls compute bound, the cap bounds
        the per-part launch and hand-off overhead where the bubble has little left to give."""
        p = self.spec.pp_size
        if p == 1:
            return [plan]
        tokens = plan.num_tokens
        if tokens == plan.batch_size:  # one token per sequence: decode only
            return plan.split(p)
        if parts > 0:
            return plan.split(parts)
        return plan.split(token_rule(tokens, p, self.runner.cfg.pp_min_micro_batch_tokens))

    def _share_future(self, msg: StepMessage, future: torch.Tensor | None) -> torch.Tensor:
        """Stage 0's TP ranks all get rank 0's `future` tokens (one small broadcast on their
        TP group, before any all-reduce of the step: every one of them makes it here)."""
        if self.spec.tp_size == 1:
            return future
        if msg.future_ids is not None:  # host values already: they rode the message
            return future if future is not None else torch.from_numpy(msg.future_ids)
        device = "cpu" if self.staged else self.runner.device
        if self.groups.rank == 0:
            buf = future.to(device, torch.int64).contiguous()
        else:
            buf = torch.empty(msg.future_len, dtype=torch.int64, device=device)
        with self.tracker.at("share the run-ahead tokens of stage 0", msg.step):
            dist.broadcast(buf, src=0, group=self.groups.tp_group)
        return buf.to(self.runner.device)

    def execute(self, step: int, plan: ForwardBatch, future: torch.Tensor | None = None,
                defer: bool = False, whole: bool = False, sample: SampleSpec | None = None,
                parts: int = 0) -> torch.Tensor | SampledTokens | Callable | None:
        """Runs the plan; returns the float32 logits on the driver (or with `sample`, when the
        last stage is another rank, the ids it sampled), None elsewhere. `future` (stage 0 of
        a run-ahead step): the tokens the plan's placeholders name. `whole`
        (`StepMessage.whole`): one micro-batch."""
        tr, runner = self.tracker, self.runner
        pending, logits = [], []
        if future is not None and runner.device.type == "cpu":  # filled once, before the cut
            plan, future = plan.with_future_tokens(future), None
        cut = [plan] if whole else self.micro_batches(plan, parts)
        if future is not None and len(cut) > 1:  # host plan, device tokens: per part
            _place_futures(plan, cut)
        clock = self.part_clock if plan.num_tokens > plan.batch_size else None
        for i, mb in enumerate(cut):
            hidden = residual = None
            if future is not None:  # placeholders filled on the device, no host read
                mb = mb.to(runner.device).with_future_tokens(future)
            if not self.first:
                src = self.groups.stage_rank(self.groups.pp_rank - 1)
                with tr.at(f"recv hidden of micro-batch {i} from rank {src}", step):
                    hidden, residual = self._recv((2, mb.num_tokens, self.hidden_size),
                                                  runner.dtype, src)
            if self.last:  # through the LM head: logits on TP rank 0, None on the others
                with tr.at(f"forward micro-batch {i}", step):  # all but the last part kept
                    logits.append(self.model.stage_logits(mb, hidden, residual,
                                                          keep=i < len(cut) - 1))
                continue
            began = clock.start() if clock is not None else None
            with tr.at(f"forward micro-batch {i}", step):
                h, r = self.model.run_stage(mb, hidden, residual)
            dst = self.groups.stage_rank(self.groups.pp_rank + 1)
            pending.append(self._isend(torch.stack((h, r)), dst))  # one message
            if clock is not None:
                clock.stop(began, mb.num_tokens)
        with tr.at("drain the previous step's sends", step):  # this step's stay in flight
            self.drain_sends(logits=False)
        self._sends = pending
        out = logits if logits and logits[0] is not None else None  # None: not TP rank 0
        return self._logits_to_driver(step, plan, out, defer, sample)

    def drain_sends(self, logits: bool = True) -> None:
        """Waits for this rank's point-to-point sends in flight (and the last logits sent,
        with `logits`). Their receivers post the receives within the same steps, so the
        waits end; a send left in flight from one step to the next lets this rank run the
        next step while the peer is still behind (a gloo send completes only once the peer
        receives it)."""
        sends, self._sends = self._sends, []
        if logits and self._logits_send is not None:
            sends.append(self._logits_send)
            self._logits_send = None
        for work, _keep in sends:
            work.wait()

    def _logits_to_driver(self, step: int, plan: ForwardBatch,
                          logits: list[torch.Tensor] | None, defer: bool = False,
                          sample: SampleSpec | None = None):
        """`logits`: the last stage's per micro-batch (TP rank 0), sent as one message; with
        `sample`, the ids sampled from them instead (one small message), and the logits of
        the driver's rows of a mixed step with them (`SampleSpec.message`)."""
        rank, last_rank0 = self.groups.rank, (self.spec.pp_size - 1) * self.spec.tp_size
        if rank == 0 and self.last:  # one part (TP): its logits as they are, not a copy
            return logits[0] if len(logits) == 1 else torch.cat(logits)
        what = "logits" if sample is None else "sampled ids"
        if self.last and rank == last_rank0:
            if sample is None:
                self.shipped["logits_bytes"] += 4 * sum(t.numel() for t in logits)
            else:
                with self.tracker.at("sample on the last stage", step):
                    logits, nbytes = pack(logits, sample)
                self.shipped["logits_bytes"] += nbytes
                self.shipped["token_ids"] += len(sample.rows)
            with self.tracker.at(f"send {what} to rank 0", step):
                if self.pipes is not None:
                    self._send_parts(logits, 0)
                else:
                    self._isend_logits(logits)
        elif rank == 0:
            vocab = self.runner.model_cfg.vocab_size
            if sample is None:
                shape, dtype = (int(plan.logits_indices.numel()), vocab), torch.float32
            else:
                shape, dtype = sample.message(vocab)
            if self.pipes is None:
                receive = self._irecv_logits(step, shape, dtype, last_rank0, what)
            else:
                def receive() -> torch.Tensor:
                    with self.tracker.at(f"recv {what} from rank {last_rank0}", step):
                        return self._recv(shape, dtype, last_rank0)

            def arrived() -> torch.Tensor | SampledTokens:
                t = receive()
                if sample is None:
                    self.shipped["logits_bytes"] += 4 * t.numel()
                    return t
                self.shipped["token_ids"] += len(sample.rows)
                out = SampledTokens.unpack(t, sample, vocab, copy=self.pipes is not None)
                if out.logits is not None:
                    self.shipped["logits_bytes"] += 4 * out.logits.numel()
                # (copy: ids in a pipe are valid until its next receive, but become the
                # next step's run-ahead tokens, `InFlight`)
                return out

            return arrived if defer else arrived()
        return None

    # -------------------------------------------------------------- point to point
    def _isend_logits(self, parts: list[torch.Tensor]) -> None:
        """The logits to rank 0 on their own group, from a copy (the last part may be a
        decode graph's static buffer, which the next replay overwrites while the send may
        still read it). Only the previous logits send is waited for, here: a blocking send
        would hold this rank (on NCCL, its compute stream) until rank 0 receives, and the
        next decode group's forward with it."""
        t = torch.cat(parts)  # a new tensor, also for one part
        t = t.cpu() if self.staged else t
        if self._logits_send is not None:
            self._logits_send[0].wait()
        self._logits_send = dist.isend(t, 0, group=self.groups.logits_group), t

    def _irecv_logits(self, step: int, shape: tuple[int, ...], dtype: torch.dtype, src: int,
                      what: str = "logits") -> Callable[[], torch.Tensor]:
        """Posts the receive of a step's logits now, into a buffer of its own, and returns
        the wait. Posted at launch, before the next decode group's stage-0 forward is queued:
        on NCCL an op's stream first waits for the compute stream as it is at issue time, so
        a receive posted later would wait for that forward; and the last stage's send is
        matched at once, whatever rank 0 does next."""
        device = "cpu" if self.staged else self.runner.device
        buf = torch.empty(shape, dtype=dtype, device=device)
        work = dist.irecv(buf, src, group=self.groups.logits_group)

        def receive() -> torch.Tensor:
            with self.tracker.at(f"recv {what} from rank {src}", step):
                work.wait()
            return buf.to(self.runner.device)

        return receive

    def _isend(self, t: torch.Tensor, dst: int):
        # `t` is a new tensor (the stack): a decode graph's static output, which the next
        # micro-batch's replay overwrites while NCCL's stream may still be reading it, is not
        # sent itself
        t = t.cpu() if self.staged else t
        if self.pipes is not None:
            self.pipes.send(t, dst)  # copied into the ring: done
            return _DONE, t
        return dist.isend(t, dst), t  # keep the buffer alive until the send completes

    def _send(self, t: torch.Tensor, dst: int) -> None:
        t = t.contiguous().cpu() if self.staged else t.contiguous()
        if self.pipes is not None:
            self.pipes.send(t, dst)
        else:
            dist.send(t, dst)

    def _send_parts(self, parts: list[torch.Tensor], dst: int) -> None:
        """The parts as one tensor (rows after rows): a shared-memory pipe copies them in one
        after the other, with no concatenation first (4 MiB of batch-256 logits: 0.4 ms)."""
        if self.pipes is None or len(parts) == 1:
            self._send(parts[0] if len(parts) == 1 else torch.cat(parts), dst)
            return
        self.pipes.send_parts([t.contiguous().cpu() for t in parts], dst)

    def _recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int) -> torch.Tensor:
        if self.pipes is not None:
            return self.pipes.recv(shape, dtype, src).to(self.runner.device)
        device = "cpu" if self.staged else self.runner.device
        buf = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(buf, src)
        return buf.to(self.runner.device)


def _place_futures(plan: ForwardBatch, parts: list[ForwardBatch]) -> None:
    """Gives each micro-batch of `plan` its placeholders' host indices (`split` drops them):
    its tokens are then filled by one indexed copy, not resolved on the device (four tensor
    ops a micro-batch, ~0.1 ms a pp2 step at batch 256 on the CPU)."""
    pos, rows = plan.future_pos, plan.future_rows
    if pos is None:
        return
    t0 = 0
    for mb in parts:  # fresh pieces: nothing else holds them
        t1 = t0 + mb.num_tokens
        a, b = np.searchsorted(pos, (t0, t1)).tolist()  # pos ascends (`from_table`)
        mb.future_pos, mb.future_rows = pos[a:b] - t0, rows[a:b]
        t0 = t1


class _Done:
    """A hand-off already complete (copied into a shared-memory pipe)."""

    @staticmethod
    def wait() -> None:
        pass


_DONE = _Done()
