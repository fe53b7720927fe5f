"""The flip's weights planner (`flip/weights.py`): which strategy `--flip-weights auto` picks,
from the layouts' shard sizes (counted on the meta device) against a rank's memory budget."""

from __future__ import annotations

import torch

from phaseflip.config import EngineConfig
from phaseflip.flip.weights import (
    RESIDENT_MAX_SHARE,
    parked_bytes,
    plan_weights,
    shard_bytes,
)
from phaseflip.model.config import ModelConfig

FLIP = {"enable_flip": True, "enable_hicache": True, "tp_size": 2, "device": "cpu"}
LAYOUTS = ((2, 1), (1, 2))


def _model(model_dirs) -> ModelConfig:
    return ModelConfig.from_dir(str(model_dirs["llama"]))


def test_shards_are_counted_exactly(model_dirs):
    """A tp2 rank holds half of each split weight and all of the replicated norms; a pp2
    stage holds its layers whole: their sum is the one-rank model plus what is repeated."""
    m = _model(model_dirs)
    one = shard_bytes(m, 1, 1, torch.float32)[0]
    tp = shard_bytes(m, 2, 1, torch.float32)
    pp = shard_bytes(m, 1, 2, torch.float32)
    norms = 4 * m.hidden_size * (2 * m.num_layers + 1)  # input/post norms + final, float32
    assert sum(tp) == one + norms  # the norms twice, everything else split
    assert sum(pp) >= one and max(pp) < one
    assert parked_bytes(m, LAYOUTS, torch.float32) == max(t + p - min(t, p)
                                                         for t, p in zip(tp, pp, strict=True))


def test_auto_parks_the_other_layout_when_it_fits(model_dirs):
    m = _model(model_dirs)
    parked = parked_bytes(m, LAYOUTS, torch.float32)
    cfg = EngineConfig(**FLIP)
    fits = plan_weights(cfg, m, LAYOUTS, torch.float32, int(parked / RESIDENT_MAX_SHARE) + 1)
    assert fits.strategy == "resident" and fits.parked_bytes == parked
    tight = plan_weights(cfg, m, LAYOUTS, torch.float32, int(parked / RESIDENT_MAX_SHARE) - 1)
    assert tight.strategy == "host-image" and "over 25 %" in tight.reason
    nccl = plan_weights(cfg, m, LAYOUTS, torch.float32, int(parked / RESIDENT_MAX_SHARE) - 1,
                        "nccl")
    assert nccl.strategy == "peer" and "NCCL" in nccl.reason
    dummy = EngineConfig(load_format="dummy", **FLIP)
    assert plan_weights(dummy, m, LAYOUTS, torch.float32, parked).strategy == "reload"
    assert plan_weights(cfg, m, LAYOUTS, torch.float32, None).strategy == "host-image"


def test_a_forced_strategy_is_kept_and_no_flips_reload(model_dirs):
    m = _model(model_dirs)
    for forced in ("resident", "peer", "host-image", "reload"):
        cfg = EngineConfig(flip_weights=forced, **FLIP)
        assert plan_weights(cfg, m, LAYOUTS, torch.float32, 1).strategy == forced
    one = EngineConfig(device="cpu")
    assert plan_weights(one, m, ((1, 1),), torch.float32, 10**12).strategy == "reload"


def test_the_engine_resolves_auto_once_for_every_rank(model_dirs):
    """On the CPU box the tiny model's other layout is a sliver of RAM: auto is resident,
    and the resolved strategy is what the ranks build with (in the running config)."""
    from phaseflip import Engine

    with Engine(str(model_dirs["llama"]), dtype="float32", max_total_tokens=2048,
                hicache_host_gb=0.01, dist_timeout_s=60, **FLIP) as e:
        assert e.core.cfg.flip_weights == "resident"
        assert e.core.weights_plan.strategy == "resident"
        assert "% of its" in e.core.weights_plan.line()

