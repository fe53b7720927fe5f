"""The engine loop body: validate and queue requests, run one step, turn tokens into outputs.

`EngineCore` is single-threaded; the public `Engine` drives it from the caller's thread
(offline generation) or from a background thread (streaming). A step reads schedule →
execute → sample → process outputs: the scheduler (`scheduler/`), the layout bundle's runner
(`engine/layout_bundle.py`), `engine/sampling_step.py`, `engine/output_processor.py`.

What runs the plans is one `LayoutBundle` (runner, KV pool and manager, HiCache binding,
graphs, transfer channel), built by its factory and replaced whole by a phase flip: the engine
is the flip's `LayoutHost` (`flip/host.py`) and, with flips on, feeds its observer.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from phaseflip.config import EngineConfig
from phaseflip.distributed.group import check_layouts
from phaseflip.engine.context_limit import context_limit
from phaseflip.engine.layout_bundle import LayoutBundle, build_layout_bundle
from phaseflip.engine.output_processor import Group, OutputProcessor
from phaseflip.engine.outputs import StreamDelta
from phaseflip.engine.sampling_step import InFlight, SamplingStep, overlappable
from phaseflip.engine.validation import kv_tokens_needed, validate_request
from phaseflip.errors import InvalidRequestError
from phaseflip.flip.census import SeamCensus, layout_name
from phaseflip.flip.seam import check_target, run_seam
from phaseflip.flip.telemetry import FlipTelemetry
from phaseflip.heap import freeze_heap, release_freed_heap, thaw_heap
from phaseflip.model.config import ModelConfig
from phaseflip.model.loader import with_tokenizer_eos
from phaseflip.model.runner import Runner
from phaseflip.sampling.grammar import GrammarBook
from phaseflip.sampling.params import SamplingParams
from phaseflip.sampling.sampler import Sampler
from phaseflip.scheduler.kv_cache import KVCacheManager, PoolAccounting
from phaseflip.scheduler.request import Req
from phaseflip.scheduler.scheduler import ScheduledBatch, Scheduler

log = logging.getLogger(__name__)
GRAMMAR_WAIT_S = 0.05  # an idle step's wait for a compiling grammar (new messages wait as long)


class EngineCore:
    def __init__(self, cfg: EngineConfig, model_cfg: ModelConfig, tokenizer) -> None:
        # the tokenizer's end token stops generation too (vLLM's and SGLang's rule)
        model_cfg = replace(model_cfg, eos_token_ids=with_tokenizer_eos(
            model_cfg.eos_token_ids, tokenizer))
        self.model_cfg, self.tokenizer = model_cfg, tokenizer
        self.max_context = context_limit(cfg, model_cfg)  # before any rank starts
        self.dead: str | None = None  # set when a failed phase flip left no usable layout
        # told a seam's target as it starts and None as it ends, however it ended (the engine
        # process announces seams to the front end with it; manual and automatic alike)
        self.seam_listener: Callable[[str | None], None] | None = None
        # told (request id, error) when an accepted request ends by an error: its grammar,
        # compiled off the loop, failed (the engine process answers the client's 400 with it)
        self.request_failed: Callable[[str, InvalidRequestError], None] | None = None
        check_layouts(cfg, model_cfg)  # before any rank starts (pp 99 would start 98 of them)
        auto = cfg.flip_weights == "auto"
        cfg = self._plan_flip_weights(cfg)  # `--flip-weights auto` resolved, once
        self._hicache = self._new_hicache(cfg)  # before the ranks: they map its host tier
        # the checkpoint in shared memory (flips' weights), the engine's until its end
        self.weight_image = self._new_weight_image(cfg, fallback=auto)
        if self.weight_image is None and cfg.flip_weights == "host-image":
            cfg = replace(cfg, flip_weights="reload")  # auto's fallback: no image was built
        self.scheduler = Scheduler(cfg, None, self.max_context)
        self._bundle: LayoutBundle | None = None
        self._ranks = None  # the rank processes (several ranks): they outlive every layout
        try:
            self._ranks = self._new_ranks(cfg)
            self.install_layout(cfg)
        except BaseException:
            if self._ranks is not None:
                self._ranks.close(graceful=False)
            if self._hicache is not None:
                self._hicache.close()  # no engine will: free the (maybe shared) host tier now
            raise
        self.sampling = SamplingStep(Sampler(cfg.seed), GrammarBook(
            tokenizer, model_cfg.vocab_size, budget_s=cfg.grammar_compile_timeout_s))
        self.outputs = OutputProcessor(tokenizer, self.max_context, self.scheduler.remove,
                                       cfg.stream_interval)
        self._arrivals = 0
        self._inflight: InFlight | None = None
        # launched run-ahead steps not sampled yet, oldest first (more than one only with PP
        # decode groups in flight: `_decode_depth`)
        self._launched: deque[tuple[ScheduledBatch, object]] = deque()
        self._step_groups = 1  # the last step's decode groups taking turns (the flip policy's)
        # the flip's observer (policy feeds, ledger): None unless flips are on (law 11)
        self.flip_telemetry = (FlipTelemetry.create(cfg, model_cfg, self._hicache)
                               if cfg.enable_flip else None)
        if self.runner.device.type == "cuda":  # (CPU steps dwarf a pass; tests build hundreds)
            freeze_heap()  # the collector's full passes off the step loop

    # ------------------------------------------------------------------ the layout
    @property
    def layout(self) -> LayoutBundle:
        """The running layout bundle (read-only: a flip replaces it whole)."""
        if self._bundle is None:
            raise RuntimeError(self.dead or "the engine has no layout (closed)")
        return self._bundle

    @property
    def runner(self) -> Runner:
        return self.layout.runner

    @property
    def kv(self) -> KVCacheManager:
        return self.layout.kv

    @property
    def hicache(self):
        """The HiCache controller (None without a host tier): it outlives every layout."""
        return self._hicache

    @property
    def flip_policy(self):
        return None if self.flip_telemetry is None else self.flip_telemetry.policy

    @property
    def flip_ledger(self):
        return None if self.flip_telemetry is None else self.flip_telemetry.ledger

    def _new_hicache(self, cfg: EngineConfig):
        """The HiCache controller, made once per engine: its host tier outlives every layout
        (each bundle binds it), and it frees that tier at the engine's end."""
        if not cfg.enable_hicache:
            return None
        from phaseflip.scheduler.hicache import HiCache
        from phaseflip.scheduler.hicache_state import kv_dtype

        hicache = HiCache(cfg, self.model_cfg, kv_dtype(cfg, self.model_cfg),
                          shared=cfg.world_size > 1)
        weakref.finalize(self, hicache.close)  # its disk thread finishes its queue
        return hicache

    def _plan_flip_weights(self, cfg: EngineConfig) -> EngineConfig:
        """The weights strategy of this engine's flips, chosen at launch (`flip/weights.py`):
        every rank runs the same one, so it travels in their configs."""
        self.weights_plan = None
        if not cfg.enable_flip or cfg.world_size < 2:
            return cfg
        from phaseflip.distributed.group import dist_backend, runnable_layouts
        from phaseflip.flip.weights import plan_weights, rank_budget
        from phaseflip.model.runner import resolve_device, resolve_dtype

        device = resolve_device(cfg.device)
        dtype = resolve_dtype(cfg.dtype, self.model_cfg, device)
        plan = plan_weights(cfg, self.model_cfg, runnable_layouts(cfg, self.model_cfg), dtype,
                            rank_budget(cfg, device), dist_backend(cfg))
        log.info(plan.line())
        self.weights_plan = plan
        return replace(cfg, flip_weights=plan.strategy)

    def _new_weight_image(self, cfg: EngineConfig, fallback: bool = False):
        from phaseflip.model.weight_image import image_for_engine

        image = image_for_engine(cfg, fallback)  # None: flips reload (model/weight_image.py)
        if image is not None:
            weakref.finalize(self, image.close)
        return image

    def _new_ranks(self, cfg: EngineConfig):
        """The node's rank processes with every layout's communicators (None: one process).
        A phase flip re-lays them out; they end with the engine."""
        if cfg.world_size == 1:
            return None
        from phaseflip.distributed.rank_set import RankSet

        hicache = self._hicache
        ranks = RankSet(cfg, hicache.host.frames if hicache else None, self.weight_image)
        if cfg.enable_flip:
            try:
                ranks.warm_up(cfg)  # the flip layouts' kernels compile now, not on a seam
            except BaseException:
                ranks.close(graceful=False)
                raise
        return ranks

    # ------------------------------------------------------------------ LayoutHost (flip)
    def install_layout(self, cfg: EngineConfig):
        """Builds the bundle for `cfg` and makes it the running one (at start, and at a
        flip's relayout once the old one is retired); returns its runner (rank 0's view:
        `weights_load`, `build_s`)."""
        if self._bundle is not None:
            raise RuntimeError("install_layout: retire the running layout first")
        bundle = build_layout_bundle(cfg, self.model_cfg, self.max_context, self._hicache,
                                     self.weight_image, self.scheduler.decode_reserve,
                                     self._ranks)
        self._bundle, self.cfg = bundle, cfg
        self.scheduler.bind(bundle.kv, bundle.hicache)
        return bundle.runner

    def retire_layout(self) -> int | None:
        """Ends the running bundle (HiCache unbound, ranks stopped, memory freed); returns
        the device bytes still allocated beyond the weights kept on purpose (resident shards;
        None off CUDA): what may have leaked."""
        bundle, self._bundle = self.layout, None
        self.scheduler.bind(None, None)
        held = bundle.retire()
        if held is not None and self._ranks is not None:
            held -= self._ranks.kept_bytes()
        return held

    def layout_stopped(self) -> bool:
        return self.runner.closed

    def mark_dead(self, reason: str) -> None:
        self.dead = reason

    def retract_all(self) -> int:
        return self.scheduler.retract_all()

    def drop_device_tree(self) -> int:
        return self.kv.tree.evict_all_and_reset()

    def check_pool(self) -> PoolAccounting:
        return self.kv.check(self.scheduler.running)

    # ------------------------------------------------------------------ phase flip
    def _auto_flip(self, sink: Callable[[list[StreamDelta]], None] | None
                   ) -> list[StreamDelta]:
        """Asks the policy (--flip-policy auto) and flips when it says so; returns the
        outputs the flip made that `sink` did not take. An abandoned flip (its fence did not
        complete, nothing changed) is logged and the engine steps on in its layout."""
        sched = self.scheduler
        decision = self.flip_policy.decide(sched.waiting, sched.running, self.kv.tree)
        if not decision.flip:
            return []
        log.info("flip policy: %s → flipping to tp%d×pp%d", decision.reason, *decision.target)
        try:
            return self.flip(*decision.target, sink)[1]
        except InvalidRequestError as e:
            if self.dead:  # refused after the seam began: no layout is left
                raise
            log.warning("flip policy: automatic flip abandoned: %s", e)
            self.flip_policy.observe_abandoned(str(e))
            return []

    def flip(self, tp_size: int, pp_size: int,
             sink: Callable[[list[StreamDelta]], None] | None = None
             ) -> tuple[SeamCensus, list[StreamDelta]]:
        """Re-lays the engine out as tp_size × pp_size ranks between two steps (the seam of
        `phaseflip.flip.seam`). A refused target changes nothing. The outputs still owed
        (text of the last step, an overlapped step's tokens) are made first and go to `sink`
        before the seam starts, so a seam that fails cannot lose them; without a sink they are
        returned with the seam census."""
        if self.dead:
            raise RuntimeError(self.dead)
        listener = self.seam_listener
        if listener is not None:
            listener(layout_name(tp_size, pp_size))
        try:
            return self._flip(tp_size, pp_size, sink)
        finally:
            if listener is not None:  # however the seam ended (a refused target included)
                listener(None)

    def _flip(self, tp_size: int, pp_size: int,
              sink: Callable[[list[StreamDelta]], None] | None
              ) -> tuple[SeamCensus, list[StreamDelta]]:
        check_target(self.cfg, self.model_cfg, tp_size, pp_size)
        deltas = self._drain() + self.outputs.emit_text()
        if sink is not None and deltas:
            sink(deltas)
            deltas = []
        source, observer = (self.cfg.tp_size, self.cfg.pp_size), self.flip_telemetry
        observer.before_seam(self.scheduler.running)
        census = run_seam(self, tp_size, pp_size)
        release_freed_heap()  # glibc keeps the retired layout's pages (+1.3 MiB a flip)
        observer.on_seam(source, (tp_size, pp_size), census)
        unfit = self._end_unfit()
        observer.on_cutover(census, self._hicache)  # the refill window opens
        if sink is not None and unfit:
            sink(unfit)
        else:
            deltas += unfit
        return census, deltas

    def _end_unfit(self) -> list[StreamDelta]:
        """Ends (finish "abort", logged) the waiting requests the pool can no longer hold
        whole: after a flip the new layout's pool may be smaller, and a request it can never
        hold would stay at the head of the queue for ever, blocking everything behind it."""
        cap, ps = self.kv.capacity_tokens, self.cfg.page_size
        out = []
        for req in list(self.scheduler.waiting):
            need = kv_tokens_needed(len(req.prompt_ids), req.params.max_new_tokens, ps)
            if need <= cap:
                continue
            log.warning("request %s needs %d KV tokens but the pool now holds %d: ended",
                        req.rid, need, cap)
            out.append(self.outputs.end(req, "abort"))
        return out

    # ------------------------------------------------------------------ requests
    def validate(self, prompt_ids: list[int], params: SamplingParams,
                 build_grammar: bool = True) -> None:
        """Raises InvalidRequestError/ContextLengthError for anything the loop cannot run
        (`build_grammar=False`: a grammar is built and compiled later, off the loop)."""
        validate_request(
            prompt_ids, params, vocab_size=self.model_cfg.vocab_size,
            max_context=self.max_context, max_logprobs=self.cfg.max_logprobs,
            kv_capacity_tokens=self.kv.capacity_tokens, page_size=self.cfg.page_size,
            build_grammar=build_grammar)

    def add_request(self, rid: str, prompt_ids: list[int], params: SamplingParams) -> None:
        if self.dead:
            raise RuntimeError(self.dead)
        if rid in self.outputs.groups:
            raise InvalidRequestError(f"request id {rid!r} is already in use", "request_id")
        self.validate(prompt_ids, params, build_grammar=False)
        reqs: list[Req] = []
        for i in range(params.n):
            p = params
            if i > 0:  # only the leader computes prompt logprobs; samples get distinct seeds
                seed = None if params.seed is None else params.seed + i
                p = replace(params, prompt_logprobs=None, seed=seed)
            req = Req(
                rid=f"{rid}#{i}", prompt_ids=list(prompt_ids), params=p,
                eos_ids=self.model_cfg.eos_token_ids, arrival=self._arrivals, index=i,
                leader=reqs[0] if reqs else None,
            )
            req.overlappable = overlappable(p)
            self.sampling.grammars.register(req)  # a new grammar compiles off the loop
            self._arrivals += 1
            reqs.append(req)
        self.outputs.add(rid, prompt_ids, reqs)
        for req in reqs:
            self.scheduler.add(req)

    @property
    def groups(self) -> dict[str, Group]:
        """The requests in the engine, by id (the output processor's)."""
        return self.outputs.groups

    def abort(self, rid: str) -> list[StreamDelta]:
        deltas = self.outputs.abort(rid)
        step = self._inflight
        if step is not None and all(it.req.finished for it in step.items):
            self._inflight = None  # a run-ahead step that no request is owed anything of
        return deltas

    def has_work(self) -> bool:
        return (self.scheduler.has_work() or bool(self.outputs.text_pending)
                or self._inflight is not None or bool(self._launched)
                or self._idle_flip_due())

    def _idle_flip_due(self) -> bool:
        """Under --flip-policy auto, an engine idle in the prefill layout has one step to run
        once idle a dwell: the policy, asked only at a step, flips it back to the decode
        layout (else it sat in PP until a request waited out a flip back)."""
        policy = self.flip_policy
        return policy is not None and policy.idle_flip_due()

    def check_alive(self) -> None:
        """Raises if a worker rank of a multi-rank layout has died (checked when idle)."""
        self.runner.check_alive()

    def rank_positions(self) -> list[str]:
        """Every rank's last position, each live local worker dumping its stacks to its log
        (a stall report; safe from another thread). Empty for one process."""
        return [] if self._ranks is None else self._ranks.report_ranks()

    def node_files(self) -> list[Path]:
        """The node's shared-memory files this engine made (the weight image, HiCache's host
        tier): what a dying engine unlinks so none outlives it."""
        files = [self.weight_image.path] if self.weight_image is not None else []
        if self._hicache is not None and self._hicache.host.frames.path is not None:
            files.append(self._hicache.host.frames.path)
        return files

    def close(self) -> None:
        """The engine's end, giving back everything it took: the layout bundle (ranks stopped,
        graphs, weights and KV pool freed, cached device blocks released), then the HiCache
        controller (its host tier) and the host weight image. Idempotent."""
        thaw_heap()  # what the engine leaves in reference cycles is collectable again
        bundle, self._bundle = self._bundle, None  # None already after a failed flip
        self.scheduler.bind(None, None)
        self._inflight = None
        self._launched.clear()
        if bundle is not None:
            bundle.close()
        if self._ranks is not None:
            self._ranks.close()
        if self._hicache is not None:
            self._hicache.close()
        if self.weight_image is not None:
            self.weight_image.close()
        self.sampling.grammars.close()  # a compile in flight is left to end on its own

    # ------------------------------------------------------------------ step
    def step(self, sink: Callable[[list[StreamDelta]], None] | None = None
             ) -> list[StreamDelta]:
        """One forward step. While the GPU runs it, the host turns the previous step's tokens
        into text (detokenisation and deltas, the bulk of the per-token host work at large
        batch); finishing never waits for text except on stop strings, checked at once.

        Those previous-step deltas go to `sink` as soon as they are made, before this step's
        sampling waits for the GPU (a streaming loop passes one, so clients are not a whole
        step late); without a sink they are returned with this step's own.

        With `overlap_schedule`, steps whose requests allow it run ahead of their tokens
        (`_step_ahead`). With flips on, the flip observer is told each step's items, prompt
        tokens, decode rows and wall time; under --flip-policy auto its policy is asked first
        whether to flip (the flip's owed outputs go to `sink`, or come back with this
        step's)."""
        if self.dead:
            raise RuntimeError(self.dead)
        failed = self._take_grammars()
        observer = self.flip_telemetry
        if observer is None:
            return failed + self._step(sink)
        owed = self._auto_flip(sink) if observer.policy.auto else []
        stats, t0 = self.scheduler.stats, time.perf_counter()
        prompt0, decode0 = stats.prefill_tokens, stats.decode_tokens
        self._step_groups = 1
        deltas = self._step(sink)
        observer.on_step(self.layout.layout, stats.prefill_tokens - prompt0,
                         stats.decode_tokens - decode0, time.perf_counter() - t0,
                         self._step_groups)
        return failed + owed + deltas

    def _take_grammars(self) -> list[StreamDelta]:
        """Requests whose grammar compiled (off the loop) become admissible; one whose grammar
        failed ends ("abort"), its error told to `request_failed` first. With nothing else to
        run, waits a little for a compile rather than spin."""
        sched, book = self.scheduler, self.sampling.grammars
        idle = book.compiling and not (sched.running or self._inflight or self._launched
                                       or self.outputs.text_pending) and all(
            r.compiling for r in sched.waiting)
        out: list[StreamDelta] = []
        for req, error in book.poll(GRAMMAR_WAIT_S if idle else 0.0):
            if req.finished:
                continue  # (its group ended with an earlier sample's error)
            rid = self.outputs.group(req).rid
            if self.request_failed is not None:
                self.request_failed(rid, error)
            out += self.outputs.abort(rid)
        return out

    def _step(self, sink: Callable[[list[StreamDelta]], None] | None) -> list[StreamDelta]:
        if self._can_step_ahead():
            return self._step_ahead(sink)
        drained = self._drain()
        if drained:
            if sink is None:
                return drained + self._step_sync(None)
            sink(drained)
        return self._step_sync(sink)

    def _step_sync(self, sink: Callable[[list[StreamDelta]], None] | None
                   ) -> list[StreamDelta]:
        """schedule → execute → sample → process outputs. While the forward runs, the previous
        step's text is made (and goes to `sink` at once)."""
        batch = self.scheduler.schedule()
        if batch is None:
            if self.cfg.check_accounting and not self.outputs.text_pending:
                self.kv.check(self.scheduler.running)
            return self.outputs.emit_text()
        try:
            logits = self._forward(batch)  # queued on the GPU; runs meanwhile
        finally:  # made even if the forward fails: finished requests keep their last delta
            deltas = self._owed_text(sink)
        self.sampling.prompt_logprobs(batch, logits)
        sampled = self.sampling.sample(batch, logits)
        self.scheduler.advance(batch)
        if self.flip_telemetry is not None:
            self.flip_telemetry.on_items(batch.items)
        return deltas + self.outputs.process(batch.items, sampled)

    def _owed_text(self, sink: Callable[[list[StreamDelta]], None] | None) -> list[StreamDelta]:
        """The text of tokens sampled earlier: handed to `sink` now, else returned."""
        deltas = self.outputs.emit_text()
        if sink is not None and deltas:
            sink(deltas)
            return []
        return deltas

    # ------------------------------------------------------------------ overlapped steps
    def _can_step_ahead(self) -> bool:
        # every layout runs ahead (a TP/PP runner shares the placeholders' tokens among its
        # ranks), HiCache too: its copies are ordered by the messages, not by the host's sync
        if not self.cfg.overlap_schedule:
            return False
        sched = self.scheduler
        return (all(r.overlappable for r in sched.running)
                and all(r.overlappable for r in sched.waiting))

    def _step_ahead(self, sink: Callable[[list[StreamDelta]], None] | None
                    ) -> list[StreamDelta]:
        """Schedules and launches this step before the previous step's tokens are on the host
        (they reach the GPU as placeholders naming rows of its device tensor), then turns the
        previous step into outputs while the GPU runs this one. A request finished by one of
        those tokens (EOS, a stop id) was already given a row here: the row is wasted, its
        result ignored. Length finishes are known ahead and never scheduled.

        The launched step is sampled in this step, or, with PP decode groups in flight
        (`_decode_depth` D > 1), once D steps are launched: the oldest is sampled, and its
        requests form the next step's group while the later stages run the other groups."""
        prev, self._inflight = self._inflight, None
        depth = self._decode_depth()
        schedule = self.scheduler.schedule
        batch = schedule(depth) if depth > 1 else schedule()
        if batch is None and self._launched:  # every decoding request is in flight
            if prev is not None:
                self.outputs.take_tokens(prev)  # placeholders name one step's tokens
            prev = self._sample_oldest()
            batch = schedule(depth)
        logits = None
        try:
            if batch is not None:
                logits = self._launch(batch, prev.tokens if prev else None)
                self.scheduler.advance(batch)
                if self.flip_telemetry is not None:
                    self.flip_telemetry.on_items(batch.items)
        finally:
            if prev is not None:
                self.outputs.take_tokens(prev)
            deltas = self._owed_text(sink)
        if batch is None:
            if self.cfg.check_accounting and prev is None and not self._launched:
                self.kv.check(self.scheduler.running)
            return deltas
        self._launched.append((batch, logits))
        self._step_groups = len(self._launched)  # decode groups taking turns (1: no groups)
        for it in batch.items:
            if it.samples:
                it.req.launched = True
            elif it.req.prompt_only_done:
                deltas.append(self.outputs.end(it.req, "length"))
        if len(self._launched) >= depth:
            self._inflight = self._sample_oldest()
        return deltas

    def _sample_oldest(self) -> InFlight | None:
        """Samples the oldest launched step on the device (its logits awaited here)."""
        batch, logits = self._launched.popleft()
        for it in batch.items:
            it.req.launched = False
        return self.sampling.sample_ahead(batch, logits)

    def _decode_depth(self) -> int:
        """Launched steps kept in flight: the runner's PP decode depth (1: each step is
        sampled in the step that launched it)."""
        return 1 if self._ranks is None else self.runner.decode_depth

    def _launch(self, batch: ScheduledBatch, future):
        """A run-ahead step's forward. A TP/PP runner hands back a wait for logits that come
        from another rank (PP): the previous step's outputs are made while the later stages
        run, and `sample_ahead` waits (`DistributedRunner.launch`)."""
        if self._ranks is not None:
            return self.runner.launch(batch.plan, future, self._last_stage_spec(batch, True))
        return self.runner.forward(batch.plan, future)

    def _forward(self, batch: ScheduledBatch):
        """A synchronous step's forward: logits, or the ids the last PP stage sampled."""
        if self._ranks is not None:
            return self.runner.forward(batch.plan, sample=self._last_stage_spec(batch, False))
        return self.runner.forward(batch.plan)

    def _last_stage_spec(self, batch: ScheduledBatch, ahead: bool):
        """What the last PP stage samples in the driver's stead (None: logits to the driver)."""
        if not getattr(self.runner, "last_stage_samples", False):
            return None
        return self.sampling.last_stage_spec(batch, ahead)

    def _drain(self) -> list[StreamDelta]:
        """Takes the in-flight steps' tokens, every launched one sampled first (before a
        synchronous step or a flip: a seam starts with no decode group in flight)."""
        if self._inflight is None and not self._launched:
            return []
        while True:
            step, self._inflight = self._inflight, None
            if step is not None:
                self.outputs.take_tokens(step)
            if not self._launched:
                return self.outputs.emit_text()
            self._inflight = self._sample_oldest()
