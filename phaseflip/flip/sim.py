"""A simulator of the phase flip (issue 17): a trace replayed through the real scheduler and the
real flip policy, with modelled step times, so the economics of a flip can be mapped where no
GPU is at hand.

What is real: `Scheduler` (admission, chunked prefill, retraction, the radix prefix tree over a
`KVCacheManager` of `kv_slots` slots, no model), `FlipPolicy` (estimates, break-even, dwell,
residency pricing, the idle flip back), both driven on a simulated clock. What is modelled:
- the wall time of a step in a layout, a `StepModel` of the step's prompt tokens, decode rows
  and the decode rows' context tokens: `LinearStepModel` fitted from measured steps (the CPU
  validation), or `AnalyticStepModel` (compute, HBM, collectives over a `Link`, pipeline
  parts) calibrated on measured one-batch latencies (`calibrate_gpu`);
- the seam: `seam_s(source, target)` seconds, then the refill of the retracted requests'
  KV from the host tier (`refill_s_per_token`; the sim keeps the device tree across the seam,
  which is what the host tier's read-through gives back, and charges the load time).
The policy sees what it sees in the engine: `observe_step` per step, `observe_flip` with the
seam, `observe_refill` with the refill (as a census), `idle_flip_due` when idle.

`simulate(trace, cfg, models, ...)` runs one of: a static layout (`cfg` without flips), the
auto policy (`cfg.flip_policy == "auto"`), or a `Schedule` (flips at given times; the oracle
in `flip_map.py` searches those).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Protocol

import numpy as np

from phaseflip.config import EngineConfig
from phaseflip.flip.policy import FlipPolicy, ResidencyPricer, layout_name
from phaseflip.flip.workload import Arrival
from phaseflip.sampling.params import SamplingParams
from phaseflip.scheduler.kv_cache import KVCacheManager
from phaseflip.scheduler.request import Req
from phaseflip.scheduler.scheduler import Scheduler

Layout = tuple[int, int]
SAMPLED_TOKEN = 7  # every simulated step samples this id (no model runs)


class StepModel(Protocol):
    def seconds(self, prompt_tokens: int, decode_rows: int, ctx_tokens: int) -> float: ...


# ---------------------------------------------------------------------- fitted step models
@dataclass(frozen=True)
class LinearStepModel:
    """fixed + per prompt token + per decode row + per context token of the decode rows."""

    fixed_s: float
    prompt_token_s: float
    decode_row_s: float
    ctx_token_s: float = 0.0

    def seconds(self, prompt_tokens: int, decode_rows: int, ctx_tokens: int) -> float:
        return (self.fixed_s + self.prompt_token_s * prompt_tokens
                + self.decode_row_s * decode_rows + self.ctx_token_s * ctx_tokens)

    @classmethod
    def fit(cls, samples: Sequence[Sequence[float]]) -> LinearStepModel:
        """Least squares over (prompt_tokens, decode_rows, ctx_tokens, seconds) samples,
        coefficients kept non-negative (a negative one is dropped and the rest refitted)."""
        a = np.array([[1.0, s[0], s[1], s[2]] for s in samples])
        y = np.array([s[3] for s in samples])
        keep = [j for j in range(4) if a[:, j].any()]
        while True:
            coef, *_ = np.linalg.lstsq(a[:, keep], y, rcond=None)
            if (coef >= 0).all() or len(keep) == 1:
                break
            keep.pop(int(np.argmin(coef)))
        full = [0.0] * 4
        for j, c in zip(keep, coef):
            full[j] = max(0.0, float(c))
        return cls(*full)


def samples_from_json(result: dict[str, Any]) -> dict[str, list[tuple[int, int, int, float]]]:
    """Step samples per layout name from a result JSON: `calibration` step records
    (bench_flip_workload: prompt_tokens, decode_rows, ctx_tokens, seconds), or bench_latency
    `results` (a prefill of batch x input_len tokens; a decode step of batch rows at
    input_len context), under the layout the run used."""
    if "calibration" in result:
        return {name: [(s["prompt_tokens"], s["decode_rows"], s["ctx_tokens"], s["seconds"])
                       for s in steps] for name, steps in result["calibration"].items()}
    name = layout_name((result.get("tp_size", 1), result.get("pp_size", 1)))
    n = result["input_len"]
    out = []
    for r in result["results"]:
        b = r["batch_size"]
        out.append((b * n, 0, 0, r["prefill_s"]))
        out.append((0, b, b * n, r["decode_step_s"]["mean"]))
    return {name: out}


# ---------------------------------------------------------------------- analytic step models
@dataclass(frozen=True)
class ModelShape:
    name: str
    params: float  # parameters (compute: 2 FLOP per parameter per token)
    hidden: int
    layers: int
    kv_bytes_per_token: int  # K and V of every layer
    weight_bytes: float

    @classmethod
    def llama(cls, name: str, params: float, hidden: int, layers: int, kv_heads: int,
              head_dim: int = 128, dtype_bytes: int = 2) -> ModelShape:
        return cls(name, params, hidden, layers, 2 * layers * kv_heads * head_dim * dtype_bytes,
                   params * dtype_bytes)


LLAMA_8B = ModelShape.llama("8B", 8.03e9, 4096, 32, 8)
LLAMA_70B = ModelShape.llama("70B", 70.6e9, 8192, 80, 8)


@dataclass(frozen=True)
class Link:
    """A GPU interconnect: a collective costs latency + bytes / bandwidth (ring all-reduce:
    2(n-1)/n of the bytes over each link)."""

    name: str
    bandwidth_Bps: float
    latency_s: float

    def all_reduce_s(self, nbytes: float, n: int) -> float:
        return 0.0 if n <= 1 else self.latency_s + 2 * (n - 1) / n * nbytes / self.bandwidth_Bps

    def send_s(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bandwidth_Bps


def link(gbps: float, latency_s: float = 20e-6) -> Link:
    kind = "NVLink-class" if gbps >= 100 else "PCIe-class"
    return Link(f"{kind} {gbps:g} GB/s", gbps * 1e9, latency_s)


@dataclass(frozen=True)
class GpuCalib:
    """One GPU's effective rates and the per-step and per-part host overheads."""

    flops: float  # effective FLOP/s of a prefill
    hbm_Bps: float  # effective bytes/s of a decode's weight and KV reads
    step_s: float  # fixed seconds of any step
    part_s: float  # seconds per pipeline part per stage (launch, hand-off)
    layer_s: float = 0.0  # seconds per layer per TP shard beyond its collectives (launches)


@dataclass(frozen=True)
class AnalyticStepModel:
    """A tp x pp step: each stage runs its layers on m parts of the step (PP: the engine's
    micro-batches, m = clamp(T // 1024, pp, 4pp), decode steps pp parts), a part costing
    max(weights read, compute) + KV reads + its TP all-reduces (2 per layer) + the hand-off;
    the pipeline takes m + pp - 1 part-times."""

    shape: ModelShape
    gpu: GpuCalib
    link: Link
    tp: int
    pp: int
    min_part_tokens: int = 1024

    def parts(self, tokens: int, prompt_tokens: int, decode_rows: int) -> int:
        if self.pp == 1:
            return 1
        if prompt_tokens:
            return min(4 * self.pp, max(self.pp, tokens // self.min_part_tokens))
        return max(1, min(self.pp, decode_rows))

    def seconds(self, prompt_tokens: int, decode_rows: int, ctx_tokens: int) -> float:
        s, g, n = self.shape, self.gpu, self.tp * self.pp
        tokens = prompt_tokens + decode_rows
        if tokens == 0:
            return g.step_s
        m = self.parts(tokens, prompt_tokens, decode_rows)
        weights = s.weight_bytes / n / g.hbm_Bps
        compute = 2 * s.params * tokens / n / m / g.flops
        kv = s.kv_bytes_per_token * ctx_tokens / n / m / g.hbm_Bps
        act = tokens / m * s.hidden * 2  # bf16 hidden states of a part
        comm = (s.layers // self.pp) * (2 * self.link.all_reduce_s(act, self.tp) + (
            g.layer_s if self.tp > 1 else 0.0))
        hand = self.link.send_s(act) if self.pp > 1 else 0.0
        part = max(weights, compute) + kv + comm + hand + (g.part_s if self.pp > 1 else 0.0)
        return g.step_s + (m + self.pp - 1) * part


def calibrate_gpu(results: Sequence[dict[str, Any]], shape: ModelShape, ref: Link
                  ) -> GpuCalib:
    """Fits a `GpuCalib` to measured bench_latency results (tp1, tp2, pp2 ... of `shape` on
    one host whose link is `ref`): the FLOP rate from the fastest one-GPU prefill, the HBM
    rate from the one-GPU decode steps, then step_s, part_s and layer_s by least squares of
    the relative error over every measured step (prefill and decode, each layout)."""
    one = [r for r in results if r.get("tp_size", 1) * r.get("pp_size", 1) == 1][0]
    flops = max(2 * shape.params * x["prefill_tokens_per_s"] for x in one["results"])
    b1 = min(one["results"], key=lambda x: x["batch_size"])
    hbm = shape.weight_bytes / (0.8 * b1["decode_step_s"]["mean"])  # step_s takes ~20 %
    base = GpuCalib(flops, hbm, 0.0, 0.0, 0.0)
    rows, y = [], []
    for res in results:
        tp, pp = res.get("tp_size", 1), res.get("pp_size", 1)
        m = AnalyticStepModel(shape, base, ref, tp, pp)
        for (p, d, c, sec) in samples_from_json(res)[layout_name((tp, pp))]:
            span = m.parts(p + d, p, d) + pp - 1  # part-times of the pipeline
            w = 1.0 / sec  # relative errors: a 5 ms decode step weighs as a 5 s prefill
            rows.append([w, w * span if pp > 1 else 0.0,
                         w * span * shape.layers // pp if tp > 1 else 0.0])
            y.append(w * (sec - m.seconds(p, d, c)))
    coef, *_ = np.linalg.lstsq(np.array(rows), np.array(y), rcond=None)
    step_s, part_s, layer_s = (max(0.0, float(c)) for c in coef)
    return GpuCalib(flops, hbm, step_s, part_s, layer_s)


# ---------------------------------------------------------------------- the replay
@dataclass
class ReqRecord:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    kind: str
    token_s: list[float] = field(default_factory=list)  # sim time of each output token

    @property
    def ttft_s(self) -> float:
        return self.token_s[0] - self.arrival_s

    @property
    def itl_s(self) -> list[float]:
        return [b - a for a, b in zip(self.token_s, self.token_s[1:])]


@dataclass
class SimResult:
    seconds: float  # first arrival to last token
    requests: list[ReqRecord]
    flips: list[dict[str, Any]]
    steps: list[tuple[float, float, str, int, int]]  # (t, seconds, layout, prompt, decode)
    busy_s: dict[str, float]  # step seconds per layout

    @property
    def tokens(self) -> int:
        return sum(r.prompt_tokens + r.output_tokens for r in self.requests)

    @property
    def throughput(self) -> float:
        """Prompt + output tokens per second over the run."""
        return self.tokens / self.seconds if self.seconds > 0 else math.nan

    @property
    def seam_s(self) -> float:
        return sum(f["seam_s"] + f["refill_s"] for f in self.flips)

    @property
    def busy_tps(self) -> float:
        """Prompt + output tokens per busy second (steps, seams and refills): unlike
        `throughput`, it tells layouts apart below saturation too."""
        busy = sum(self.busy_s.values()) + self.seam_s
        return self.tokens / busy if busy > 0 else math.nan

    def summary(self) -> dict[str, Any]:
        ttft = [r.ttft_s for r in self.requests if r.token_s]
        itl = [x for r in self.requests for x in r.itl_s]

        def pct(v: list[float], q: float) -> float | None:
            return float(np.percentile(v, q)) if v else None

        e2e = [r.token_s[-1] - r.arrival_s for r in self.requests if r.token_s]
        return {"seconds": self.seconds, "throughput_tps": self.throughput,
                "e2e_mean_s": float(np.mean(e2e)) if e2e else None,
                "flips": len(self.flips), "seam_s": self.seam_s,
                "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
                "itl_p50_s": pct(itl, 50), "itl_p99_s": pct(itl, 99),
                "busy_s": self.busy_s, "busy_tps": self.busy_tps}


class Schedule(Protocol):
    """An offline flip schedule: the layout wanted at sim time t (given the sim's state)."""

    def target(self, t: float, sim: Simulator) -> Layout | None: ...


class Simulator:
    """One replay (see the module docstring); `run` returns a `SimResult`."""

    def __init__(self, cfg: EngineConfig, models: dict[Layout, StepModel], *,
                 kv_slots: int, seam_s: Callable[[Layout, Layout], float],
                 refill_s_per_token: float = 0.0, schedule: Schedule | None = None,
                 max_context: int = 32768) -> None:
        self.cfg, self.models, self.seam_s = cfg, models, seam_s
        self.refill_s_per_token, self.schedule = refill_s_per_token, schedule
        self.t = 0.0
        self.layout: Layout = (cfg.tp_size, cfg.pp_size)
        self.kv = KVCacheManager(kv_slots, cfg.page_size, cfg.max_running_requests + 1,
                                 max_context + 1, cfg.enable_prefix_cache)
        self.scheduler = Scheduler(cfg, self.kv, max_context)
        self.policy = None
        if cfg.enable_flip:
            pricer = ResidencyPricer(cfg.page_size, _page_keys(cfg.page_size), lambda k: False)
            self.policy = FlipPolicy(cfg, pricer, clock=lambda: self.t)
        self.auto = self.policy is not None and self.policy.auto
        self.records: dict[str, ReqRecord] = {}
        self.flips: list[dict[str, Any]] = []
        self.steps: list[tuple[float, float, str, int, int]] = []
        self.busy: dict[str, float] = {}

    # ------------------------------------------------------------------ driving
    def run(self, trace: Sequence[Arrival]) -> SimResult:
        i, n = 0, len(trace)
        t0 = trace[0].t_s if trace else 0.0
        while i < n or self.scheduler.has_work():
            while i < n and trace[i].t_s <= self.t:
                self._add(f"r{i}", trace[i])
                i += 1
            if not self.scheduler.has_work():
                self._idle(trace[i].t_s if i < n else math.inf)
                continue
            self._maybe_flip()
            self._step()
        end = max((r.token_s[-1] for r in self.records.values() if r.token_s), default=t0)
        return SimResult(end - t0, list(self.records.values()), self.flips, self.steps,
                         self.busy)

    def _add(self, rid: str, a: Arrival) -> None:
        params = SamplingParams(max_new_tokens=a.max_new_tokens, ignore_eos=True)
        req = Req(rid=rid, prompt_ids=list(a.prompt_ids), params=params, eos_ids=(0,),
                  arrival=len(self.records))
        self.scheduler.add(req)
        self.records[rid] = ReqRecord(a.t_s, len(a.prompt_ids), a.max_new_tokens, a.kind)

    def _idle(self, next_arrival: float) -> None:
        """Nothing to run: the idle flip back when due before the next arrival, else wait."""
        pol = self.policy
        if self.auto and pol.layout == pol.prefill:
            due = max(pol.since_s, pol.busy_s) + pol.min_dwell_s
            if due < next_arrival:
                self.t = max(self.t, due)
                if pol.idle_flip_due():  # what the engine loop asks when idle
                    self._maybe_flip()
                    return
        if self.schedule is not None:
            target = self.schedule.target(self.t, self)
            if target is not None and target != self.layout:
                self._flip(target)
                return
        self.t = next_arrival

    def _maybe_flip(self) -> None:
        sched = self.scheduler
        if self.auto:
            d = self.policy.decide(sched.waiting, sched.running, self.kv.tree)
            target = d.target
        elif self.schedule is not None:
            target = self.schedule.target(self.t, self)
        else:
            return
        if target is not None and target != self.layout:
            self._flip(target)

    def _flip(self, target: Layout) -> None:
        """The seam: retract every running request (their KV stays readable: the tree is
        kept, as the host tier's read-through would give it back), the seam's seconds, then
        the refill's load seconds; the policy is told both."""
        source, retracted = self.layout, sum(r.kv_len for r in self.scheduler.running)
        self.scheduler.retract_all()
        seam, refill = self.seam_s(source, target), retracted * self.refill_s_per_token
        self.flips.append({"at_s": self.t, "source": layout_name(source),
                           "target": layout_name(target), "seam_s": seam, "refill_s": refill,
                           "retracted_tokens": retracted})
        self.t += seam + refill
        self.layout = target
        if self.policy is not None:
            self.policy.observe_flip(source, target, seam)
            self.policy.observe_refill(SimpleNamespace(
                source=layout_name(source), target=layout_name(target),
                refill_tokens_prefilled=0, refill_bytes=int(refill * 1e9),
                refill_rate_gbps=1.0, refill_s=refill))

    def _step(self) -> None:
        sched, stats = self.scheduler, self.scheduler.stats
        p0, d0 = stats.prefill_tokens, stats.decode_tokens
        batch = sched.schedule()
        if batch is None:
            raise RuntimeError("work but nothing schedulable: the KV pool is too small")
        prompt, decode = stats.prefill_tokens - p0, stats.decode_tokens - d0
        ctx = sum(it.start for it in batch.items if it.extend_len == 1)
        dt = self.models[self.layout].seconds(prompt, decode, ctx)
        self.t += dt
        name = layout_name(self.layout)
        self.busy[name] = self.busy.get(name, 0.0) + dt
        self.steps.append((self.t, dt, name, prompt, decode))
        sched.advance(batch)
        for it in batch.items:
            if not it.samples:
                continue
            req = it.req
            req.output_ids.append(SAMPLED_TOKEN)
            self.records[req.rid].token_s.append(self.t)
            if len(req.output_ids) >= req.params.max_new_tokens:
                req.finish_reason = "length"
                sched.remove(req)
        if self.policy is not None:
            self.policy.observe_step(self.layout, prompt, decode, dt)


def _page_keys(page_size: int) -> Callable[[list[int]], list[bytes]]:
    from phaseflip.cache.hicache import page_keys

    return lambda ids: page_keys(ids, page_size, b"sim")


def simulate(trace: Sequence[Arrival], cfg: EngineConfig, models: dict[Layout, StepModel],
             **kw: Any) -> SimResult:
    """One replay of `trace` (see `Simulator`); the request table is sized to its longest
    request (a row per running request of max_context slots: 1M of them took 2 GiB)."""
    kw.setdefault("max_context", max((len(a.prompt_ids) + a.max_new_tokens for a in trace),
                                     default=1) + 1)
    return Simulator(cfg, models, **kw).run(trace)
