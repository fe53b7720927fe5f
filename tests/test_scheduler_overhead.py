"""The decode step's host fast paths give exactly what the general paths give, and the
scheduler-overhead benchmark still runs.

Each fast path (one-slot KV allocation, batched penalties, direct Rust decoding) replaced a
general one for speed only; these tests pin the results to the general path's, bit for bit.
"""

from __future__ import annotations

import random
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from phaseflip.cache.allocator import PageAllocator
from phaseflip.config import EMBEDDED_MODEL
from phaseflip.forward_batch import ForwardBatch
from phaseflip.model.loader import load_tokenizer
from phaseflip.sampling.detokenize import IncrementalDetokenizer, direct_decode
from phaseflip.sampling.params import SamplingParams
from phaseflip.sampling.sampler import (
    Sampler,
    SamplingInput,
    apply_penalties,
    apply_penalties_batch,
)
from phaseflip.scheduler.kv_cache import KVCacheManager
from phaseflip.scheduler.request import Req

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `benchmarks` is a top-level folder, not an installed package
    sys.path.insert(0, str(ROOT))

VOCAB = 64


# ---------------------------------------------------------------- KV allocation


def test_alloc_page_matches_alloc_pages() -> None:
    a, b = PageAllocator(6, 4), PageAllocator(6, 4)
    singles = [a.alloc_page() for _ in range(6)]
    batch = b.alloc_pages(5)
    assert batch is not None and singles[:5] == batch.tolist() and singles[5] is None
    assert a.free_slots == b.free_slots == 0
    a.free(a.pages_to_slots(torch.tensor([singles[2]])))
    assert a.alloc_page() == singles[2]


def _req(rid: str, prompt_len: int) -> Req:
    return Req(rid=rid, prompt_ids=list(range(1, prompt_len + 1)), params=SamplingParams(),
               eos_ids=(0,), arrival=0)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("prompt_len", [3, 4, 5])
def test_one_token_allocations_equal_bulk(page_size: int, prompt_len: int) -> None:
    """Token-by-token allocation (the decode fast path, partial last pages included) fills the
    table and the allocator exactly as one bulk allocation of the same tokens does."""
    one, bulk = (KVCacheManager(64, page_size, 4, 32, True) for _ in range(2))
    for kv, step in ((one, 1), (bulk, 11)):
        req = _req("a", prompt_len)
        assert kv.admit(req, req.num_tokens) and kv.allocate(req, prompt_len) is not None
        for _ in range(11 // step):
            slots = kv.allocate(req, step)
            assert slots is not None and slots.numel() == step
            assert torch.equal(slots, kv.table.table[req.row, req.alloc_len - step : req.alloc_len])
        assert req.alloc_len == prompt_len + 11
    assert torch.equal(one.table.table, bulk.table.table)
    assert torch.equal(one.allocator.free_page_ids(), bulk.allocator.free_page_ids())


def test_one_token_allocation_evicts_and_fails_cleanly() -> None:
    kv = KVCacheManager(8, 1, 4, 16, True)  # 7 usable slots
    first = _req("a", 4)
    assert kv.admit(first, 4) and kv.allocate(first, 4) is not None
    first.kv_len = 4
    kv.release(first)  # its 4 slots become evictable prefix-cache content
    second = _req("b", 3)
    assert kv.admit(second, 0) and kv.allocate(second, 3) is not None
    for _ in range(4):  # 3 free slots, then evictions
        assert kv.allocate(second, 1) is not None
    assert kv.allocator.free_slots == 0 and kv.tree.evictable_size() == 0
    before = second.alloc_len
    assert kv.allocate(second, 1) is None and second.alloc_len == before
    assert kv.pages_needed(second, 1) == 1 and kv.pages_needed(second, 0) == 0


@pytest.mark.parametrize("page_size", [1, 4])
def test_allocate_decode_equals_one_by_one(page_size: int) -> None:
    one, batch = (KVCacheManager(256, page_size, 8, 64, True) for _ in range(2))
    for kv in (one, batch):
        reqs = [_req(f"r{i}", 1 + 2 * i) for i in range(6)]
        for r in reqs:
            assert kv.admit(r, r.num_tokens) and kv.allocate(r, r.num_tokens) is not None
        for _ in range(9):
            if kv is one:
                assert all(kv.allocate(r, 1) is not None for r in reqs)
            else:
                assert kv.allocate_decode(reqs)
    assert torch.equal(one.table.table, batch.table.table)
    assert torch.equal(one.allocator.free_page_ids(), batch.allocator.free_page_ids())
    assert batch.allocate_decode([])


def test_allocate_decode_evicts_or_fails_whole() -> None:
    kv = KVCacheManager(9, 1, 4, 16, True)  # 8 usable slots
    old = _req("old", 4)
    assert kv.admit(old, 4) and kv.allocate(old, 4) is not None
    old.kv_len = 4
    kv.release(old)  # 4 evictable slots
    reqs = [_req("a", 1), _req("b", 1)]
    for r in reqs:
        assert kv.admit(r, 0) and kv.allocate(r, 1) is not None
    assert kv.allocate_decode(reqs) and kv.allocate_decode(reqs)  # the second one evicts
    assert kv.tree.evictable_size() == 0 and kv.allocator.free_slots == 2
    assert kv.allocate_decode(reqs) and kv.allocator.free_slots == 0
    before = kv.table.table.clone()
    assert not kv.allocate_decode(reqs)
    assert [r.alloc_len for r in reqs] == [4, 4] and torch.equal(kv.table.table, before)
    assert sorted(kv.table.table[[reqs[0].row, reqs[1].row], :4].flatten().tolist()) == list(
        range(1, 9))  # every usable slot, once


# ---------------------------------------------------------------- plans


def _plan_per_sequence(table: torch.Tensor, rows: list[int], pre: list[int], ext: list[int],
                       ids: list[int], logit_idx: list[int]) -> ForwardBatch:
    """The plan as it was built sequence by sequence (the reference)."""
    pos, locs, indices, indptr = [], [], [], [0]
    for r, s, n in zip(rows, pre, ext):
        pos.append(torch.arange(s, s + n))
        locs.append(table[r, s : s + n])
        indices.append(table[r, : s + n])
        indptr.append(indptr[-1] + s + n)
    return ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.int64), positions=torch.cat(pos),
        out_cache_loc=torch.cat(locs), extend_lens=ext, prefix_lens=pre,
        kv_indptr=torch.tensor(indptr, dtype=torch.int64), kv_indices=torch.cat(indices),
        logits_indices=torch.tensor(logit_idx, dtype=torch.int64),
        max_position=max(s + n for s, n in zip(pre, ext)) - 1,
    )


@pytest.mark.parametrize("decode", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_plan_from_table_equals_per_sequence(decode: bool, seed: int) -> None:
    rng = random.Random(seed)
    table = torch.randint(0, 1000, (12, 40), generator=torch.Generator().manual_seed(seed))
    b = rng.randrange(1, 10)
    rows = rng.sample(range(12), b)
    ext = [1 if decode else rng.randrange(1, 8) for _ in range(b)]
    pre = [rng.randrange(0, 40 - n) for n in ext]
    ids = [rng.randrange(100) for _ in range(sum(ext))]
    logit_idx = sorted(rng.sample(range(sum(ext)), rng.randrange(0, sum(ext) + 1)))
    got = ForwardBatch.from_table(table, rows, pre, ext, ids, logit_idx)
    want = _plan_per_sequence(table, rows, pre, ext, ids, logit_idx)
    assert got.rows.tolist() == rows and got.row_epochs is None  # no epochs were given
    assert got.future_pos.size == 0 and got.future_rows.size == 0  # no placeholders
    for name, value in want.__dict__.items():
        mine = getattr(got, name)
        if name in ("rows", "row_epochs", "delta", "future_pos", "future_rows"):
            continue  # the per-sequence builder knows no rows and no placeholders
        if isinstance(value, torch.Tensor):
            assert torch.equal(mine, value) and mine.dtype == value.dtype, name
        else:
            assert mine == value, name
    table.add_(1)  # the plan owns its tensors: later table writes do not reach it
    assert torch.equal(got.kv_indices, want.kv_indices)
    assert torch.equal(got.out_cache_loc, want.out_cache_loc)


def test_req_tokens_equals_all_ids_slice() -> None:
    req = _req("a", 4)
    req.output_ids += [7, 8, 9]
    for start in range(8):
        for end in range(start, 9):
            assert req.tokens(start, end) == req.all_ids[start:end]


# ---------------------------------------------------------------- penalties


def _random_inputs(rng: random.Random, rows: int) -> list[SamplingInput]:
    out = []
    for _ in range(rows):
        p = SamplingParams(
            temperature=rng.choice([0.0, 0.7]),
            repetition_penalty=rng.choice([1.0, 1.3, 0.8, 2]),
            frequency_penalty=rng.choice([0.0, 0.5, -1.25]),
            presence_penalty=rng.choice([0.0, 0.3]),
            logit_bias=rng.choice([None, {}, {rng.randrange(VOCAB): rng.uniform(-5, 5),
                                             rng.randrange(VOCAB): 100.0}]),
            min_new_tokens=rng.choice([0, 3]), stop_token_ids=rng.choice([[], [5, 7]]),
        )
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 12))]
        output = [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 8))]
        out.append(SamplingInput(p, prompt, output, (1,)))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_batched_penalties_bitwise_equal_per_row(seed: int) -> None:
    rng = random.Random(seed)
    logits = torch.randn(24, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    inputs = _random_inputs(rng, 24)
    # all rows (edited in place as one block) or a subset (gathered and written back)
    rows = list(range(24)) if seed < 2 else sorted(rng.sample(range(24), rng.randrange(1, 24)))
    expected = logits.clone()
    for r in rows:
        apply_penalties(expected[r], inputs[r].params, inputs[r].prompt_ids, inputs[r].output_ids)
    got = logits.clone()
    apply_penalties_batch(got, rows, [inputs[r] for r in rows])
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))


def test_batched_penalties_shared_params_bitwise_equal() -> None:
    """Every row with the same penalties (the usual batch): edited as one [B, V] block."""
    rng = random.Random(7)
    params = SamplingParams(repetition_penalty=1.1, frequency_penalty=0.5, presence_penalty=0.3)
    inputs = [SamplingInput(params, [rng.randrange(VOCAB) for _ in range(9)],
                            [rng.randrange(VOCAB) for _ in range(1 + i)]) for i in range(8)]
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(7)) * 3
    expected = logits.clone()
    for r, inp in enumerate(inputs):
        apply_penalties(expected[r], params, inp.prompt_ids, inp.output_ids)
    apply_penalties_batch(logits, list(range(8)), inputs)
    assert torch.equal(logits.view(torch.int32), expected.view(torch.int32))


@pytest.mark.parametrize("seed", range(3))
def test_sampler_tokens_equal_per_row_reference(seed: int) -> None:
    """The sampler's tokens are those of the per-row reference edits (penalties, then the
    min-tokens ban), for greedy and random rows alike (same sampler seed, same noise)."""
    rng = random.Random(100 + seed)
    logits = torch.randn(16, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    inputs = _random_inputs(rng, 16)
    edited = logits.clone()
    plain = []
    for r, inp in enumerate(inputs):
        apply_penalties(edited[r], inp.params, inp.prompt_ids, inp.output_ids)
        if len(inp.output_ids) < inp.params.min_new_tokens:
            edited[r, [*inp.eos_token_ids, *inp.params.stop_token_ids]] = float("-inf")
        bare = replace(inp.params, repetition_penalty=1.0, frequency_penalty=0.0,
                       presence_penalty=0.0, logit_bias=None, min_new_tokens=0)
        plain.append(SamplingInput(bare, inp.prompt_ids, inp.output_ids, inp.eos_token_ids))
    got = Sampler(seed=3).sample(logits, inputs).token_ids
    assert got == Sampler(seed=3).sample(edited, plain).token_ids


def test_penalty_history_outside_vocab_raises() -> None:
    inp = SamplingInput(SamplingParams(repetition_penalty=1.5), [VOCAB], [])
    with pytest.raises(IndexError):
        apply_penalties_batch(torch.zeros(1, VOCAB), [0], [inp])


# ---------------------------------------------------------------- detokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(EMBEDDED_MODEL)


@pytest.mark.parametrize("skip", [True, False])
def test_direct_decode_equals_tokenizer_decode(tokenizer, skip: bool) -> None:
    decode = direct_decode(tokenizer)
    assert decode is not None
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 6))]
        ids += [0] * rng.randrange(2)  # the special token
        assert decode(ids, skip) == tokenizer.decode(ids, skip_special_tokens=skip)


def test_direct_decode_only_for_stock_tokenizers(tokenizer) -> None:
    class Shouting(type(tokenizer)):
        def _decode(self, *args, **kwargs) -> str:  # a subclass with its own text
            return super()._decode(*args, **kwargs).upper()

    shouting = Shouting.__new__(Shouting)
    shouting.__dict__.update(tokenizer.__dict__)
    assert direct_decode(shouting) is None
    cleaning = type(tokenizer).__new__(type(tokenizer))
    cleaning.__dict__.update(tokenizer.__dict__)
    cleaning.clean_up_tokenization_spaces = True
    assert direct_decode(cleaning) is None

    class Plain:
        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            return "".join(chr(97 + i % 26) for i in ids)

    assert direct_decode(Plain()) is None
    detok = IncrementalDetokenizer(Plain(), [])
    assert detok.append([0, 1]) == "ab" and detok.text == "ab"


# ---------------------------------------------------------------- benchmark


def test_bench_scheduler_runs(tmp_path: Path) -> None:
    from benchmarks import bench_scheduler

    out = tmp_path / "sched.json"
    result = bench_scheduler.main([
        "--device", "cpu", "--null-forward", "--num-requests", "4", "--steps", "2",
        "--warmup-steps", "1", "--sampling", "greedy,penalties", "--out", str(out),
    ])
    assert out.is_file()
    assert [(r["num_requests"], r["sampling"]) for r in result["results"]] == [
        (4, "greedy"), (4, "penalties")]
    for r in result["results"]:
        total = r["phases"]["total"]["wall_ms"]
        assert total["n"] == 2 and total["p50"] > 0
        assert set(r["phases"]) == set(bench_scheduler.PHASES)
