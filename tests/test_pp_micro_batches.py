"""Pipeline micro-batches cut by tokens: one long prompt is cut into pieces that pipeline.

A piece of sequence i covering its new tokens [a, b) runs as a sequence with prefix
prefix_lens[i] + a, extend b - a and the first prefix_lens[i] + b slots of i's context; it
reads the earlier pieces' K/V from the pool, where the same stage wrote them one micro-batch
before. Checked three ways: the plan arithmetic on hand-built plans, the model's logits (whole
plan vs. its pieces in order, torch reference and Triton attention), and pp=2 over gloo
against the single-process engine.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from triton_interpreter import interpret_without_cuda

interpret_without_cuda()  # before triton is imported (the Triton case below)

from phaseflip import Engine, SamplingParams  # noqa: E402
from phaseflip.config import EngineConfig  # noqa: E402
from phaseflip.distributed.driver import PARTS_BY_TOKENS_ENV  # noqa: E402
from phaseflip.distributed.stage import StageExecutor  # noqa: E402
from phaseflip.errors import InvalidRequestError  # noqa: E402
from phaseflip.forward_batch import ForwardBatch  # noqa: E402
from phaseflip.model.config import ModelConfig  # noqa: E402
from phaseflip.model.runner import ModelRunner  # noqa: E402

# (prefix_len, extend_len): decodes, a long fresh extend, prefix hits, one-token extends
SEQS = [(7, 1), (0, 300), (50, 40), (12, 1), (30, 90), (3, 2)]


def make_plan(seqs: list[tuple[int, int]], logit_rows: str = "mixed",
              seed: int = 0) -> ForwardBatch:
    """A plan as the scheduler builds it (`from_table`), on distinct shuffled slots. Logits
    rows: the last token of every sequence, plus every token of sequence 1 ("mixed", as a
    prompt-logprobs request has), or every token ("all")."""
    g = torch.Generator().manual_seed(seed)
    width = max(p + e for p, e in seqs)
    table = (torch.randperm(len(seqs) * width, generator=g) + 1).reshape(len(seqs), width)
    ids = torch.randint(1, 300, (sum(e for _, e in seqs),), generator=g).tolist()
    rows, end = [], 0
    for i, (_, e) in enumerate(seqs):
        if logit_rows == "all" or (logit_rows == "mixed" and i == 1):
            rows += range(end, end + e)
        else:
            rows.append(end + e - 1)
        end += e
    return ForwardBatch.from_table(table, list(range(len(seqs))), [p for p, _ in seqs],
                                   [e for _, e in seqs], ids, rows)


def split_by_sequences(plan: ForwardBatch, parts: int) -> list[ForwardBatch]:
    """The split before token cuts (whole sequences only): decode plans must still cut so."""
    parts = max(1, min(parts, plan.batch_size))
    if parts == 1:
        return [plan]
    bounds = [round(i * plan.batch_size / parts) for i in range(parts + 1)]
    tok = [0]
    for n in plan.extend_lens:
        tok.append(tok[-1] + n)
    out = []
    for a, b in zip(bounds, bounds[1:]):
        t0, t1 = tok[a], tok[b]
        k0, k1 = int(plan.kv_indptr[a]), int(plan.kv_indptr[b])
        li = plan.logits_indices
        out.append(ForwardBatch(
            input_ids=plan.input_ids[t0:t1], positions=plan.positions[t0:t1],
            out_cache_loc=plan.out_cache_loc[t0:t1], extend_lens=plan.extend_lens[a:b],
            prefix_lens=plan.prefix_lens[a:b], kv_indptr=plan.kv_indptr[a:b + 1] - k0,
            kv_indices=plan.kv_indices[k0:k1], logits_indices=li[(li >= t0) & (li < t1)] - t0,
            max_position=int(plan.positions[t0:t1].max()),
        ))
    return out


def expected_pieces(plan: ForwardBatch, t0: int, t1: int) -> list[tuple[int, int, int]]:
    """(sequence, a, b) for every sequence with new tokens in [t0, t1), token by token."""
    pieces: list[tuple[int, int, int]] = []
    start = 0
    for i, e in enumerate(plan.extend_lens):
        a, b = max(t0 - start, 0), min(t1 - start, e)
        if a < b:
            pieces.append((i, a, b))
        start += e
    return pieces


def assert_split_is_exact(plan: ForwardBatch, parts: int) -> list[ForwardBatch]:
    got = plan.split(parts)
    assert len(got) == min(parts, plan.num_tokens)
    sizes = [p.num_tokens for p in got]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1, sizes
    for name in ("input_ids", "positions", "out_cache_loc"):
        assert torch.equal(torch.cat([getattr(p, name) for p in got]), getattr(plan, name))
    t0, logit_rows = 0, []
    for part in got:
        t1 = t0 + part.num_tokens
        pieces = expected_pieces(plan, t0, t1)
        assert part.extend_lens == [b - a for _, a, b in pieces]
        assert part.prefix_lens == [plan.prefix_lens[i] + a for i, a, _ in pieces]
        assert part.kv_indptr[0] == 0 and part.kv_indptr[-1] == part.kv_indices.numel()
        for j, (i, _, b) in enumerate(pieces):
            k = int(plan.kv_indptr[i])
            want = plan.kv_indices[k : k + plan.prefix_lens[i] + b]
            assert torch.equal(part.kv_indices[part.kv_indptr[j] : part.kv_indptr[j + 1]], want)
        assert part.max_position == int(part.positions.max())
        assert part.is_decode == all(b - a == 1 for _, a, b in pieces)
        logit_rows.append(part.logits_indices + t0)
        assert ((part.logits_indices >= 0) & (part.logits_indices < part.num_tokens)).all()
        t0 = t1
    assert torch.equal(torch.cat(logit_rows), plan.logits_indices)
    return got


@pytest.mark.parametrize("parts", [1, 2, 3, 5, 8, 77, 434, 1000])
@pytest.mark.parametrize("logit_rows", ["mixed", "all", "last"])
def test_token_split_cuts_sequences_into_pieces(parts, logit_rows):
    plan = make_plan(SEQS, logit_rows)
    got = assert_split_is_exact(plan, parts)
    if parts == 2:  # 434 tokens: the 300-token extend (tokens 1..300) straddles token 217
        assert got[0].extend_lens == [1, 216] and got[0].prefix_lens == [7, 0]
        assert got[1].extend_lens[0] == 84 and got[1].prefix_lens[0] == 216


@pytest.mark.parametrize("seqs", [[(0, 1)], [(0, 5)], [(4, 3), (0, 1)], [(9, 1), (0, 2)]])
def test_tiny_plans_never_give_empty_parts(seqs):
    for parts in range(1, 9):
        assert_split_is_exact(make_plan(seqs), parts)


@pytest.mark.parametrize("batch", [1, 2, 3, 7, 256])
@pytest.mark.parametrize("parts", [2, 3, 4])
def test_decode_split_is_unchanged(batch, parts):
    plan = make_plan([(5 + 3 * i, 1) for i in range(batch)], seed=batch)
    got, want = plan.split(parts), split_by_sequences(plan, parts)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        for name, value in vars(w).items():
            other = getattr(g, name)
            if isinstance(value, torch.Tensor):
                assert torch.equal(other, value), name
            elif isinstance(value, np.ndarray):
                assert np.array_equal(other, value), name
            else:
                assert other == value, name


def micro_batch_count(plan: ForwardBatch, pp_size: int, min_tokens: int) -> int:
    stage = SimpleNamespace(spec=SimpleNamespace(pp_size=pp_size), runner=SimpleNamespace(
        cfg=EngineConfig(pp_min_micro_batch_tokens=min_tokens)))
    return len(StageExecutor.micro_batches(stage, plan))


@pytest.mark.parametrize("seqs, pp, min_tokens, want", [
    ([(9, 1)] * 100, 2, 1, 2),  # decode-only: pp_size parts, however many tokens
    ([(9, 1)] * 100, 3, 10, 3),
    ([(0, 1)], 2, 1, 1),  # one token: one part, never an empty one
    ([(0, 50)], 2, 1024, 2),  # few tokens: still pp_size parts
    ([(0, 4000)], 2, 1024, 3),  # T // min_tokens
    ([(0, 8192)], 2, 1024, 8),
    ([(0, 32768)], 2, 1024, 8),  # capped at 4 * pp_size
    ([(0, 8192)], 4, 1024, 8),
    ([(5, 1), (0, 700), (40, 1)], 2, 100, 7),  # decodes mixed with a prefill count as tokens
    ([(0, 1)], 1, 1, 1),
])
def test_micro_batch_count(seqs, pp, min_tokens, want):
    assert micro_batch_count(make_plan(seqs), pp, min_tokens) == want


def test_min_micro_batch_tokens_is_validated():
    with pytest.raises(InvalidRequestError, match="pp_min_micro_batch_tokens"):
        EngineConfig(pp_min_micro_batch_tokens=0)


# ---------------------------------------------------------------- the model: whole vs pieces
def make_runner(model_dir) -> ModelRunner:
    cfg = EngineConfig(model=str(model_dir), device="cpu", dtype="float32",
                       attention_backend="torch", max_total_tokens=2048)
    return ModelRunner(cfg, ModelConfig.from_dir(model_dir))


def whole_vs_pieces(runner: ModelRunner, parts: int,
                    sizes: tuple[int, ...] = (60, 30, 150, 120)) -> torch.Tensor:
    """Prefills cached prefixes, then runs a step (decode, prefix-hit extend, fresh extend
    with every logits row) whole and as `parts` pieces in order from the same pool; the new
    tokens' slots are NaN before the pieces run, so a piece reading a slot no earlier piece
    wrote poisons its logits. `sizes`: the two cached prefixes, the hit's and the fresh
    prompt's new tokens. Returns the whole plan's logits after checking the pieces'."""
    gen = torch.Generator().manual_seed(parts)
    table = torch.randperm(runner.num_slots - 1, generator=gen).add_(1).reshape(4, -1)[:, :400]
    lens = [sizes[0], sizes[1], 0]
    tokens = torch.randint(1, 300, (3, 400), generator=gen)
    setup = ForwardBatch.from_table(table, [0, 1], [0, 0], lens[:2],
                                    torch.cat([tokens[0, :lens[0]], tokens[1, :lens[1]]]).tolist(),
                                    [])
    runner.forward(setup)
    ext = [1, sizes[2], sizes[3]]  # decode of 1, prefix hit of 0, fresh prompt of 2
    rows = [1, 0, 2]
    ids = torch.cat([tokens[r, lens[r] : lens[r] + e] for r, e in zip(rows, ext)]).tolist()
    t = sum(ext)
    logit_rows = [0, ext[0] + ext[1] - 1, *range(ext[0] + ext[1], t)]
    plan = ForwardBatch.from_table(table, rows, [lens[r] for r in rows], ext, ids, logit_rows)
    before = runner.pool.kv.clone()
    whole = runner.forward(plan)
    after = runner.pool.kv.clone()
    runner.pool.kv.copy_(before)
    runner.pool.kv[:, :, plan.out_cache_loc] = float("nan")
    pieces = plan.split(parts)
    assert len(pieces) == parts and sum(p.batch_size for p in pieces) > plan.batch_size
    got = torch.cat([runner.forward(p) for p in pieces])
    torch.testing.assert_close(got, whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(runner.pool.kv, after, rtol=1e-5, atol=1e-5)
    return whole


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])  # mistral: sliding window 24
def test_pieces_give_the_whole_plans_logits(arch, model_dirs):
    runner = make_runner(model_dirs[arch])
    for parts in (2, 5, 16):
        whole_vs_pieces(runner, parts)


def test_pieces_give_the_whole_plans_logits_with_triton(model_dirs):
    """The Triton backend (interpreted on the CPU) on pieces, against itself whole and the
    reference; a smaller step keeps the interpreter fast."""
    pytest.importorskip("triton")
    from phaseflip.attention.triton_backend import TritonAttention

    runner = make_runner(model_dirs["mistral"])
    sizes = (40, 20, 50, 30)  # past mistral's window of 24
    want = whole_vs_pieces(runner, 3, sizes)
    runner.backend = TritonAttention()
    got = whole_vs_pieces(runner, 3, sizes)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- pp=2 over gloo
def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    a = [rng.randrange(1, 300) for _ in range(300)]
    fresh = [[rng.randrange(1, 300) for _ in range(n)] for n in (150, 60, 90)]
    return [a, fresh[0], a[:200] + fresh[1], fresh[2]]  # prompt 2 hits prompt 0's prefix


def _serve(model_dir, sizer=None, **cfg) -> tuple[list, list[int]]:
    """Two rounds (so round 2 hits the prefix cache); per request its tokens, prompt logprobs
    and cached tokens; and, under pp, how many micro-batches rank 0 cut each step into."""
    cfg = {"device": "cpu", "dtype": "float32", "max_total_tokens": 4096, "dist_timeout_s": 60,
           "check_accounting": True, "chunked_prefill_size": 128} | cfg
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    with_lp = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True,
                             prompt_logprobs=1)
    params = [with_lp, greedy, greedy, with_lp]  # prompt logprobs would bypass the cache hit
    prompts, counts = _prompts(), []
    with Engine(str(model_dir), **cfg) as e:
        stage = getattr(e.core.runner, "stage", None)
        if sizer is not None:  # rank 0's part count in the step message, stubbed
            e.core.runner.sizer = sizer
        if stage is not None:
            cut = stage.micro_batches

            def counted(plan: ForwardBatch, parts: int = 0) -> list[ForwardBatch]:
                counts.append(len(mbs := cut(plan, parts)))
                return mbs

            stage.micro_batches = counted
        outs = e.generate(prompts[:2], params[:2], use_tqdm=False)
        outs += e.generate(prompts[2:], params[2:], use_tqdm=False)
        e.pool_accounting()
    return [(o.outputs[0].token_ids, o.prompt_logprobs, o.usage.cached_tokens)
            for o in outs], counts


@pytest.mark.timeout(120, method="thread")  # signals cannot interrupt gloo
def test_pp2_long_prompts_cut_into_pieces_match_single_process(model_dirs, monkeypatch):
    monkeypatch.setenv(PARTS_BY_TOKENS_ENV, "1")  # the token rule: T // 16, at most 8
    want, _ = _serve(model_dirs["llama"])
    got, counts = _serve(model_dirs["llama"], pp_size=2, pp_min_micro_batch_tokens=16)
    assert max(counts) == 8 and counts.count(2) > 0  # 128-token chunks in 8; decodes in 2
    assert want[2][2] >= 200  # the prefix-cache hit
    for (tok, lp, cached), (tok_w, lp_w, cached_w) in zip(got, want):
        assert tok == tok_w and cached == cached_w
        assert (lp is None) == (lp_w is None)
        if lp is not None:
            assert lp[0] is None and lp[1:] == pytest.approx(lp_w[1:], abs=1e-4)


@pytest.mark.timeout(120, method="thread")  # signals cannot interrupt gloo
def test_every_stage_cuts_a_prompt_step_as_rank_0_says(model_dirs):
    """Rank 0's part count (by its measured stage time, `micro_batch.py`) rides the step
    message and every stage cuts by it: the other stage's process cutting by the token rule
    (8 parts here) would receive hidden states of other shapes. Stubbed at 3: every prompt
    step is cut in 3, decode steps in 2 (1 for one sequence), and the tokens equal one
    process."""
    want, _ = _serve(model_dirs["llama"])
    got, counts = _serve(model_dirs["llama"], SimpleNamespace(parts=lambda tokens: 3),
                         pp_size=2, pp_min_micro_batch_tokens=16)
    assert 3 in counts and set(counts) <= {1, 2, 3}  # never the token rule's 8
    for (tok, lp, cached), (tok_w, lp_w, cached_w) in zip(got, want):
        assert tok == tok_w and cached == cached_w
        if lp is not None:
            assert lp[1:] == pytest.approx(lp_w[1:], abs=1e-4)
