"""Prometheus metrics of one server (its own registry: no process-global state)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        ns = "phaseflip"
        self.running = Gauge("num_requests_running", "Requests in the engine's running batch",
                             namespace=ns, registry=r)
        self.waiting = Gauge("num_requests_waiting", "Requests queued in the engine",
                             namespace=ns, registry=r)
        self.token_usage = Gauge("token_usage", "Fraction of the KV pool held by requests",
                                 namespace=ns, registry=r)
        self.cache_hit_rate = Gauge("cache_hit_rate",
                                    "Prompt tokens served from the prefix cache / prompt tokens",
                                    namespace=ns, registry=r)
        self.prompt_tokens = Counter("prompt_tokens", "Prompt tokens processed",
                                     namespace=ns, registry=r)
        self.cached_tokens = Counter("cached_prompt_tokens", "Prompt tokens served from cache",
                                     namespace=ns, registry=r)
        self.generation_tokens = Counter("generation_tokens", "Tokens generated",
                                         namespace=ns, registry=r)
        self.requests = Counter("requests", "Finished requests by finish reason",
                                ["finish_reason"], namespace=ns, registry=r)
        self.aborted = Counter(
            "aborted_requests", "Engine requests (one per prompt) ended before their end, by "
            "reason: client_disconnect, abort_request, shutdown", ["reason"], namespace=ns,
            registry=r)
        for reason in ("client_disconnect", "abort_request", "shutdown"):
            self.aborted.labels(reason)  # exported as 0 from the start
        self.ttft = Histogram("time_to_first_token_seconds", "Time to first token",
                              namespace=ns, registry=r, buckets=_LATENCY_BUCKETS)
        self.itl = Histogram("inter_token_latency_seconds", "Time between output tokens",
                             namespace=ns, registry=r, buckets=_LATENCY_BUCKETS)
        self.e2e = Histogram("e2e_request_latency_seconds", "Request latency, end to end",
                             namespace=ns, registry=r, buckets=_LATENCY_BUCKETS)

        self.hicache_tokens = Gauge("hicache_hit_tokens", "Prompt tokens read from a HiCache tier",
                                    ["tier"], namespace=ns, registry=r)
        self.hicache_bytes = Gauge("hicache_bytes", "Bytes moved by HiCache", ["direction"],
                                   namespace=ns, registry=r)
        self.hicache_pages = Gauge("hicache_pages", "HiCache page events", ["event"],
                                   namespace=ns, registry=r)
        self.hicache_rate = Gauge(
            "hicache_transfer_gbps", "Observed HiCache copy rate (dispatch to seen done; a "
            "floor on the link rate)", ["direction"], namespace=ns, registry=r)

    def observe_hicache(self, stats: dict | None) -> None:
        """Mirrors the engine's HiCache counters (absent when HiCache is off: nothing set)."""
        if not stats:
            return
        self.hicache_tokens.labels("host").set(stats["host_hit_tokens"])
        self.hicache_tokens.labels("disk").set(stats["disk_hit_tokens"])
        self.hicache_bytes.labels("written").set(stats["bytes_written"])
        self.hicache_bytes.labels("loaded").set(stats["bytes_loaded"])
        self.hicache_bytes.labels("stored").set(stats["bytes_stored"])
        for direction in ("store", "load"):  # unmeasured (None) stays unset, never 0
            rate = stats.get(f"{direction}_gbps")
            if rate is not None:
                self.hicache_rate.labels(direction).set(rate)
        for event in ("pages_written", "miss_pages", "corrupt_pages", "host_evictions",
                      "disk_evictions", "disk_writes_dropped", "sync_writebacks"):
            self.hicache_pages.labels(event.removesuffix("_pages").removesuffix("s")).set(
                stats[event])

    def observe_usage(self, prompt_tokens: int, cached: int, generated: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_tokens.inc(cached)
        self.generation_tokens.inc(generated)
        total = self.prompt_tokens._value.get()
        self.cache_hit_rate.set(self.cached_tokens._value.get() / total if total else 0.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
