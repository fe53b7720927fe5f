"""The KV arena of resident flips (`cache/kv_pool.py` `KVArena`): every layout's KV pool in one
allocation per rank, with the slots a fresh launch would give it; gloo ranks on CPU."""

from __future__ import annotations

import pytest

from phaseflip import Engine
from tests.test_flip import CFG, FLIP

pytestmark = pytest.mark.timeout(240, method="thread")  # signals cannot interrupt gloo


def test_resident_flips_reuse_one_kv_arena(model_dirs):
    """With resident weights every layout's KV pool lives in the memory the launch layout's
    pool took (the rank's `KVArena`): a seam allocates no pool and sizes none from free
    memory (on the H200 the free memory drifted by ~20 MiB a cycle and each tp2 pool came out
    160-176 slots smaller). Other strategies size each pool afresh."""
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
    with Engine(str(model_dirs["llama"]), tp_size=2, flip_weights="reload", **FLIP,
                **CFG) as e:
        assert e.core.runner.runner.pool.arena is None


def test_the_arena_gives_every_layout_a_fresh_launch_s_slots(tmp_path):
    """An uneven split (3 layers on pp2: 2 + 1) gives a rank fewer bytes per slot at launch
    than in tp2: the arena is the rank's own budget (here the cap in its largest layout), so
    every layout gets the slots a reload gets (tp2 had 2 731 of 4 097 when the arena was the
    launch pool's agreed size). A failed group frees rank 0's arena with it."""
    from tests.conftest import build_model

    model = build_model(tmp_path / "llama3", "llama", num_hidden_layers=3)
    slots = {}
    for strategy in ("reload", "resident"):
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
    assert slots["resident"] == slots["reload"], slots
