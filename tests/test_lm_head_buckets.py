"""An eager step's LM head meets only the row counts its build warmed.

On the H200 some new row counts of the LM head's cuBLAS GEMM waited for the GPU's queued work
to drain, and an eager (prefill or mixed) step's rows are new almost every time (`lm_head.py`,
`benchmarks/first_shape_probe.py`). These tests check the padding that prevents it on the CPU
(`bucket_rows=True` forces what runs on CUDA only): the logits are unchanged, and the GEMM
sees only `lm_head_buckets` shapes, the ones `warm` runs.
"""

from __future__ import annotations

import pytest
import torch

from phaseflip.layout import Layout
from phaseflip.model import lm_head
from phaseflip.model.lm_head import ParallelLMHead, lm_head_buckets, lm_head_rows

VOCAB, HIDDEN = 97, 16


def _head() -> ParallelLMHead:
    head = ParallelLMHead(VOCAB, HIDDEN, Layout(), torch.float32)
    head.weight.data.copy_(torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(0)))
    head.bucket_rows = True
    return head


def test_buckets_cover_every_row_count_and_stay_few():
    for rows in range(1, 3000):
        b = lm_head_rows(rows)
        assert rows <= b and b in lm_head_buckets(rows)
    assert lm_head_rows(5) == 8 and lm_head_rows(33) == 64 and lm_head_rows(1024) == 1024
    assert lm_head_rows(1025) == 1280
    assert len(lm_head_buckets(1024)) == 6 + 31  # powers of two to 32, then every 32


@pytest.mark.parametrize("rows", [1, 3, 17, 45, 130])
def test_padded_logits_equal_the_unpadded(rows):
    head = _head()
    hidden = torch.randn(rows, HIDDEN)
    got = head.logits(hidden)
    head.bucket_rows = False
    want = head.logits(hidden)
    assert got.shape == (rows, VOCAB)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_eager_steps_meet_only_warmed_shapes(monkeypatch):
    seen: list[int] = []
    real = lm_head.linear

    def spy(x, weight, *args, **kwargs):
        seen.append(x.shape[0])
        return real(x, weight, *args, **kwargs)

    monkeypatch.setattr(lm_head, "linear", spy)
    head = _head()
    assert head.warm(300) == len(lm_head_buckets(300))
    warmed = set(seen)
    seen.clear()
    for rows in range(1, 301):
        head.logits(torch.randn(rows, HIDDEN))
    assert set(seen) <= warmed
    assert len(set(seen)) == len(lm_head_buckets(300))


def test_a_graphs_static_buffer_is_not_padded():
    head = _head()
    out = torch.empty(3, head.padded_vocab)
    got = head.logits(torch.randn(3, HIDDEN), out)
    assert got.shape == (3, VOCAB) and got.data_ptr() == out.data_ptr()


def test_off_cuda_by_default_nothing_is_padded_or_warmed():
    head = _head()
    head.bucket_rows = None
    assert head.warm(64) == 0
