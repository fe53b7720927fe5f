"""HiCache transfers on a CUDA device (skipped without CUDA): the copy-stream path of
`KVTransferEngine` (pinned private frames and registered shared frames), its ordering, and the
engine's outputs with HiCache on, including a flush served from the host tier."""

from __future__ import annotations

import pytest
import torch

from phaseflip import SamplingParams
from phaseflip.cache.hicache import HostFrames, KVTransferEngine, TransferOrders, rank_slice
from phaseflip.cache.hicache.frames import page_geometry
from phaseflip.cache.kv_pool import KVPool
from phaseflip.layout import Layout
from tests.conftest import prompts_for

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
L, H, D, P = 4, 4, 64, 16
GEO = page_geometry(L, H, D, torch.bfloat16, P)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("tp", [1, 2])
def test_cuda_store_and_load_round_trip(shared, tp, tmp_path):
    """Ranks' slices go device -> frame -> device on the copy stream; what comes back equals
    what went out, for pinned private frames and for registered shared ones."""
    cuda = torch.device("cuda")
    frames = (HostFrames.create_shared(tmp_path / "f", 4, GEO.total_size) if shared
              else HostFrames.private(4, GEO.total_size))
    try:
        # Shared frames are page-locked with cudaHostRegister where the platform allows it
        # (not in the lent H200's sandbox: copies then run synchronously, still correct).
        assert frames.pinned or shared
        src_slots = list((torch.randperm(255)[: 4 * P] + 1).view(4, P))
        dst_slots = list((torch.randperm(255)[: 4 * P] + 1).view(4, P))
        for rank in range(tp):
            part = rank_slice(Layout(tp_rank=rank, tp_size=tp), L, H)
            pool = KVPool(256, (0, L), len(part.heads), D, torch.bfloat16, cuda)
            for t in pool.k + pool.v:
                t.normal_()
            back = KVPool(256, (0, L), len(part.heads), D, torch.bfloat16, cuda)
            out = KVTransferEngine(pool, frames, GEO, part, cuda)
            into = KVTransferEngine(back, frames, GEO, part, cuda)
            out.execute(TransferOrders(store_frames=[3, 1, 0, 2], store_slots=src_slots))
            out.order_before_forward()  # the next kernel on the compute stream waits for it
            handle = into.execute(TransferOrders(load_frames=[3, 1, 0, 2],
                                                 load_slots=dst_slots))
            handle.wait()
            for s, d in zip(src_slots, dst_slots):
                for a, b in zip(back.k + back.v, pool.k + pool.v):
                    assert torch.equal(a[d.cuda()], b[s.cuda()])
            out.close()
            into.close()
    finally:
        frames.close()


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_cuda_engine_outputs_identical_and_served_from_host(policy, llama_dir, make_engine):
    plain = make_engine(llama_dir, device="cuda", dtype="float32")
    prompts = [p for p in prompts_for(plain.model_config.vocab_size) if len(p) >= 17]
    want = [o.token_ids for o in plain.generate(prompts, GREEDY, use_tqdm=False)]
    engine = make_engine(llama_dir, device="cuda", dtype="float32", enable_hicache=True,
                         hicache_page_size=8, hicache_write_policy=policy)
    assert [o.token_ids for o in engine.generate(prompts, GREEDY, use_tqdm=False)] == want
    engine.core.hicache.flush()
    engine.core.kv.tree.evict_all_and_reset()
    assert [o.token_ids for o in engine.generate(prompts, GREEDY, use_tqdm=False)] == want
    assert engine.core.hicache.stats.host_hit_tokens > 0
