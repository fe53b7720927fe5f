"""Piecewise graphs for prefill and mixed steps: static buffers, padding, attention between
the pieces over the real rows only.

On the CPU nothing is recorded (`record=False`): a run executes the same pieces eagerly over
the same padded static rows, and the attention between them through the static q and output
buffers, which checks everything the graphs depend on except the recording itself. With CUDA
the pieces are recorded and replayed for real (Triton attention). The oracle is the model's
ordinary eager forward on the same KV pool.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from phaseflip import Engine, SamplingParams
from phaseflip.model.cuda_graph import UNRECORDED_ENV
from phaseflip.model.piecewise_graph import PAD_SLOT, PiecewiseGraphs, token_buckets
from phaseflip.model.runner import ModelRunner
from tests.test_cuda_graph import _contexts, _plan

CUDA = torch.cuda.is_available()


@pytest.fixture
def piece_runs(monkeypatch) -> Counter:
    """`PiecewiseGraphs.run` calls of this process, counted by whether the plan carried a
    prompt (more tokens than sequences); CPU engines get unrecorded graphs, so pieces."""
    monkeypatch.setenv(UNRECORDED_ENV, "1")
    runs: Counter = Counter()
    real = PiecewiseGraphs.run

    def counted(self, plan, *inputs):
        runs[plan.input_ids.numel() > len(plan.extend_lens)] += 1
        return real(self, plan, *inputs)

    monkeypatch.setattr(PiecewiseGraphs, "run", counted)
    return runs


def _pieces(runner: ModelRunner, max_tokens: int = 32) -> PiecewiseGraphs:
    backend = runner.backend
    if CUDA:
        from phaseflip.attention.triton_backend import TritonAttention

        backend = TritonAttention()
    pieces = PiecewiseGraphs(runner.model, runner.pool, backend, max_tokens=max_tokens,
                             max_context=256, record=CUDA)
    pieces.capture(torch.cuda.Stream() if CUDA else None)
    return pieces


def _mixed_plan(seed: int):
    """A 7-token prompt continuing a 5-token prefix, beside two one-token decodes."""
    ctx = _contexts([12, 9, 20], seed)
    return _plan([(ctx[0][0][5:], ctx[0][1], 5), (ctx[1][0][8:], ctx[1][1], 8),
                  (ctx[2][0][19:], ctx[2][1], 19)], decode=False), ctx


@torch.inference_mode()
def test_a_mixed_step_equals_the_eager_forward(runner):
    """Prefixes filled eagerly, then the mixed step once eagerly and once through the pieces
    (9 tokens padded to the 16-token bucket): final states and logits agree, and the pool
    rows of the step's slots hold the same K/V. Red if the padding rows reached attention or
    the output rows, or if a layer's attention read another layer's q."""
    plan, ctx = _mixed_plan(1)
    prefill = _plan([(toks, slots, 0) for toks, slots in ctx], decode=False)
    model, pool = runner.model, runner.pool
    model(prefill.to(runner.device), pool, runner.backend)  # every context in the pool
    want, _ = model(plan.to(runner.device), pool, runner.backend)
    k_want = [pool.k[i][plan.out_cache_loc.to(runner.device)].clone()
              for i in range(len(pool.k))]
    pieces = _pieces(runner)
    assert plan.input_ids.numel() == 9 and pieces.can_run(plan)
    hidden, residual = pieces.run(plan.to(runner.device))
    got = model.final_states(hidden, residual, plan.logits_indices.to(runner.device))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(runner.logits(got), runner.logits(want), rtol=1e-4, atol=1e-4)
    for i, k in enumerate(k_want):
        torch.testing.assert_close(pool.k[i][plan.out_cache_loc.to(runner.device)], k)


@torch.inference_mode()
def test_padding_rows_write_only_the_padding_slot(runner):
    """A 9-token step in the 16-token bucket: its seven padding rows store K/V at the pool's
    padding slot and nowhere else."""
    plan, ctx = _mixed_plan(2)
    pool = runner.pool
    before = [k.clone() for k in pool.k]
    _pieces(runner).run(plan.to(runner.device))
    touched = set(plan.out_cache_loc.tolist()) | {PAD_SLOT}
    for k_before, k_after in zip(before, pool.k):
        changed = (k_before != k_after).flatten(1).any(dim=1).nonzero().flatten().tolist()
        assert set(changed) <= touched


def test_which_plans_run(runner):
    pieces = _pieces(runner, max_tokens=32)
    plan, _ = _mixed_plan(3)
    assert pieces.can_run(plan)
    too_long = _plan([(list(range(1, 34)), list(range(1, 34)), 0)], decode=False)
    assert not pieces.can_run(too_long)  # 33 tokens > 32
    assert token_buckets(32) == [16, 32] and token_buckets(600)[-1] == 600
    runner.model.rope.ensure_capacity(4096)  # the table the pieces read was regrown
    assert not pieces.can_run(plan)


def test_engine_outputs_equal_with_and_without_pieces(llama_dir, piece_runs):
    """Greedy tokens of prompts that join running decodes (mixed steps) are the same with the
    pieces on and off, and with them on every prefill and mixed step ran through them."""
    outs = {m: _generate(llama_dir, piecewise_graph_max_tokens=m) for m in (64, 0)}
    assert outs[64] == outs[0]
    assert piece_runs[True] >= 2  # prompt steps took the pieces (with the pieces on only)


def _generate(model_dir, **opts) -> list[list[int]]:
    """Greedy tokens of four prompts that join running decodes (prefill chunks of 16)."""
    prompts = [list(range(3 + i, 12 + 2 * i)) for i in range(4)]
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    with Engine(str(model_dir), device="cpu", dtype="float32", max_total_tokens=1024,
                max_running_requests=4, chunked_prefill_size=16, dist_timeout_s=60,
                **opts) as engine:
        return [o.token_ids for o in engine.generate(prompts, params, use_tqdm=False)]


@pytest.mark.timeout(240, method="thread")  # signals cannot interrupt gloo
@pytest.mark.parametrize("layout", [{"tp_size": 2}, {"pp_size": 2}])
def test_multi_rank_layouts_run_the_pieces(llama_dir, piece_runs, layout):
    """tp2 (the pieces hold the all-reduces) and pp2 (stage 1's pieces read the static input
    rows, stage 0's return every row's hidden/residual) over gloo, unrecorded: the same
    greedy tokens as the single-process engine without pieces, and rank 0 (this process)
    ran its pieces on the prompt steps."""
    want = _generate(llama_dir, piecewise_graph_max_tokens=0)
    assert _generate(llama_dir, **layout) == want
    assert piece_runs[True] >= 2
