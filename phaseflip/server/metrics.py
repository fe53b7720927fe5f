"""Prometheus metrics of one server (its own registry: no process-global state).

Every series carries a `model_name` label (the served model name), as vLLM's and SGLang's do,
so one dashboard can show several servers; docs/metrics.md maps the names to vLLM's.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import itertools
import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.metrics import MetricWrapperBase

from phaseflip.heap import freeze_heap, thaw_heap

# Seconds. Below 5 ms for the inter-token latency of small models on fast GPUs; up to 40 min
# for the end-to-end latency of long outputs (120 s left every long request in +Inf).
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30,
                    60, 120, 300, 600, 1200, 2400)
_NS = "phaseflip"
# the engine's HiCache page counters and their `event` label (docs/metrics.md)
_HICACHE_PAGE_EVENTS = {
    "pages_written": "written", "miss_pages": "miss", "corrupt_pages": "corrupt",
    "host_evictions": "host_eviction", "disk_evictions": "disk_eviction",
    "disk_writes_dropped": "disk_writes_dropped", "sync_writebacks": "sync_writeback",
    "disk_write_failures": "disk_write_failure", "disk_read_errors": "disk_read_error",
    "foreign_pages": "foreign",
}
# the engine's HiCache totals, exported as counters (`_total`): name, help, label
_HICACHE_TOTALS = (
    ("hicache_hit_tokens", "Prompt tokens read from a HiCache tier", "tier"),
    ("hicache_bytes", "Bytes moved by HiCache: stored device -> host, loaded host -> device, "
     "written to disk", "direction"),
    ("hicache_pages", "HiCache page events", "event"),
)


class Labelled:
    """A labelled family with `model_name` bound: `labels("stop")` is the series
    `{model_name=..., finish_reason="stop"}`."""

    def __init__(self, family: MetricWrapperBase, model_name: str) -> None:
        self.family, self.model_name = family, model_name

    def labels(self, *values: str):
        return self.family.labels(self.model_name, *values)

    def clear(self) -> None:
        self.family.clear()


class EngineCounters:
    """Totals the engine keeps itself, exported as counters at each scrape. Each series follows
    the deltas of the engine's total, so it never goes down: a total below the last one seen
    is an engine that counts from 0 again, and all of it is new. A family is exported once
    declared (HELP and TYPE only); a series appears once the engine reported it: an engine
    that never said is unmeasured, not 0."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.families: dict[str, tuple[str, str | None]] = {}  # name -> (help, label)
        self.totals: dict[str, dict[str, float]] = {}  # name -> label value -> exported
        self._seen: dict[tuple[str, str], float] = {}  # (name, label value) -> engine's total

    def declare(self, name: str, doc: str, label: str | None = None) -> None:
        self.families.setdefault(name, (doc, label))
        self.totals.setdefault(name, {})

    def observe(self, name: str, value: float, label_value: str = "") -> None:
        """The engine's total for the series `name{label=label_value}` (declared first)."""
        value, key = float(value), (name, label_value)
        last = self._seen.get(key, 0.0)
        series = self.totals[name]
        series[label_value] = series.get(label_value, 0.0) + (
            value - last if value >= last else value)
        self._seen[key] = value

    def collect(self) -> Iterator[CounterMetricFamily]:
        for name, (doc, label) in self.families.items():
            labels = ["model_name"] if label is None else ["model_name", label]
            family = CounterMetricFamily(f"{_NS}_{name}", doc, labels=labels)
            for value, total in self.totals[name].items():
                family.add_metric([self.model_name] + ([value] if label else []), total)
            yield family


class CollectorPauses:
    """The front end process's cyclic-collector passes, by generation, exported as a
    histogram at each scrape. Kept in plain lists by a `gc.callbacks` hook, which must take
    no lock: a pass can start while this thread holds one of prometheus_client's (they are
    not reentrant; its scrape copies a family's children under its lock), and a hook that
    took the same lock would deadlock the event loop. Collector passes never overlap, so
    the hook's updates need none."""

    GENERATIONS = (0, 1, 2)

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.counts = {g: [0] * (len(_LATENCY_BUCKETS) + 1) for g in self.GENERATIONS}
        self.sums = dict.fromkeys(self.GENERATIONS, 0.0)
        self._started = time.perf_counter()

    def hook(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        gen, took = info["generation"], time.perf_counter() - self._started
        self.counts[gen][bisect.bisect_left(_LATENCY_BUCKETS, took)] += 1
        self.sums[gen] += took

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(
            f"{_NS}_frontend_gc_pause_seconds", "Cyclic-collector passes in the front end "
            "process, by generation (2: full): the event loop, and every stream, waits them "
            "out", labels=["model_name", "generation"])
        bounds = [str(float(b)) for b in _LATENCY_BUCKETS] + ["+Inf"]
        for gen in self.GENERATIONS:
            cumulative = list(itertools.accumulate(self.counts[gen]))
            family.add_metric([self.model_name, str(gen)], list(zip(bounds, cumulative)),
                              self.sums[gen])
        yield family


class ServerMetrics:
    def __init__(self, model_name: str = "") -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.running = self._one(Gauge, "num_requests_running",
                                 "Requests in the engine's running batch")
        self.waiting = self._one(Gauge, "num_requests_waiting", "Requests queued in the engine")
        self.token_usage = self._one(Gauge, "token_usage",
                                     "Fraction of the KV pool held by requests")
        self.cache_hit_rate = self._one(
            Gauge, "cache_hit_rate", "Prompt tokens served from the prefix cache / prompt tokens")
        self.prompt_tokens = self._one(Counter, "prompt_tokens", "Prompt tokens processed")
        self.cached_tokens = self._one(Counter, "cached_prompt_tokens",
                                       "Prompt tokens served from cache")
        self.generation_tokens = self._one(Counter, "generation_tokens", "Tokens generated")
        self.requests = self._by(Counter, "requests", "Finished requests by finish reason",
                                 "finish_reason")
        self.aborted = self._by(
            Counter, "aborted_requests", "Engine requests (one per prompt) ended before their "
            "end, by reason: client_disconnect, abort_request, shutdown", "reason")
        for reason in ("client_disconnect", "abort_request", "shutdown"):
            self.aborted.labels(reason)  # exported as 0 from the start
        self.ttft = self._one(Histogram, "time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS)
        self.itl = self._one(Histogram, "inter_token_latency_seconds",
                             "Time between output tokens", buckets=_LATENCY_BUCKETS)
        self.e2e = self._one(Histogram, "e2e_request_latency_seconds",
                             "Request latency, end to end", buckets=_LATENCY_BUCKETS)
        self.flip_in_progress = self._by(
            Gauge, "flip_in_progress", "1 while a phase-flip seam runs or a flip asked for is "
            "not answered, labelled with its target layout; 0 (to=\"\") otherwise", "to")

        self.gc_pauses = CollectorPauses(model_name)
        self.registry.register(self.gc_pauses)
        self.gc_frozen = self._one(
            Gauge, "frontend_gc_frozen_objects", "Objects the front end moved out of the "
            "collector's reach once started (its full passes walk only what came since)")

        self.hicache_rate = self._by(
            Gauge, "hicache_transfer_gbps", "Observed HiCache copy rate (dispatch to seen done; "
            "a floor on the link rate)", "direction")
        self.engine_counters = EngineCounters(model_name)
        for name, doc, label in _HICACHE_TOTALS:
            self.engine_counters.declare(name, doc, label)
        self.engine_counters.declare("num_preemptions", "Requests taken off the device to "
                                     "free KV and recomputed later (the pool ran out, or a "
                                     "phase flip)")
        self.registry.register(self.engine_counters)

    def _one(self, kind: type[MetricWrapperBase], name: str, doc: str, **kw):
        """The family's one series, `{model_name=...}`."""
        return kind(name, doc, ["model_name"], namespace=_NS, registry=self.registry,
                    **kw).labels(self.model_name)

    def _by(self, kind: type[MetricWrapperBase], name: str, doc: str, label: str) -> Labelled:
        return Labelled(kind(name, doc, ["model_name", label], namespace=_NS,
                             registry=self.registry), self.model_name)

    @contextlib.contextmanager
    def collector_watched(self) -> Iterator[None]:
        """Inside: the front end's heap frozen (`heap.freeze_heap`) and every collector pass
        timed (`gc_pauses`). Unfrozen, the full passes walked the whole import heap (~300 000
        objects: transformers, pydantic, FastAPI), ~200 ms each, five in 12 s of 256 streams
        on the CPU box (docs/benchmarks.md). For the serving process only: the freeze and the
        hook are process-wide."""
        freeze_heap()
        self.gc_frozen.set(gc.get_freeze_count())
        gc.callbacks.append(self.gc_pauses.hook)
        try:
            yield
        finally:
            gc.callbacks.remove(self.gc_pauses.hook)
            thaw_heap()

    def observe_hicache(self, stats: dict | None) -> None:
        """Mirrors the engine's HiCache totals as counters and its copy rates as gauges (absent
        when HiCache is off: nothing set)."""
        if not stats:
            return
        counters = self.engine_counters
        for tier in ("host", "disk"):
            counters.observe("hicache_hit_tokens", stats[f"{tier}_hit_tokens"], tier)
        for direction in ("written", "loaded", "stored"):
            counters.observe("hicache_bytes", stats[f"bytes_{direction}"], direction)
        for field, event in _HICACHE_PAGE_EVENTS.items():
            counters.observe("hicache_pages", stats[field], event)
        for direction in ("store", "load"):  # unmeasured (None) stays unset, never 0
            rate = stats.get(f"{direction}_gbps")
            if rate is not None:
                self.hicache_rate.labels(direction).set(rate)

    def observe_engine(self, info: dict) -> None:
        """Mirrors the engine's answer to "info", exact at the scrape (the running/waiting
        counts of the last output are stale through a long prefill and after an abort).
        Mid-flip the answer holds none of it: the figures stay as they were."""
        if "running" in info:
            self.running.set(info["running"])
            self.waiting.set(info["waiting"])
        if (pool := info.get("pool")) is not None:
            self.token_usage.set((pool["protected"] + pool["private"]) / pool["total"])
            self.observe_hicache(info.get("hicache"))
        if (sched := info.get("scheduler")) is not None:
            self.engine_counters.observe("num_preemptions", sched["retractions"])

    def observe_usage(self, prompt_tokens: int, cached: int) -> None:
        """A finished request's prompt (its generated tokens are counted as they come, so an
        aborted request's count too)."""
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_tokens.inc(cached)
        total = self.prompt_tokens._value.get()
        self.cache_hit_rate.set(self.cached_tokens._value.get() / total if total else 0.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
