"""Two decode halves in flight (`model/decode_overlap.py`): the same logits as the whole batch.

On the CPU the halves run one after the other on one stream (graphs unrecorded, the Triton
kernels in the interpreter); with CUDA the graphs are recorded with each half's attention on
a second stream, so the same assertions check the cross-stream ordering for real.
"""

from __future__ import annotations

import pytest
import torch
from triton_interpreter import interpret_without_cuda

interpret_without_cuda()  # before triton is imported
pytest.importorskip("triton")

from phaseflip.attention.triton_backend import TritonAttention  # noqa: E402
from phaseflip.config import EngineConfig  # noqa: E402
from phaseflip.layout import Layout  # noqa: E402
from phaseflip.model.config import ModelConfig  # noqa: E402
from phaseflip.model.cuda_graph import DecodeGraphs  # noqa: E402
from phaseflip.model.decode_overlap import DecodeHalves, forward_halves, split_decode  # noqa: E402
from phaseflip.model.runner import ModelRunner  # noqa: E402
from tests.test_cuda_graph import CUDA, DEVICE, _contexts, _plan  # noqa: E402


def _slots_of(batch) -> list[list[int]]:
    ip, idx = batch.kv_indptr.tolist(), batch.kv_indices.tolist()
    return [idx[a:b] for a, b in zip(ip, ip[1:])]


def _decode(runner: ModelRunner, lengths: list[int], seed: int):
    ctx = _contexts(lengths, seed=seed)
    runner.forward(_plan([(t[:-1], s[:-1], 0) for t, s in ctx if len(t) > 1], decode=False))
    return _plan([(t[-1:], s, len(t) - 1) for t, s in ctx], decode=True)


@pytest.mark.parametrize("b", [2, 5, 8])
def test_the_halves_read_every_sequence_s_own_slots(b):
    """Each half keeps the whole kv_indices and its rows of kv_indptr (absolute offsets), so
    its sequences read exactly the slots they read in the whole batch; every tensor a view."""
    ctx = _contexts([3 + 2 * i for i in range(b)], seed=b)
    batch = _plan([(t[-1:], s, len(t) - 1) for t, s in ctx], decode=True)
    a, z = split_decode(batch)
    assert a.batch_size + z.batch_size == b and a.batch_size == b // 2
    assert _slots_of(a) + _slots_of(z) == _slots_of(batch)
    assert torch.equal(torch.cat([a.positions, z.positions]), batch.positions)
    assert torch.equal(torch.cat([a.out_cache_loc, z.out_cache_loc]), batch.out_cache_loc)
    assert z.kv_indptr.data_ptr() == batch.kv_indptr[a.batch_size:].data_ptr()
    assert z.kv_indices is batch.kv_indices


def test_a_prompt_or_a_single_sequence_is_not_halved():
    ctx = _contexts([4, 6], seed=3)
    with pytest.raises(ValueError, match="decode batch"):
        split_decode(_plan([(t, s, 0) for t, s in ctx], decode=False))
    with pytest.raises(ValueError, match="two or more"):
        split_decode(_plan([(t[-1:], s, len(t) - 1) for t, s in ctx[:1]], decode=True))


@pytest.mark.parametrize("lengths", [[5, 1, 40], [3, 70, 9, 2, 31], [12] * 8, [7, 30]])
def test_halves_replay_matches_the_whole_batch(runner, lengths):
    """Every captured size from 2 up runs as halves; the logits are the eager forward's."""
    graphs = DecodeGraphs(runner.model, runner.pool, TritonAttention(decode_min_chunk=16),
                          max_bs=8, max_context=256, max_kv_tokens=runner.num_slots,
                          record=CUDA, halves_min_bs=2)
    graphs.capture()
    assert all(c.halves is not None for bs, c in graphs.graphs.items() if bs >= 2)
    decode = _decode(runner, lengths, seed=len(lengths))
    want = runner.forward(decode)
    got = graphs.replay_logits(decode)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    again = graphs.replay_logits(decode)  # a second replay: the K/V rows rewritten alike
    torch.testing.assert_close(again, want, rtol=1e-4, atol=1e-4)


def test_forward_halves_equals_the_layers_on_one_stream(runner):
    decode = _decode(runner, [9, 4, 17, 2, 6], seed=11)
    model, pool = runner.model, runner.pool
    with torch.inference_mode():
        whole = model.forward_layers(decode.to(DEVICE), pool, TritonAttention())
        halves = DecodeHalves(split_decode(decode.to(DEVICE)), None)
        got = forward_halves(model, halves, pool, TritonAttention())
    torch.testing.assert_close(got[0] + got[1], whole[0] + whole[1], rtol=1e-5, atol=1e-5)


def test_halves_are_one_rank_only(llama_dir):
    """A pipeline stage (or a TP rank) never runs halves: its graphs capture whole batches,
    and the forward refuses them."""
    cfg = EngineConfig(model=str(llama_dir), device=DEVICE, dtype="float32",
                       attention_backend="torch", max_total_tokens=256, disable_cuda_graph=True)
    stage = ModelRunner(cfg, ModelConfig.from_dir(llama_dir), Layout(pp_rank=0, pp_size=2))
    graphs = DecodeGraphs(stage.model, stage.pool, TritonAttention(), max_bs=4,
                          max_context=64, max_kv_tokens=stage.num_slots, record=False,
                          halves_min_bs=2)
    assert graphs.halves_min_bs == 0
    ctx = _contexts([3, 4], seed=5)
    batch = _plan([(t[-1:], s, len(t) - 1) for t, s in ctx], decode=True)
    with pytest.raises(ValueError, match="one rank"):
        forward_halves(stage.model, DecodeHalves(split_decode(batch), None), stage.pool,
                       TritonAttention())
