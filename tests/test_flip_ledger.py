"""What a flip costs after its cutover (docs/design.md): the refill of the retracted requests in the
seam census, and the warm-up ledger of served latency by rounds since the cutover. Law 5: a
number nothing measured (a refill in progress, a band with nothing compared) is None, never 0.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from phaseflip import Engine, SamplingParams
from phaseflip.cache.hicache import page_keys
from phaseflip.flip.census import SeamCensus
from phaseflip.flip.ledger import (
    BANDS,
    RECENT_FLIPS,
    STEADY_MIN_STEPS,
    FlipLedger,
    Warmup,
    band_of,
)
from phaseflip.scheduler.scheduler import Scheduled
from tests.conftest import prompts_for

REFILL = ("refill_tokens_loaded", "refill_bytes", "refill_tokens_prefilled", "refill_s",
          "refill_rate_gbps")


# ---------------------------------------------------------------------- warm-up bands
@pytest.mark.parametrize("rounds, band", [(1, "≤1"), (2, "≤4"), (4, "≤4"), (5, "≤16"),
                                          (16, "≤16"), (17, "≤64"), (64, "≤64"),
                                          (65, "steady"), (10_000, "steady")])
def test_rounds_fall_in_geometric_bands(rounds, band):
    assert band_of(rounds) == band


def _feed(w: Warmup, per_band_s: dict[str, float], steady_steps: int) -> None:
    """Rounds 1..64 served at their band's seconds, then `steady_steps` steady ones."""
    for r in range(1, 65 + steady_steps):
        w.observe(True, True, per_band_s[band_of(r)])


def test_bands_are_ratios_to_this_tenures_steady_state():
    w = Warmup("tp1×pp2")
    d = w.as_dict()
    assert d["rounds"] == 0 and d["reference_ms"] is None
    assert all(b == {"steps": 0, "mean_ms": None, "ratio": None} for b in d["bands"].values())
    w.observe(False, False, 9.0)  # an idle step: no round
    w.observe(True, False, 9.0)  # a round that served no next token (a fresh prefill)
    assert w.rounds == 1 and w.as_dict()["bands"]["≤1"]["steps"] == 0
    w = Warmup("tp1×pp2")
    secs = {"≤1": 0.05, "≤4": 0.02, "≤16": 0.015, "≤64": 0.012, "steady": 0.01}
    _feed(w, secs, STEADY_MIN_STEPS - 1)
    d = w.as_dict()  # too few steady steps to be a reference: measured means, no ratio
    assert d["bands"]["≤1"]["mean_ms"] == pytest.approx(50.0)
    assert d["reference_ms"] is None and all(b["ratio"] is None for b in d["bands"].values())
    w.observe(True, True, 0.01)
    d = w.as_dict()
    assert d["reference"] == "this tenure" and d["reference_ms"] == pytest.approx(10.0)
    assert [d["bands"][b]["ratio"] for b in BANDS] == pytest.approx([5.0, 2.0, 1.5, 1.2, 1.0])
    assert [d["bands"][b]["steps"] for b in BANDS] == [1, 3, 12, 48, STEADY_MIN_STEPS]


def test_a_layouts_earlier_steady_state_is_the_reference_until_its_own():
    """The launch tenure of tp2 reaches a steady state; after a flip to pp2 and back, tp2's
    first bands are compared with it at once; pp2 (never steady before) has no ratios."""
    t = [0.0]
    ledger = FlipLedger("tp2×pp1", clock=lambda: t[0])
    for _ in range(64 + STEADY_MIN_STEPS):
        _serve(ledger, 0.01)
    to_pp = _census("tp2×pp1", "tp1×pp2")
    ledger.before_seam([])
    ledger.cutover(to_pp, None)
    ledger.observe_items([Scheduled(_req(0, outputs=0), 0, 5, 0, 1, True)])  # a first token
    ledger.observe_step(True, 0.03)
    _serve(ledger, 0.03)
    bands = to_pp.as_dict()["warmup"]["bands"]
    assert bands["≤1"]["steps"] == 0 and bands["≤1"]["mean_ms"] is None
    assert bands["≤4"]["mean_ms"] == pytest.approx(30.0) and bands["≤4"]["ratio"] is None
    back = _census("tp1×pp2", "tp2×pp1")
    ledger.cutover(back, None)
    _serve(ledger, 0.02)
    d = back.as_dict()["warmup"]
    assert d["reference"] == "earlier tenure" and d["reference_ms"] == pytest.approx(10.0)
    assert d["bands"]["≤1"]["ratio"] == pytest.approx(2.0)
    assert d["bands"]["≤4"]["ratio"] is None  # nothing compared there yet


def _census(source: str, target: str) -> SeamCensus:
    return SeamCensus(source, target, {"fence": 0.25, "relayout": 0.5})


def _req(kv_len: int, outputs: int = 1) -> SimpleNamespace:
    return SimpleNamespace(kv_len=kv_len, finished=False, output_ids=[7] * outputs)


def _serve(ledger: FlipLedger, seconds: float) -> None:
    """A decode step of a request with output so far."""
    ledger.observe_items([Scheduled(_req(5), 5, 1, 0, 1, True)])
    ledger.observe_step(True, seconds)


# ---------------------------------------------------------------------- refill bookkeeping


class Tier:
    """A HiCache controller's load counters."""

    def __init__(self) -> None:
        self.stats = SimpleNamespace(host_hit_tokens=64, disk_hit_tokens=8,
                                     bytes_loaded=10_000, load_seconds=2.0)

    def load(self, tokens: int, nbytes: int, seconds: float) -> None:
        s = self.stats
        s.host_hit_tokens, s.bytes_loaded = s.host_hit_tokens + tokens, s.bytes_loaded + nbytes
        s.load_seconds += seconds


def _run(ledger: FlipLedger, req, start: int, n: int) -> None:
    """One step scheduling `req` from `start` for n tokens (after `advance`)."""
    req.kv_len = start + n
    ledger.observe_items([Scheduled(req, start, n, 0, 1, True)])
    ledger.observe_step(True, 0.01)


def test_refill_fields_are_none_until_the_last_retracted_request_is_refilled():
    t = [100.0]
    ledger, tier = FlipLedger("tp2×pp1", clock=lambda: t[0]), Tier()
    a, b = _req(20), _req(13)
    census = _census("tp2×pp1", "tp1×pp2")
    ledger.before_seam([a, b])
    a.kv_len = b.kv_len = 0  # the retract
    ledger.cutover(census, tier)
    assert census.refill_state == "pending" and all(getattr(census, f) is None for f in REFILL)
    t[0] = 100.5
    tier.load(16, 4096, 0.25)  # a's pages, read back before its admission
    _run(ledger, a, 16, 5)  # matched 16, re-prefilled 16..19 (20 is its next decode token)
    assert census.refill_state == "pending" and all(getattr(census, f) is None for f in REFILL)
    t[0] = 101.0
    tier.load(8, 2048, 0.25)
    _run(ledger, b, 8, 3)  # a chunk: 8..10 of b's 13
    assert census.refill_s is None
    t[0] = 101.25
    _run(ledger, b, 11, 3)  # 11..12 below 13, then its next token
    assert census.refill_state == "done"
    assert census.refill_tokens_loaded == 24 and census.refill_bytes == 6144
    assert census.refill_rate_gbps == pytest.approx(6144 / 0.5 / 1e9)
    assert census.refill_tokens_prefilled == 4 + 3 + 2
    assert census.refill_s == pytest.approx(1.25)
    _run(ledger, a, 21, 1)  # later steps change nothing
    assert census.refill_tokens_prefilled == 9 and census.refill_s == pytest.approx(1.25)
    json.dumps(census.as_dict())
    assert "refill done in 1.250 s: 24 tokens loaded" in census.refill_line()


def test_refill_without_a_host_tier_or_loads_says_unmeasured_not_zero():
    ledger = FlipLedger("tp2×pp1", clock=lambda: 0.0)
    a = _req(9)
    no_tier = _census("tp2×pp1", "tp1×pp2")
    ledger.before_seam([a])
    ledger.cutover(no_tier, None)
    _run(ledger, a, 0, 10)
    assert no_tier.refill_tokens_prefilled == 9 and no_tier.refill_s == 0.0
    assert (no_tier.refill_tokens_loaded, no_tier.refill_bytes,
            no_tier.refill_rate_gbps) == (None, None, None)
    nothing = _census("tp1×pp2", "tp2×pp1")
    ledger.before_seam([])  # nothing running at the seam: the refill is done at the cutover
    ledger.cutover(nothing, Tier())
    assert nothing.refill_state == "done" and nothing.refill_rate_gbps is None
    assert (nothing.refill_tokens_loaded, nothing.refill_bytes,
            nothing.refill_tokens_prefilled) == (0, 0, 0)


def test_an_ended_request_is_not_waited_for_and_the_next_flip_cuts_a_refill_short():
    ledger = FlipLedger("tp2×pp1", clock=lambda: 0.0)
    a, b = _req(9), _req(30)
    first = _census("tp2×pp1", "tp1×pp2")
    ledger.before_seam([a, b])
    ledger.cutover(first, Tier())
    b.finished = True  # aborted while it waited
    _run(ledger, a, 8, 2)
    assert first.refill_state == "done" and first.refill_tokens_prefilled == 1
    c = _req(12)
    second = _census("tp1×pp2", "tp2×pp1")
    ledger.before_seam([c])
    ledger.cutover(second, Tier())
    ledger.observe_step(True, 0.01)
    ledger.before_seam([c])
    for _ in range(RECENT_FLIPS):
        ledger.cutover(_census("tp2×pp1", "tp1×pp2"), Tier())
    assert second.refill_state == "cut short"
    assert all(getattr(second, f) is None for f in REFILL)
    snap = ledger.snapshot()
    assert len(snap["flip_censuses"]) == RECENT_FLIPS and second not in ledger.recent
    assert snap["last_flip"] == snap["flip_censuses"][-1]
    json.dumps(snap)


# ---------------------------------------------------------------------- on real ranks
@pytest.mark.timeout(120, method="thread")  # signals cannot interrupt gloo
def test_a_flip_mid_generation_fills_its_refill_and_warmup(model_dirs):
    """tp2 → pp2 with every request decoding: the refill fields are None until the retracted
    requests are re-admitted and re-prefilled, then say what was read back from the host tier
    (exactly the fenced pages) and what was computed again; the warm-up bands fill in as the
    rounds pass, with ratios once the steady band is measured; `info` shows it all."""
    from phaseflip.server import messages as m
    from phaseflip.server.engine_process import EngineServer

    params = SamplingParams(temperature=0.0, max_new_tokens=64 + STEADY_MIN_STEPS + 8,
                            ignore_eos=True)
    with Engine(str(model_dirs["llama"]), tp_size=2, enable_flip=True, enable_hicache=True,
                hicache_host_gb=0.01, hicache_page_size=8, device="cpu", dtype="float32",
                max_total_tokens=4096, dist_timeout_s=60, check_accounting=True) as e:
        core, hc = e.core, e.core.hicache
        for i, p in enumerate(prompts_for(300)):
            core.add_request(f"r{i}", p, params)
        for _ in range(3):
            core.step()
        assert core.flip_ledger.snapshot()["last_flip"] is None
        before = [r.kv_len for r in core.scheduler.running]
        assert len(before) == len(prompts_for(300)) and not core.scheduler.waiting
        fenced = {k for r in core.scheduler.running
                  for k in page_keys(r.all_ids[: r.kv_len], hc.page_size, hc.fingerprint)}
        census, _ = core.flip(1, 2)
        assert census.refill_state == "pending" and all(getattr(census, f) is None
                                                        for f in REFILL)
        assert census.as_dict()["warmup"]["rounds"] == 0
        steps = 0
        while census.refill_state == "pending":
            assert all(getattr(census, f) is None for f in REFILL)
            core.step()
            steps += 1
            assert steps < 20, "the refill never completed"
        assert census.refill_tokens_loaded == hc.page_size * len(fenced) > 0
        assert census.refill_bytes == len(fenced) * hc.geometry.payload_len
        assert census.refill_rate_gbps is not None and census.refill_rate_gbps > 0
        # what each held below its last full page was computed again, nothing more
        assert census.refill_tokens_prefilled == sum(b % hc.page_size for b in before)
        assert census.refill_s > 0
        bands = census.as_dict()["warmup"]["bands"]
        assert bands["≤1"]["steps"] == 1  # the re-prefill served the retracted requests
        assert bands["≤1"]["ratio"] is None  # no steady state of tp1×pp2 yet
        while core.has_work():
            core.step()
        info = EngineServer._control(SimpleNamespace(core=core, cfg=core.cfg, busy_s=0.0),
                                     m.Control(1, "info"))
        m.encode(info)
        last = json.loads(json.dumps(info.data["last_flip"]))
        assert last["target"] == "tp1×pp2" and last["refill_state"] == "done"
        assert last["refill_tokens_loaded"] == census.refill_tokens_loaded
        warmup = last["warmup"]
        assert warmup["reference"] == "this tenure" and warmup["reference_ms"] > 0
        assert [warmup["bands"][b]["steps"] for b in BANDS[:4]] == [1, 3, 12, 48]
        assert all(warmup["bands"][b]["ratio"] > 0 for b in BANDS)
        assert warmup["bands"]["steady"]["steps"] >= STEADY_MIN_STEPS


def test_each_closed_refill_is_told_to_the_policy_once():
    """Issue 17: C includes the refill. The ledger hands every refill window that closes (at
    the cutover when nothing was retracted, or at the step refilling the last request) to
    `on_refill` once; a window the next flip cuts short is never handed on."""
    told: list[SeamCensus] = []
    ledger = FlipLedger("tp2×pp1", clock=lambda: 0.0, on_refill=told.append)
    a = _req(9)
    first = _census("tp2×pp1", "tp1×pp2")
    ledger.before_seam([a])
    ledger.cutover(first, Tier())
    assert told == []
    _run(ledger, a, 0, 10)
    _run(ledger, a, 10, 1)
    assert told == [first] and first.refill_tokens_prefilled == 9
    b = _req(30)
    second = _census("tp1×pp2", "tp2×pp1")
    ledger.before_seam([b])
    ledger.cutover(second, Tier())
    third = _census("tp2×pp1", "tp1×pp2")
    ledger.before_seam([])
    ledger.cutover(third, Tier())  # cuts the second short; the third has nothing to refill
    assert told == [first, third] and second.refill_state == "cut short"
