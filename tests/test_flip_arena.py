"""The KV arena of flips (`cache/kv_pool.py` `KVArena`): every layout's KV pool in one
allocation per rank, with the slots a fresh launch would give it; gloo ranks on CPU. Host-image
and reload flips' arena reuse and outputs: tests/test_flip.py
`test_each_weights_strategy_matches_the_unflipped_run`."""

from __future__ import annotations

import pytest
import torch

from phaseflip import Engine
from tests.test_flip import CFG, FLIP

pytestmark = pytest.mark.timeout(240, method="thread")  # signals cannot interrupt gloo


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    """The tiny llama with 3 layers: pp2 splits it unevenly (2 + 1)."""
    from tests.conftest import build_model

    return build_model(tmp_path_factory.mktemp("llama3"), "llama", num_hidden_layers=3)


def test_resident_flips_reuse_one_kv_arena(model_dirs):
    """With resident weights every layout's KV pool lives in the memory the launch layout's
    pool took (the rank's `KVArena`): a seam allocates no pool and sizes none from free
    memory (on the H200 the free memory drifted by ~20 MiB a cycle and each tp2 pool came out
    160-176 slots smaller). Peer flips size each pool afresh (their build holds two shards)."""
    with Engine(str(model_dirs["llama"]), tp_size=2, flip_weights="resident", **FLIP,
                **CFG) as e:
        core = e.core
        arena = core._ranks.rank0.kv_arena
        launch = core.runner.runner.pool
        assert launch.arena is arena and arena.nbytes > 0
        ptr, slots = arena.buffer.data_ptr(), launch.num_slots
        for tp, pp in [(1, 2), (2, 1), (1, 2)]:
            census, _ = core.flip(tp, pp)
            pool = core.runner.runner.pool
            assert pool.arena is arena and pool.kv.data_ptr() == ptr
            assert pool.num_slots == slots and census.kv_slots_after == census.kv_slots_before
    with Engine(str(model_dirs["llama"]), tp_size=2, flip_weights="peer", **FLIP,
                **CFG) as e:
        assert e.core.runner.runner.pool.arena is None


def test_the_arena_gives_every_layout_a_fresh_launch_s_slots(llama3):
    """An uneven split (3 layers on pp2: 2 + 1) gives a rank fewer bytes per slot at launch
    than in tp2: the arena is the rank's own budget (here the cap in its largest layout), so
    every layout gets the slots a pool sized afresh (peer) gets (tp2 had 2 731 of 4 097 when
    the arena was the launch pool's agreed size). A failed group frees rank 0's arena with
    it."""
    model = llama3
    slots = {}
    for strategy in ("peer", "resident"):
        with Engine(str(model), pp_size=2, flip_weights=strategy, **FLIP, **CFG) as e:
            core = e.core
            got = [core.runner.runner.num_slots]
            for tp, pp in [(2, 1), (1, 2)]:
                core.flip(tp, pp)
                got.append(core.runner.runner.num_slots)
            slots[strategy] = got
            if strategy == "resident":
                arena = core._ranks.rank0.kv_arena
                assert arena.nbytes > 0
                core.runner.close(graceful=False)  # what a failed seam or step does
                assert arena.nbytes == 0
    assert slots["resident"] == slots["peer"], slots


def test_a_larger_shard_elsewhere_is_left_out_of_the_arena(llama3, monkeypatch):
    """Host-image and reload seams load the next layout's weights with the arena held, so a
    rank whose shard is larger in another layout (3 layers: pp2 puts 2 + 1, tp2 3 halves on
    each) reserves its KV budget less exactly that difference; the rank whose launch shard is
    its largest loses nothing; every rank also leaves the largest tensor's load transient.
    Red without the headroom: the budget ignored it."""
    from phaseflip.config import EngineConfig
    from phaseflip.distributed.worker import arena_headroom, load_transient_bytes
    from phaseflip.flip.weights import shard_bytes
    from phaseflip.model.config import ModelConfig
    from phaseflip.model.runner import ModelRunner

    model_cfg = ModelConfig.from_dir(llama3)
    f32 = torch.float32
    pp2, tp2 = shard_bytes(model_cfg, 1, 2, f32), shard_bytes(model_cfg, 2, 1, f32)
    room = [arena_headroom(r, (1, 2), ((1, 2), (2, 1)), model_cfg, f32, None) for r in (0, 1)]
    # plus the largest tensor's load: under TP a row-parallel tensor is uploaded whole first
    load = load_transient_bytes(model_cfg, f32, None, ((1, 2), (2, 1)))
    m = model_cfg
    assert load == 4 * m.hidden_size * max(m.intermediate_size, (m.num_heads + 2 * (
        m.num_kv_heads)) * m.head_dim)
    assert room == [max(0, tp2[r] - pp2[r]) + load for r in (0, 1)] and room[1] > load
    assert arena_headroom(1, (2, 1), ((2, 1), (1, 2)), model_cfg, f32, None) == load
    assert load_transient_bytes(model_cfg, f32, None, ((1, 2), (1, 1))) == 0  # no TP
    quant = load_transient_bytes(model_cfg, torch.bfloat16, object(), ((1, 2), (2, 1)))
    assert quant == 13 * load // 4  # quantized to FP8 on the device whole: ~13 B an element

    # the budget a launch reads from free memory, on a fake device: 20 000 slots' bytes
    runner = ModelRunner(EngineConfig(model=str(model_cfg.model_dir), device="cpu",
                                      dtype="float32", mem_fraction=0.5,
                                      max_total_tokens=64), model_cfg)
    per_slot = runner.pool.bytes_per_slot(3, model_cfg.num_kv_heads, model_cfg.head_dim, f32)
    total = 2**34
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *_: (total // 2 + 20000 * per_slot,
                                                                total))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *_: 0)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *_: 0)
    assert runner.kv_headroom == 0 and runner._tokens_from_memory() == 20000
    runner.kv_headroom = room[1]
    assert runner._tokens_from_memory() == 20000 - -(-room[1] // per_slot)
    runner.close()
