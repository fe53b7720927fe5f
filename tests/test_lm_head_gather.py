"""Logits only where they are needed (issue 16 item 4): the vocab-parallel LM head gathers its
shards to TP rank 0, the rank that samples; the other TP ranks send theirs and hold no
full-vocabulary logits. Real gloo ranks on the CPU, under deadlines (a hang fails).

The decode-graph path (the gather captured with the step, NCCL) runs on GPUs:
`tests/test_multi_gpu.py` (tp2, tp2×pp2 equal to one GPU, logprobs included) and the CPU
`record=False` replays of `tests/test_cuda_graph.py`.
"""

from __future__ import annotations

import datetime
import os
import queue
import time

import pytest
import torch
import torch.multiprocessing as mp

from phaseflip import Engine, SamplingParams
from phaseflip.layout import Layout, ProcessGroupCommunicator
from phaseflip.model.lm_head import ParallelLMHead
from tests.conftest import build_model, prompts_for

pytestmark = pytest.mark.timeout(240, method="thread")  # signals cannot interrupt gloo
VOCAB, HIDDEN, ROWS = 101, 16, 5  # an odd vocabulary: padded to 102 for tp2, then cut back


class _Recording:
    """A communicator that names every collective asked of it (a faithful pass-through)."""

    def __init__(self, inner: ProcessGroupCommunicator) -> None:
        self.inner, self.calls = inner, []

    def __getattr__(self, name: str):
        self.calls.append(name)
        return getattr(self.inner, name)


def _rank_main(rank: int, world: int, port: int, out) -> None:
    import torch.distributed as dist

    deadline = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=deadline)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=deadline)
    try:
        comm = _Recording(ProcessGroupCommunicator(dist.new_group(list(range(world))), world))
        head = ParallelLMHead(VOCAB, HIDDEN, Layout(rank, world, tp_comm=comm), torch.float32)
        gen = torch.Generator().manual_seed(5)
        full, hidden = torch.randn(VOCAB, HIDDEN, generator=gen), torch.randn(ROWS, HIDDEN,
                                                                              generator=gen)
        head.weight.weight_loader(head.weight, full)
        got = head.logits(hidden)
        err = None if got is None else (tuple(got.shape), got.dtype,
                                        (got - hidden @ full.T).abs().max().item())
        out.put((rank, err, comm.calls))
    except Exception as e:  # noqa: BLE001 — the test reports it
        out.put((rank, f"{type(e).__name__}: {e}", None))
    out.close()
    out.join_thread()
    os._exit(0)  # no teardown: a peer that failed must not hang this one


def test_only_the_sampling_rank_receives_the_logits():
    """tp2 over gloo: TP rank 0 gets the whole vocabulary (cut from the padded 102) equal to
    the unsharded projection; TP rank 1 gets None and asked its communicator for a gather,
    never an all-gather (which left every rank holding [rows, vocab] float32)."""
    from phaseflip.distributed.group import free_port

    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, 2, port, out), daemon=True)
             for r in range(2)]
    for p in procs:
        p.start()
    got, end = {}, time.monotonic() + 120
    try:
        while len(got) < 2:
            try:
                rank, res, calls = out.get(timeout=max(0.1, end - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"ranks did not answer: {got}")
            got[rank] = (res, calls)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
    (shape, dtype, err), calls0 = got[0]
    assert (shape, dtype) == ((ROWS, VOCAB), torch.float32)
    assert err < 1e-5
    assert got[1] == (None, ["gather"]), got[1]
    assert calls0 == ["gather"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("lmhead") / "llama5", "llama",
                       num_hidden_layers=5, num_key_value_heads=4)


def _outputs(model_dir, **cfg) -> list[tuple[list[int], list[float], list[float | None]]]:
    params = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True, logprobs=2,
                            prompt_logprobs=1)
    with Engine(str(model_dir), device="cpu", dtype="float32", max_total_tokens=4096,
                dist_timeout_s=60, **cfg) as e:
        outs = e.generate(prompts_for(300)[:5], params, use_tqdm=False)
    return [(o.token_ids, o.outputs[0].logprobs, o.prompt_logprobs[1:]) for o in outs]


@pytest.mark.parametrize("tp, pp", [(2, 1), (2, 2)])
def test_tp_tokens_and_logprobs_equal_one_process(model_dir, tp, pp):
    """Greedy tokens, sampled and prompt logprobs under tp2 (the logits gathered to TP rank 0)
    and tp2×pp2 (gathered on the last stage, sent on to the driver, micro-batched) equal one
    process's (the all-reduces sum in another order: logprobs within 1e-5)."""
    want = _outputs(model_dir)
    got = _outputs(model_dir, tp_size=tp, pp_size=pp)
    for (ids, lps, plps), (ids1, lps1, plps1) in zip(got, want):
        assert ids == ids1
        torch.testing.assert_close(torch.tensor(lps), torch.tensor(lps1), rtol=0, atol=1e-5)
        torch.testing.assert_close(torch.tensor(plps), torch.tensor(plps1), rtol=0, atol=1e-5)
