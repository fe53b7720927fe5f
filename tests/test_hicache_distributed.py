"""HiCache under TP and PP over real processes (gloo on CPU): the driver decides every transfer,
each rank copies its slice of the shared host frames, and pages written under one layout are
read under another (what the phase flip relies on).

Every test runs under a deadline (pytest-timeout), so a deadlock fails instead of hanging CI.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from phaseflip import Engine, SamplingParams
from tests.conftest import build_model, prompts_for

pytestmark = pytest.mark.timeout(300, method="thread")  # signals cannot interrupt gloo
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
HC = {"enable_hicache": True, "hicache_page_size": 8, "hicache_host_gb": 0.002}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """3 layers (pp=2 splits them 2+1) and 2 KV heads (tp=2: one head per rank, so a rank's
    slice of a page is 2 byte ranges per layer)."""
    return build_model(tmp_path_factory.mktemp("hc-dist") / "llama3", "llama",
                       num_hidden_layers=3, num_key_value_heads=2)


def engine(model_dir: Path, **cfg) -> Engine:
    """Ranks on CPU (gloo); PHASEFLIP_TEST_DEVICE=cuda puts them on the GPU(s) (one GPU: gloo
    with staged tensors; the HiCache copies then run on each rank's copy stream)."""
    device = os.environ.get("PHASEFLIP_TEST_DEVICE", "cpu")
    cfg = {"device": device, "dtype": "float32", "max_total_tokens": 4096,
           "dist_timeout_s": 60, "check_accounting": True} | cfg
    return Engine(str(model_dir), **cfg)


def generate(e: Engine, prompts: list[list[int]]) -> list[list[int]]:
    outs = [o.token_ids for o in e.generate(prompts, GREEDY, use_tqdm=False)]
    acc = e.pool_accounting()
    assert acc.balanced and acc.private == 0 and acc.protected == 0, acc
    return outs


def shm_files() -> set[str]:
    shm = Path("/dev/shm")
    return {p.name for p in shm.glob(f"phaseflip-hicache-{os.getpid()}-*")} if shm.is_dir() \
        else set()


@pytest.fixture(scope="module")
def prompts(model_dir) -> list[list[int]]:
    return [p for p in prompts_for(300) if len(p) >= 17]


@pytest.fixture(scope="module")
def reference(model_dir, prompts) -> list[list[int]]:
    with engine(model_dir) as e:
        return generate(e, prompts)


def test_tp2_pages_are_served_from_host_and_read_back_by_pp2_and_tp1(
        model_dir, prompts, reference, tmp_path):
    """tp=2 with HiCache equals the single process; after a device flush its prefixes come from
    the shared host tier; after a restart its disk pages serve a pp=2 and a tp=1 engine."""
    disk = {"hicache_dir": str(tmp_path / "kv")}
    with engine(model_dir, tp_size=2, **HC, **disk) as e:
        assert shm_files()
        assert generate(e, prompts) == reference
        hc = e.core.hicache
        assert hc.stats.pages_written > 0
        e.core.kv.tree.evict_all_and_reset()
        computed = e.core.scheduler.stats.prefill_tokens
        assert generate(e, prompts) == reference
        assert hc.stats.host_hit_tokens > 0 and hc.stats.disk_hit_tokens == 0
        # tokens read from the host tier were not prefilled again
        again = e.core.scheduler.stats.prefill_tokens - computed
        assert again <= sum(len(p) for p in prompts) - hc.stats.host_hit_tokens
    assert not shm_files()  # the shared host tier is unlinked at shutdown
    assert list((tmp_path / "kv").rglob("*.page"))

    for layout in ({"pp_size": 2}, {}):
        with engine(model_dir, **layout, **HC, **disk) as e:
            assert generate(e, prompts) == reference, layout
            assert e.core.hicache.stats.disk_hit_tokens > 0, layout


def test_pp2_and_tp2xpp1_write_back_identical(model_dir, prompts, reference):
    """pp=2 with write-back: identical outputs, and a flush writes the pages back (through the
    ranks' layer slices) so the re-run is served from the host tier."""
    with engine(model_dir, pp_size=2, hicache_write_policy="write_back", **HC) as e:
        assert generate(e, prompts) == reference
        hc = e.core.hicache
        assert hc.stats.pages_written == 0
        e.core.kv.tree.evict_all_and_reset()  # write-back: every dirty page is stored now
        assert hc.stats.pages_written > 0
        assert generate(e, prompts) == reference
        assert hc.stats.host_hit_tokens > 0
