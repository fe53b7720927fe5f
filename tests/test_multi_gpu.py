"""Layouts over NCCL, one rank per GPU (skipped on machines with fewer GPUs than ranks).

The single-GPU suite already runs tp/pp ranks sharing one GPU through gloo; these tests cover
what only several GPUs exercise: NCCL collectives and point-to-point hand-offs between devices,
and decode CUDA graphs with the TP all-reduces captured inside them. fp32 must equal the
single-GPU engine token for token (logprobs within 1e-3: an all-reduce sums partial products in
another order). bf16 is held to the single-GPU test's standard: deviation from the fp32
`transformers` reference at most 1.5× that of `transformers` in bf16, plus slack.
"""

from __future__ import annotations

import pytest
import torch

from phaseflip import Engine, SamplingParams
from tests.conftest import hf_logprobs, prompts_for

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600, method="thread")]
PARAMS = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True, logprobs=0)


def needs(gpus: int):
    return pytest.mark.skipif(GPUS < gpus, reason=f"needs {gpus} CUDA devices, found {GPUS}")


def _generate(model_dir, prompts, **cfg):
    with Engine(str(model_dir), device="cuda", max_total_tokens=8192, dist_timeout_s=120,
                **cfg) as e:
        runner = e.core.runner
        if cfg.get("tp_size", 1) * cfg.get("pp_size", 1) > 1:
            assert runner.spec.backend == "nccl"
            rank0 = runner.runner
        else:
            rank0 = runner
        graphs = rank0.graphs is not None
        return e.generate(prompts, PARAMS, use_tqdm=False), graphs


@pytest.mark.parametrize("tp, pp", [pytest.param(2, 1, marks=needs(2)),
                                    pytest.param(1, 2, marks=needs(2)),
                                    pytest.param(2, 2, marks=needs(4))])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "llama-tied-mqa"])
def test_fp32_nccl_layout_equals_one_gpu(arch, tp, pp, model_dirs):
    """21 sequences with shared prefixes: decode batches padded to captured graph sizes, then
    shrinking as requests finish (n=3 of each prompt)."""
    prompts = prompts_for(300) * 3
    want, _ = _generate(model_dirs[arch], prompts, dtype="float32")
    got, graphs = _generate(model_dirs[arch], prompts, dtype="float32", tp_size=tp, pp_size=pp)
    assert graphs, "decode graphs were not captured on rank 0"
    for a, b in zip(got, want):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.outputs[0].logprobs),
                                   torch.tensor(b.outputs[0].logprobs), rtol=0, atol=1e-3)


@needs(2)
def test_fp32_tp2_eager_equals_graphs(model_dirs):
    prompts = prompts_for(300)
    runs = [_generate(model_dirs["llama"], prompts, dtype="float32", tp_size=2,
                      disable_cuda_graph=off) for off in (False, True)]
    assert runs[0][1] and not runs[1][1]
    assert [o.token_ids for o in runs[0][0]] == [o.token_ids for o in runs[1][0]]


@needs(2)
@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_bf16_layout_within_reference_deviation(tp, pp, model_dirs):
    from transformers import AutoModelForCausalLM

    model_dir = model_dirs["llama"]
    prompts = prompts_for(300)
    params = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True, logprobs=0,
                            prompt_logprobs=0)
    with Engine(str(model_dir), device="cuda", dtype="bfloat16", tp_size=tp, pp_size=pp,
                max_total_tokens=8192, dist_timeout_s=120) as e:
        outs = e.generate(prompts, params, use_tqdm=False)
    hf16 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    ours, theirs = [], []
    for p, o in zip(prompts, outs):
        ids = p + o.token_ids
        ref = hf_logprobs(model_dir, ids)
        with torch.no_grad():
            logits = hf16(torch.tensor([ids], device="cuda")).logits[0].float()
        lp16 = torch.log_softmax(logits, -1).cpu()
        got = o.prompt_logprobs[1:] + o.outputs[0].logprobs
        for i in range(1, len(ids)):
            ours.append(abs(got[i - 1] - ref[i - 1, ids[i]].item()))
            theirs.append(abs(lp16[i - 1, ids[i]].item() - ref[i - 1, ids[i]].item()))
    print(f"tp={tp} pp={pp} bf16 |logprob - fp32 ref| max/mean: phaseflip {max(ours):.4f}/"
          f"{sum(ours) / len(ours):.4f}, transformers {max(theirs):.4f}/"
          f"{sum(theirs) / len(theirs):.4f}")
    assert max(ours) <= 1.5 * max(theirs) + 0.02
    assert sum(ours) / len(ours) <= 1.5 * sum(theirs) / len(theirs) + 0.01


@needs(2)
@pytest.mark.parametrize("layout", [("--tp-size", "2"), ("--pp-size", "2")])
def test_server_over_nccl_answers_like_one_gpu(layout):
    import httpx

    from tests.server_process import start_server, stop_server

    body = {"model": "tiny-llama", "prompt": ["Return the", "def main():", "The default"],
            "max_tokens": 12, "temperature": 0}
    texts = []
    for args in (("--dtype", "float32"), ("--dtype", "float32", *layout)):
        proc, url = start_server(*args, device="cuda", deadline_s=300)
        try:
            info = httpx.get(url + "/server_info", timeout=30).json()
            r = httpx.post(url + "/v1/completions", json=body, timeout=120).json()
            texts.append([c["text"] for c in sorted(r["choices"], key=lambda c: c["index"])])
        finally:
            stop_server(proc)
    assert texts[0] == texts[1] and all(texts[0]), (texts, info)
