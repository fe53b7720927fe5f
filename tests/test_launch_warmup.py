"""The launch warm-up (`engine/warmup.py`): a short internal request before a server is ready,
so the first client does not pay for compiling the prefill kernels; the engine is left as it
was (no cached prefix, step counters as before, the flip policy unfed) and serves the same
tokens."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from phaseflip import Engine, SamplingParams
from phaseflip.engine.warmup import warm_up

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
PROMPTS = [[5, 9, 13, 200, 7, 7, 31] * 5, [42] * 20]


def test_the_warm_up_leaves_the_engine_as_it_found_it(model_dirs):
    with Engine(str(model_dirs["llama"]), device="cpu", max_total_tokens=2048) as e:
        want = [o.outputs[0].token_ids for o in e.generate(PROMPTS, GREEDY, use_tqdm=False)]
    with Engine(str(model_dirs["llama"]), device="cpu", max_total_tokens=2048) as e:
        core = e.core
        assert warm_up(core) is None  # on the CPU nothing compiles on first use: skipped
        stats = dataclasses.replace(core.scheduler.stats)
        assert warm_up(core, force=True) > 0
        assert dataclasses.asdict(core.scheduler.stats) == dataclasses.asdict(stats)
        acct = e.pool_accounting()
        assert acct.free == acct.total  # nothing cached, nothing held
        got = [o.outputs[0].token_ids for o in e.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert got == want


def test_the_warm_up_runs_a_prefill_an_extend_of_a_cached_prefix_and_a_mixed_step(
        model_dirs, monkeypatch):
    """Every attention build a server's first requests need: a prefill, an extend over a cached
    prefix, and a step mixing a decode with an extend (the decode kernel's mixed-batch build,
    which no graph capture compiles: without it the first mixed step compiled mid-serving)."""
    from phaseflip.forward_batch import ForwardBatch

    seen: list[tuple[list[int], list[int]]] = []
    orig = ForwardBatch.from_table.__func__

    def record(cls, *args, **kwargs):
        batch = orig(cls, *args, **kwargs)
        seen.append((list(batch.extend_lens), list(batch.prefix_lens)))
        return batch

    monkeypatch.setattr(ForwardBatch, "from_table", classmethod(record))
    with Engine(str(model_dirs["llama"]), device="cpu", max_total_tokens=2048) as e:
        warm_up(e.core, force=True)
    assert any(all(p == 0 for p in pre) and max(ext) > 1 for ext, pre in seen), seen
    assert any(p > 0 and x > 1 for ext, pre in seen for x, p in zip(ext, pre)), seen
    assert any(1 in ext and max(ext) > 1 for ext, _ in seen), seen  # the mixed step


@pytest.mark.timeout(120, method="thread")  # signals cannot interrupt gloo
def test_the_warm_up_feeds_no_flip_policy(model_dirs):
    with Engine(str(model_dirs["llama"]), device="cpu", max_total_tokens=2048, tp_size=2,
                enable_flip=True, enable_hicache=True, hicache_host_gb=0.05,
                flip_policy="auto", dist_timeout_s=60) as e:
        observer = e.core.flip_telemetry
        warm_up(e.core, force=True)
        assert e.core.flip_telemetry is observer
        assert observer.policy.steps_in_layout == 0 and not observer.policy.rates
        assert e.core.kv.tree.evict_all_and_reset() == 0  # the tree was emptied already


def test_skip_warmup_is_a_flag():
    from phaseflip.cli import add_config_flags

    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    assert parser.parse_args(["--skip-warmup"]).skip_warmup is True
    assert parser.parse_args([]).skip_warmup is False


@pytest.mark.timeout(120, method="thread")  # signals cannot interrupt gloo
def test_pp_stage_times_are_measured_and_the_warm_up_leaves_none(model_dirs):
    """Rank 0 times its prompt parts for the part count (`micro_batch.py`); the warm-up's
    parts carried the kernels' compile on a GPU, so they are forgotten."""
    with Engine(str(model_dirs["llama"]), device="cpu", max_total_tokens=4096, pp_size=2,
                dist_timeout_s=60) as e:
        sizer = e.core.runner.sizer
        warm_up(e.core, force=True)
        assert sizer.snapshot()["parts_observed"] == 0
        e.generate([[7] * 300, [9] * 120], GREEDY, use_tqdm=False)
        e.core.runner.stage.part_clock.harvest()
        assert sizer.snapshot()["parts_observed"] > 0  # the clock feeds the sizer


def test_a_short_context_fits_the_warm_up_and_a_tiny_pool_skips_it(model_dirs):
    with Engine(str(model_dirs["llama"]), device="cpu", max_total_tokens=2048,
                max_model_len=8) as e:
        assert warm_up(e.core, force=True) > 0  # a 6-token prompt, then its prefix hit
    with Engine(str(model_dirs["llama"]), device="cpu", max_total_tokens=16) as e:
        assert warm_up(e.core, force=True) is None  # refused like a request: skipped
