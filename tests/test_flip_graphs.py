"""Each layout's decode graphs kept across seams (resident weights, `model/cuda_graph.py`).

A layout's graphs are parked with its model at the seam and replayed as they were when it
returns, if every address they captured is unchanged on every rank; else each size is captured
again on first use. On the CPU the graphs are not recorded (`record=False`,
`PHASEFLIP_UNRECORDED_GRAPHS=1` for the ranks): replays run eagerly over the same static
buffers, which checks the parking, the adoption, the fingerprint and the vote, not the
recording (the GPU test `tests/test_gpu.py -k live_flips` replays recorded ones).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from phaseflip import Engine
from phaseflip.cache.kv_pool import KVArena
from phaseflip.config import EngineConfig
from phaseflip.model.config import ModelConfig
from phaseflip.model.cuda_graph import UNRECORDED_ENV, DecodeGraphs, GraphReuse
from phaseflip.model.runner import ModelRunner
from tests.conftest import prompts_for
from tests.test_flip import CFG, FLIP, _assert_same, _drive

pytestmark = pytest.mark.timeout(240, method="thread")  # signals cannot interrupt gloo
FLIPS = {2: (1, 2), 5: (2, 1), 8: (1, 2), 11: (2, 1)}


@pytest.fixture(scope="module")
def reference(model_dirs) -> dict:
    """The unflipped single-process run, eager (no graphs)."""
    with Engine(str(model_dirs["llama"]), **CFG) as e:
        return _drive(e, prompts_for(300), {})[0]


def test_a_returning_layout_replays_its_parked_graphs(model_dirs, reference, monkeypatch):
    """tp2 → pp2 → tp2 → pp2 → tp2 with resident weights: each layout's second visit adopts
    the graphs its first left (the same objects, replayed on both visits), and the outputs
    equal the single-process run."""
    monkeypatch.setenv(UNRECORDED_ENV, "1")
    replays: Counter = Counter()  # rank 0's replays (this process), by graph set
    replay = DecodeGraphs._replay

    def counted(self, *args, **kwargs):
        replays[id(self)] += 1
        return replay(self, *args, **kwargs)

    monkeypatch.setattr(DecodeGraphs, "_replay", counted)
    with Engine(str(model_dirs["llama"]), tp_size=2, flip_weights="resident", **FLIP,
                **CFG) as e:
        core = e.core
        launch = core.runner.graphs
        assert core.runner.graph_capture == "at build" and launch is not None
        visits: list[tuple[tuple[int, int], object, int]] = []  # layout, graphs, replays

        def seam(when: str) -> None:
            if when == "after":
                graphs = core.runner.graphs
                visits.append(((core.cfg.tp_size, core.cfg.pp_size), graphs,
                               replays[id(graphs)]))

        got, censuses = _drive(e, prompts_for(300), FLIPS, seam)
        assert set(core._ranks.rank0.parked_graphs) == {(1, 2)}  # the layout not running
        ends = [replays[id(g)] for _, g, _ in visits[1:]] + [replays[id(core.runner.graphs)]]
    assert [c.graph_capture for c in censuses] == ["on first use", "parked", "parked",
                                                   "parked"]
    assert [(lay, g is launch) for lay, g, _ in visits] == [
        ((1, 2), False), ((2, 1), True), ((1, 2), False), ((2, 1), True)]
    assert visits[0][1] is visits[2][1]  # pp2's graphs, adopted on its second visit
    # every visit replayed its layout's graphs: the first captured them, the later reused
    assert all(end > start for (_, _, start), end in zip(visits, ends)), (visits, ends)
    assert all(c.graphs_kept_bytes is not None and c.graphs_kept_bytes > 0 for c in censuses)
    _assert_same(got, reference)


def test_graphs_whose_addresses_moved_are_captured_again(model_dirs, reference, monkeypatch):
    """A parked layout's rope table regrown on rank 0 (an address its graphs captured): the
    group falls back to first-use capture for that layout (and says so), outputs unchanged."""
    monkeypatch.setenv(UNRECORDED_ENV, "1")
    with Engine(str(model_dirs["llama"]), tp_size=2, flip_weights="resident", **FLIP,
                **CFG) as e:
        core = e.core
        launch = core.runner.graphs

        def seam(when: str) -> None:
            if when == "after" and core.cfg.pp_size == 2:  # tp2's model and graphs parked
                rope = core._ranks.rank0.parked[(2, 1)].rope
                rope.ensure_capacity(2 * rope.cos_cache.shape[0])

        got, censuses = _drive(e, prompts_for(300), FLIPS, seam)
        assert core.runner.graphs is not launch
    assert [c.graph_capture for c in censuses] == [
        "on first use", "on first use (parked stale)", "parked", "on first use (parked stale)"]
    _assert_same(got, reference)


def test_reload_weights_park_no_graphs(model_dirs, monkeypatch):
    """Without resident weights nothing is parked: every seam prepares new graphs."""
    monkeypatch.setenv(UNRECORDED_ENV, "1")
    with Engine(str(model_dirs["llama"]), tp_size=2, flip_weights="reload", **FLIP,
                **CFG) as e:
        _, censuses = _drive(e, prompts_for(300)[:2], {1: (1, 2), 3: (2, 1)})
        assert e.core._ranks.rank0.parked_graphs == {}
    assert [c.graph_capture for c in censuses] == ["on first use"] * 2
    assert [c.graphs_kept_bytes for c in censuses] == [None, None]


# ------------------------------------------------------------------ one runner, no ranks
@pytest.fixture
def parked(llama_dir, monkeypatch):
    """A runner's graphs (one size captured) and model, parked as a seam parks them: the
    graphs, the model, the arena, the config."""
    monkeypatch.setenv(UNRECORDED_ENV, "1")
    cfg = EngineConfig(model=str(llama_dir), device="cpu", dtype="float32",
                       max_total_tokens=256, cuda_graph_max_bs=4)
    arena = KVArena()
    runner = ModelRunner(cfg, ModelConfig.from_dir(llama_dir), lazy_graphs=True, kv_arena=arena)
    runner.graphs._capture_one(4)
    graphs = runner.park_graphs()
    model = runner.free_device_memory(keep_weights=True, graphs_parked=True)
    return graphs, model, arena, cfg


def _rebuild(cfg, model, arena, reuse) -> ModelRunner:
    return ModelRunner(cfg, ModelConfig.from_dir(cfg.model), resident=model, lazy_graphs=True,
                       kv_arena=arena, graph_reuse=reuse)


def test_unchanged_addresses_are_adopted(parked):
    graphs, model, arena, cfg = parked
    votes = []
    runner = _rebuild(cfg, model, arena, GraphReuse(graphs, lambda ok: votes.append(ok) or ok))
    assert votes == [True] and runner.graph_capture == "parked"
    assert runner.graphs is graphs and set(graphs.graphs) == {4} and graphs.pool is runner.pool


def test_a_moved_kv_pool_is_not_adopted(parked):
    """The arena re-made elsewhere (what growing it does): the pool's address moved, so the
    parked graphs are released and new ones prepared (red without the fingerprint)."""
    graphs, model, arena, cfg = parked
    held = arena.buffer  # kept alive: the new buffer cannot land at the same address
    arena.buffer = None
    votes = []
    runner = _rebuild(cfg, model, arena, GraphReuse(graphs, lambda ok: votes.append(ok) or ok))
    assert arena.buffer.data_ptr() != held.data_ptr()
    assert votes == [False] and runner.graph_capture == "on first use (parked stale)"
    assert runner.graphs is not graphs and graphs.graphs == {}  # released
    moved = graphs.addresses_with(runner.pool, runner.layout.tp_comm)
    assert moved["KV pool"] != graphs.addresses["KV pool"]


def test_one_rank_s_no_makes_every_rank_capture_again(parked):
    """A rank whose own graphs are valid still drops them when another rank's are not: a TP
    rank capturing a size on first use while its peer replays would pair collectives wrongly."""
    graphs, model, arena, cfg = parked
    runner = _rebuild(cfg, model, arena, GraphReuse(graphs, lambda ok: False))
    assert runner.graph_capture == "on first use (parked stale)"
    assert runner.graphs is not graphs and graphs.graphs == {}


def test_parked_graphs_count_their_buffers(parked):
    graphs = parked[0]
    allocated, reserved = graphs.device_bytes()
    statics = graphs.kv_indices.numel() * 8
    assert allocated == reserved and allocated > statics
    assert graphs.logits_out is not None  # one process: the last stage's sampling rank
    assert allocated >= graphs.logits_out.numel() * torch.float32.itemsize
