"""A run-ahead plan cut into micro-batches (PP stage 0): each part gets its placeholders' host
indices, so its tokens are filled by an indexed copy instead of a device-side resolve, and
they are the tokens the whole plan resolves to."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from phaseflip.cache.kv_pool import ReqToTokenTable
from phaseflip.distributed.stage import _place_futures
from phaseflip.forward_batch import ForwardBatch


@pytest.mark.parametrize("parts", [2, 3, 4])
@pytest.mark.parametrize("seed", range(4))
def test_micro_batches_fill_their_placeholders_like_the_whole_plan(parts: int, seed: int):
    rng = np.random.default_rng(seed)
    table = ReqToTokenTable(12, 64)
    rows = [table.alloc() for _ in range(10)]
    ext = rng.integers(1, 4, len(rows)).tolist()  # decode rows and short extends, mixed
    pre = rng.integers(2, 20, len(rows)).tolist()
    for r, p, e in zip(rows, pre, ext):
        table.write(r, 0, torch.from_numpy(rng.integers(1, 999, p + e)))
    # a placeholder for some sequences' first new token (-1 - row of the sampled tokens)
    ids = rng.integers(1, 999, sum(ext))
    firsts = np.cumsum(ext) - ext
    chosen = firsts[rng.random(len(firsts)) < 0.7]
    ids[chosen] = -1 - rng.permutation(len(rows))[: len(chosen)]
    plan = ForwardBatch.from_table(table.table, rows, pre, ext, ids.tolist(),
                                   list(np.cumsum(ext) - 1), table.epochs)
    future = torch.from_numpy(rng.integers(1000, 2000, len(rows)))
    want = plan.with_future_tokens(future).input_ids
    pieces = plan.split(parts)
    _place_futures(plan, pieces)
    assert all(p.future_pos is not None for p in pieces)  # host indices: no device resolve
    got = torch.cat([p.with_future_tokens(future).input_ids for p in pieces])
    assert torch.equal(got, want)
    assert (want > 0).all()
