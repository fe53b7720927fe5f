"""Triton attention backend against the torch reference backend (the oracle).

Runs on CUDA when present, else on the CPU through Triton's interpreter (`TRITON_INTERPRET=1`,
set here before the kernels are defined); skipped when triton is not installed. Interpreter
block sizes are 16 so that tiny shapes still cross key blocks, tile boundaries and split-K
chunks. Every check draws fresh random q/k/v and a random prefix in the pool, uses shuffled
(non-contiguous) slots, and NaN-fills the output first so an unwritten row fails.

Bounds on ||out - ref|| / ||ref||: fp32 1e-5 (the kernels use IEEE fp32 dots, no tf32; measured
~1e-7 on CPU), bf16/fp16 1e-2 (P is rounded to bf16 before the PV dot, as in any flash kernel).
"""

from __future__ import annotations

import pytest
import torch
from triton_interpreter import interpret_without_cuda

interpret_without_cuda()  # before triton is imported
pytest.importorskip("triton")

from phaseflip.attention.torch_ref import TorchRefAttention  # noqa: E402
from phaseflip.attention.triton_backend import TritonAttention  # noqa: E402
from phaseflip.cache.kv_pool import KVPool  # noqa: E402
from phaseflip.forward_batch import ForwardBatch  # noqa: E402
from phaseflip.kernels import attention as kernels  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


BOUND = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def make_batch(seqs: list[tuple[int, int]], gen: torch.Generator) -> ForwardBatch:
    """seqs: (prefix_len, extend_len) each; slots are a random permutation of 1..N (0 = pad)."""
    total = sum(p + e for p, e in seqs)
    perm = (torch.randperm(total + 5, generator=gen) + 1)[:total]
    kv_indptr, out_loc, positions = [0], [], []
    for p, e in seqs:
        start = kv_indptr[-1]
        out_loc.append(perm[start + p : start + p + e])
        positions.extend(range(p, p + e))
        kv_indptr.append(start + p + e)
    num_tokens = sum(e for _, e in seqs)
    return ForwardBatch(
        input_ids=torch.zeros(num_tokens, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        out_cache_loc=torch.cat(out_loc),
        extend_lens=[e for _, e in seqs],
        prefix_lens=[p for p, _ in seqs],
        kv_indptr=torch.tensor(kv_indptr, dtype=torch.int64),
        kv_indices=perm.clone(),
        logits_indices=torch.tensor([], dtype=torch.int64),
        max_position=max(positions),
    ).to(DEVICE)


def run_case(
    seqs: list[tuple[int, int]],
    *,
    num_kv_heads: int = 2,
    group: int = 4,
    head_dim: int = 64,
    dtype: torch.dtype = torch.float32,
    window: int | None = None,
    backend: TritonAttention | None = None,
    layers: int = 1,
    seed: int = 0,
) -> float:
    """Worst relative error over `layers` forwards of one batch (fresh q/k/v per layer)."""
    gen = torch.Generator().manual_seed(seed)
    batch = make_batch(seqs, gen)
    num_heads = num_kv_heads * group
    num_slots = int(batch.kv_indices.max()) + 8
    pools = [KVPool(num_slots, (0, layers), num_kv_heads, head_dim, dtype, DEVICE)
             for _ in range(2)]
    for i in range(layers):  # random prefix contents (and garbage in unused slots)
        for src in ("k", "v"):
            data = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen)
            for pool in pools:
                getattr(pool, src)[i].copy_(data)
    backend = backend or TritonAttention()
    ref = TorchRefAttention()
    worst = 0.0
    for layer in range(layers):
        t = batch.num_tokens
        q = torch.randn(t, num_heads, head_dim, generator=gen).to(DEVICE, dtype)
        k = torch.randn(t, num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
        v = torch.randn(t, num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
        scale = head_dim**-0.5
        want = ref.forward(layer, q, k, v, batch, pools[0], scale, window)
        out = torch.full((t, num_heads * head_dim), float("nan"), dtype=dtype, device=DEVICE)
        got = backend.forward(layer, q, k, v, batch, pools[1], scale, window, out=out)
        assert got.data_ptr() == out.data_ptr() and got.shape == want.shape
        assert torch.isfinite(got).all(), "unwritten or non-finite output rows"
        assert torch.equal(pools[0].k[layer], pools[1].k[layer])
        assert torch.equal(pools[0].v[layer], pools[1].v[layer])
        err = ((got.float() - want.float()).norm() / want.float().norm()).item()
        worst = max(worst, err)
    assert worst < BOUND[dtype], f"relative error {worst:.3g} >= {BOUND[dtype]}"
    return worst


DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_only(dtype):
    run_case([(5, 1), (33, 1), (0, 1), (17, 1)], dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_extend_without_prefix(dtype):
    run_case([(0, 7), (0, 21), (0, 1)], dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_extend_with_cached_prefix(dtype):
    run_case([(13, 5), (40, 17), (3, 1)], dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_decode_and_extend(dtype):
    run_case([(10, 1), (0, 9), (25, 1), (7, 12)], dtype=dtype)


@pytest.mark.parametrize("group", [1, 4])
def test_extend_every_diagonal_alignment(group):
    # Prefixes 0..17 put tile starts at every offset within a 16-key block, so each possible
    # split between the unmasked blocks and the masked diagonal blocks is exercised.
    seqs = [(p, 6 + p % 5) for p in range(18)]
    run_case(seqs, group=group, num_kv_heads=1, head_dim=64, seed=group)


def test_single_sequence_of_length_one():
    run_case([(0, 1)])
    run_case([(0, 1)], group=8, num_kv_heads=1, head_dim=128)


@pytest.mark.parametrize("splits", [1, 2, 3, 7])
def test_decode_split_k_chunk_boundaries(splits):
    # Interpreter block_n is 16, so a chunk is 16k keys: lengths 16/17/31/50/61 put the last
    # key exactly on, just past and just before chunk edges, and leave some splits empty.
    backend = TritonAttention(decode_splits=splits, decode_min_chunk=1)
    seqs = [(15, 1), (16, 1), (30, 1), (49, 1), (60, 1), (0, 1)]
    run_case(seqs, backend=backend, seed=splits)


def test_decode_planner_splits_long_contexts():
    plan = kernels.plan_decode(1, 8, 1, 4096, 132)
    assert plan.num_splits == 16 and plan.min_chunk == 128 == kernels.MIN_CHUNK
    assert kernels.plan_decode(1, 8, 1, 1056, 132).num_splits == 9  # 128-key chunks
    assert kernels.plan_decode(1, 8, 1, 1 << 20, 132).num_splits == kernels.MAX_SPLITS == 16
    assert kernels.plan_decode(256, 8, 1, 4096, 132).num_splits == 1
    assert kernels.plan_decode(1, 8, 1, 1, 132).num_splits == 1


def test_decode_plan_for_the_longest_context_serves_short_ones():
    # A CUDA graph plans once for the model's context limit; the kernel then cuts each
    # sequence's own chunks, so short sequences under a many-split plan are still exact.
    backend = TritonAttention(decode_splits=7, decode_min_chunk=16)
    run_case([(2, 1), (0, 1), (40, 1), (100, 1)], backend=backend, seed=11)


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gqa_ratios_and_head_dims(group, head_dim):
    kvh = 2 if group < 8 else 1
    run_case([(6, 1), (0, 5), (20, 1), (9, 8)], group=group, num_kv_heads=kvh,
             head_dim=head_dim, seed=group * head_dim)
    run_case([(6, 1), (35, 1)], group=group, num_kv_heads=kvh, head_dim=head_dim,
             backend=TritonAttention(decode_splits=2, decode_min_chunk=1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_sliding_window(dtype):
    # Windows shorter than the context, on decode (split and unsplit) and on extend tiles
    # whose first rows see nothing in the first key blocks.
    run_case([(40, 1), (3, 1), (57, 1)], window=7, dtype=dtype)
    run_case([(40, 1), (3, 1), (57, 1)], window=20, dtype=dtype,
             backend=TritonAttention(decode_splits=3, decode_min_chunk=1))
    run_case([(30, 12), (0, 40), (5, 1)], window=9, dtype=dtype)


def test_window_rows_that_see_nothing_in_early_blocks():
    # A tile spanning more query positions than a key block (32 rows of one head, 16 keys):
    # its last rows' windows start past the first key block, which they must skip without
    # NaNs (the -inf - -inf guard of the online softmax).
    backend = TritonAttention(extend_config=kernels.KernelConfig(32, 16, 4, 1))
    run_case([(3, 40), (20, 33)], group=1, num_kv_heads=2, window=5, backend=backend)


def test_odd_head_dim_and_mha():
    run_case([(9, 3), (4, 1)], group=1, num_kv_heads=3, head_dim=80)
    run_case([(9, 1), (4, 1)], group=2, num_kv_heads=2, head_dim=80)


def test_metadata_reused_across_layers_and_rebuilt_per_batch():
    backend = TritonAttention()
    run_case([(12, 4), (3, 1)], backend=backend, layers=3)
    first = backend._meta
    assert first is not None and first.qo_indptr is not None
    run_case([(12, 1), (3, 1)], backend=backend, layers=2)  # a new batch: new metadata
    assert backend._meta is not first and backend._meta.is_decode


def test_large_decode_batch_launches_longest_first(monkeypatch):
    # 12 sequences x 2 KV heads: more programs than two waves of the interpreter's 8 "SMs",
    # so the backend sorts (`orders_decode`) and the kernel reads rows through the order
    sms = kernels.num_sms(DEVICE)
    lens = [5, 40, 0, 17, 33, 2, 60, 9, 1, 26, 48, 12] * (1 + sms // 12)  # (12 on the CPU)
    assert kernels.orders_decode(len(lens), 2, 1, sms)
    launched = []
    decode = kernels.decode_attention

    def record(*args, **kwargs):
        launched.append(kwargs.get("order"))
        return decode(*args, **kwargs)

    monkeypatch.setattr(kernels, "decode_attention", record)
    backend = TritonAttention()
    run_case([(n, 1) for n in lens], backend=backend, layers=2)
    assert len(launched) == 2 and all(o is backend._meta.order for o in launched)
    want = sorted(range(len(lens)), key=lambda i: -lens[i])
    assert [lens[i] for i in backend._meta.order.tolist()] == [lens[i] for i in want]


@pytest.mark.parametrize("splits", [None, 3])
@pytest.mark.parametrize("window", [None, 9])
def test_mixed_batch_one_token_sequences_take_the_decode_kernel(splits, window):
    # prefills and decodes in one batch: the decodes go to the decode kernel (split or not,
    # windowed or not), the extend kernel gets tiles for the prefills only; both match the
    # reference, and so does the batch with the route off
    seqs = [(30, 1), (0, 20), (12, 1), (5, 7), (40, 1), (0, 1)]
    for mixed in (True, False):
        backend = TritonAttention(mixed_decode=mixed, decode_splits=splits)
        run_case(seqs, backend=backend, window=window, layers=2)
        tiles = next(v for k, v in backend._meta.by_layout.items() if k[0] == "tiles")
        tiled = set(tiles[0].tolist())
        assert tiled == ({1, 3} if mixed else set(range(len(seqs))))


def test_any_launch_order_gives_the_same_rows():
    gen = torch.Generator().manual_seed(3)
    lens = [7, 31, 2, 19, 44, 1]
    total = sum(lens)
    cache = torch.randn(total + 4, 2, 32, generator=gen).to(DEVICE)
    q = torch.randn(len(lens), 8, 32, generator=gen).to(DEVICE)
    indptr = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device=DEVICE)
    indices = torch.randperm(total, generator=gen).to(DEVICE)
    plan = kernels.plan_decode(len(lens), 2, 1, max(lens), 8, num_splits=2, min_chunk=16)
    base = kernels.decode_attention(q, cache, cache, indptr, indices, 0.2, plan)
    order = kernels.decode_order(indptr)
    assert order.tolist() == sorted(range(len(lens)), key=lambda i: -lens[i])
    for o in (order, torch.randperm(len(lens), generator=gen).to(DEVICE)):
        got = kernels.decode_attention(q, cache, cache, indptr, indices, 0.2, plan, order=o)
        assert torch.equal(got, base)
    with pytest.raises(ValueError, match="order must be"):
        kernels.decode_attention(q, cache, cache, indptr, indices, 0.2, plan, order=order[:3])


def test_a_reused_decode_batch_is_sorted_again_at_every_forward():
    # a CUDA graph reuses one batch object (its metadata) for every replay: the order must be
    # recomputed by each forward (at its first layer), not kept from the capture's warm-up
    backend = TritonAttention()
    lens = [5, 40, 0, 17, 33, 2, 60, 9, 1, 26, 48, 12] * (1 + kernels.num_sms(DEVICE) // 12)
    gen = torch.Generator().manual_seed(0)
    batch = make_batch([(n, 1) for n in lens], gen)
    pool = KVPool(int(batch.kv_indices.max()) + 8, (0, 2), 2, 32, torch.float32, DEVICE)
    q = torch.randn(len(lens), 8, 32, generator=gen).to(DEVICE)
    kv = torch.randn(len(lens), 2, 32, generator=gen).to(DEVICE)
    for layer in (0, 1):
        backend.forward(layer, q, kv, kv, batch, pool, 0.2)
    first = backend._meta.order.tolist()
    # the next replay: same batch object, the lengths reversed in the static buffer
    new_lens = list(reversed(lens))
    batch.kv_indptr.copy_(torch.tensor([0] + torch.tensor(new_lens).cumsum(0).tolist()))
    for layer in (0, 1):
        backend.forward(layer, q, kv, kv, batch, pool, 0.2)
    again = backend._meta.order.tolist()
    assert again != first
    assert [new_lens[i] for i in again] == sorted(new_lens, reverse=True)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="larger shapes are too slow interpreted")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gpu_long_contexts(dtype):
    # Real block sizes (64-128): several full blocks, several diagonal blocks, planner splits.
    run_case([(700, 1), (1500, 1), (0, 1), (130, 1)], num_kv_heads=8, head_dim=128,
             dtype=dtype)
    run_case([(0, 300), (512, 129), (77, 1), (1000, 1)], num_kv_heads=8, head_dim=128,
             dtype=dtype)
    run_case([(0, 500), (900, 1)], num_kv_heads=4, group=8, head_dim=128, window=128,
             dtype=dtype)
