"""EngineConfig: frozen sections, flat names, and what a phase flip replaces."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from phaseflip.config import EMBEDDED_MODEL, SECTIONS, EngineConfig, ParallelConfig
from phaseflip.errors import InvalidRequestError


def test_a_flip_replaces_the_parallel_section_only():
    cfg = EngineConfig(tp_size=2, enable_flip=True, enable_hicache=True, page_size=4)
    flipped = cfg.with_layout(1, 2)
    assert flipped.parallel == dataclasses.replace(cfg.parallel, tp_size=1, pp_size=2)
    for name in SECTIONS.keys() - {"parallel"}:
        assert getattr(flipped, name) is getattr(cfg, name), name
    assert (flipped.tp_size, flipped.pp_size, flipped.world_size) == (1, 2, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        flipped.parallel.tp_size = 4  # type: ignore[misc]


def test_flat_names_construct_read_and_replace():
    cfg = EngineConfig(tp_size=2, max_running_requests=8, hicache_page_size=32)
    assert cfg.parallel.tp_size == cfg.tp_size == 2
    assert cfg.scheduler.max_running_requests == 8 and cfg.cache.hicache_page_size == 32
    assert dataclasses.replace(cfg, pp_size=2).parallel == ParallelConfig(tp_size=2, pp_size=2)
    # a section given whole, with a flat field on top of it
    both = EngineConfig(parallel=ParallelConfig(tp_size=4), pp_size=2)
    assert (both.tp_size, both.pp_size) == (4, 2)
    assert EngineConfig(**dataclasses.asdict(cfg)) == cfg  # sections as dicts
    assert EngineConfig(**cfg.flat_dict()) == cfg
    assert pickle.loads(pickle.dumps(cfg)) == cfg  # the ranks receive it pickled
    assert set(cfg.flat_dict()) == set(EngineConfig.field_names())
    assert len(EngineConfig.field_names()) == len(set(EngineConfig.field_names()))


def test_bad_values_and_names_are_refused_by_flat_name():
    with pytest.raises(InvalidRequestError, match="page_size=0: must be >= 1") as e:
        EngineConfig(page_size=0)
    assert e.value.param == "page_size"
    with pytest.raises(InvalidRequestError, match="node_rank"):
        EngineConfig(parallel=ParallelConfig(nnodes=2, node_rank=2))
    with pytest.raises(TypeError, match="tpsize"):
        EngineConfig(tpsize=2)


def test_help_groups_the_flags_by_section():
    import argparse

    from phaseflip.cli import add_config_flags

    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    text = parser.format_help()
    for title in ("engine options", "load options", "scheduler options", "cache options",
                  "parallel options", "flip options"):
        assert title in text, title
    options = text[text.index("parallel options"):text.index("flip options")]
    assert "--tp-size" in options and "--dist-backend" in options


@pytest.mark.parametrize("tp, pp, reason", [
    (1, 8, "pp_size=8 exceeds the model's 4 layers"),
    (3, 1, "tp_size=3 does not split the model's 8 attention heads"),
])
def test_a_layout_the_model_cannot_hold_is_refused_before_any_rank_starts(
        tp, pp, reason, monkeypatch):
    """`--pp-size 99` used to start 98 rank processes, each of which then refused it."""
    from phaseflip import Engine
    from phaseflip.distributed import rank_set

    monkeypatch.setattr(rank_set, "start_rank",
                        lambda *a, **k: pytest.fail("a rank started for a layout that cannot be"))
    with pytest.raises(ValueError, match=reason):
        Engine(EMBEDDED_MODEL, device="cpu", tp_size=tp, pp_size=pp)


def test_flip_layouts_the_model_cannot_hold_are_refused_or_never_built(monkeypatch):
    """With --enable-flip and no --flip-layouts every tp × pp of the ranks was warmed up, and
    one the model cannot hold (pp8 of 4 layers) failed on every rank at warm-up: now it is
    not built. Named by --flip-layouts (or the auto policy's tpW/ppW), it is refused at once."""
    from phaseflip import Engine
    from phaseflip.distributed import rank_set
    from phaseflip.distributed.group import runnable_layouts
    from phaseflip.model.config import ModelConfig

    model_cfg = ModelConfig.from_dir(EMBEDDED_MODEL)
    cfg = EngineConfig(model=str(EMBEDDED_MODEL), device="cpu", tp_size=8, enable_flip=True,
                       enable_hicache=True)
    assert runnable_layouts(cfg, model_cfg) == ((8, 1), (2, 4), (4, 2))
    monkeypatch.setattr(rank_set, "start_rank",
                        lambda *a, **k: pytest.fail("a rank started for a layout that cannot be"))
    for extra, reason in (
            ({"flip_layouts": "tp8,pp8"}, "--flip-layouts tp8,pp8: tp1×pp8: pp_size=8 exceeds"),
            ({"flip_policy": "auto"}, r"--flip-policy auto flips to tp1×pp8 \(the default")):
        with pytest.raises(ValueError, match=reason):
            Engine(EMBEDDED_MODEL, device="cpu", tp_size=8, enable_flip=True,
                   enable_hicache=True, **extra)


def test_another_hosts_ranks_refuse_a_layout_the_model_cannot_hold_at_once(monkeypatch):
    """`serve --node-rank 1` started its ranks, which failed only after the driver's deadline."""
    from phaseflip.distributed import rank_set

    monkeypatch.setattr(rank_set, "start_rank",
                        lambda *a, **k: pytest.fail("a rank started for a layout that cannot be"))
    cfg = EngineConfig(model=str(EMBEDDED_MODEL), device="cpu", pp_size=8, nnodes=2,
                       node_rank=1, dist_init_addr="127.0.0.1:29999")
    with pytest.raises(ValueError, match="pp_size=8 exceeds the model's 4 layers"):
        rank_set.run_node_workers(cfg)


@pytest.mark.parametrize("flags, param", [({"tp_size": 3}, "tp_size"), ({"pp_size": 8}, "pp_size")])
def test_a_layout_the_model_cannot_hold_is_a_typed_error_naming_the_option(flags, param):
    """The project's InvalidRequestError (what the CLI prints in one line), not a bare
    ValueError, with the option that is wrong: `Engine(tp_size=3)` and `serve -tp 3` alike."""
    from phaseflip.distributed.group import check_layouts
    from phaseflip.errors import InvalidRequestError
    from phaseflip.model.config import ModelConfig

    cfg = EngineConfig(model=str(EMBEDDED_MODEL), device="cpu", **flags)
    with pytest.raises(InvalidRequestError) as e:
        check_layouts(cfg, ModelConfig.from_dir(EMBEDDED_MODEL))
    assert e.value.param == param, e.value
