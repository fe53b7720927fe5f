"""The requests lm-evaluation-harness sends for loglikelihood (issue 23), answered as
`transformers` computes them.

lm-eval itself is not installed here: lm-eval 0.4.13 brings 45 packages (datasets, pyarrow,
pandas, scipy, scikit-learn, nltk, evaluate, ...) and its tasks load their data from the
Hugging Face hub at run time. What its `local-completions` model does is small, and this test
does the same: for loglikelihood (and loglikelihood_rolling) it posts

    {"model", "prompt": [batch], "temperature": 0, "max_tokens": 1, "logprobs": 1,
     "seed": 1234, "echo": true}

with a batch of token-id lists (or of strings with `tokenized_requests=False`), up to
`num_concurrent` requests at once, and reads each choice, sorted by index, as
`sum(token_logprobs[ctxlen:-1])` and `is_greedy` = every `token_logprobs[i] ==
max(top_logprobs[i].values())` over that slice. Older versions and other harnesses send
`max_tokens: 0` and slice `[ctxlen:]`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import httpx
import pytest
import torch

from phaseflip.config import EMBEDDED_MODEL
from phaseflip.model.loader import load_tokenizer
from tests.server_process import start_server, stop_server

MODEL = "tiny-llama"
TOL = 1e-4  # per token, as tests/test_equivalence.py


@dataclass
class Case:
    context: list[int]
    continuation: list[int]
    loglikelihood: float = 0.0  # transformers' answer
    is_greedy: bool = False
    clear: bool = True  # no near-tie at any continuation position (greedy is well defined)

    @property
    def ids(self) -> list[int]:
        return self.context + self.continuation


@pytest.fixture(scope="module")
def server():
    proc, url = start_server(deadline_s=120)
    yield url
    stop_server(proc)
    assert proc.returncode == 0, proc.stdout.read()


@pytest.fixture(scope="module")
def cases() -> list[Case]:
    """Contexts with greedy continuations (is_greedy true) and with chosen ones (mostly
    false), scored by transformers in float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL, dtype=torch.float32).eval()
    tok = load_tokenizer(EMBEDDED_MODEL)

    def log_softmax(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)

    def greedy(ids: list[int], k: int) -> list[int]:
        for _ in range(k):
            ids = ids + [int(log_softmax(ids)[-1].argmax())]
        return ids[-k:]

    contexts = ["Return the value of", "def main():\n    ", "The café — naïve résumé",
                "If the file does not exist,", "import", "x"]
    out = []
    for i, text in enumerate(contexts):
        ctx = tok.encode(text, add_special_tokens=False)
        out.append(Case(ctx, greedy(ctx, 1 + i % 3)))
        out.append(Case(ctx, tok.encode([" banana split", " = 1\n", "é"][i % 3],
                                        add_special_tokens=False)))
    for case in out:
        lp = log_softmax(case.ids)
        rows = range(len(case.context) - 1, len(case.ids) - 1)  # row r predicts ids[r + 1]
        case.loglikelihood = sum(lp[r, case.ids[r + 1]].item() for r in rows)
        case.is_greedy = all(int(lp[r].argmax()) == case.ids[r + 1] for r in rows)
        case.clear = all(float(lp[r].topk(2).values.diff().abs()) > TOL for r in rows)
    assert any(c.is_greedy for c in out) and not all(c.is_greedy for c in out)
    return out


def payload(prompts: list, max_tokens: int) -> dict:
    return {"model": MODEL, "prompt": prompts, "temperature": 0, "max_tokens": max_tokens,
            "logprobs": 1, "seed": 1234, "echo": True}


def parse(body: dict, ctxlens: list[int], max_tokens: int) -> list[tuple[float, bool]]:
    """lm-eval's `parse_logprobs`: (loglikelihood, is_greedy) of each choice."""
    out = []
    for choice, ctxlen in zip(sorted(body["choices"], key=lambda c: c["index"]), ctxlens):
        lps = choice["logprobs"]["token_logprobs"]
        tops = choice["logprobs"]["top_logprobs"]
        end = len(lps) - max_tokens
        out.append((sum(lps[ctxlen:end]), all(
            lp == max(top.values()) for lp, top in zip(lps[ctxlen:end], tops[ctxlen:end]))))
    return out


async def post_all(url: str, batches: list[dict], num_concurrent: int) -> list[dict]:
    gate = asyncio.Semaphore(num_concurrent)

    async def one(c: httpx.AsyncClient, body: dict) -> dict:
        async with gate:
            r = await c.post(url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    async with httpx.AsyncClient() as c:
        return await asyncio.gather(*(one(c, b) for b in batches))


def check(got: list[tuple[float, bool]], cases: list[Case]) -> None:
    for (ll, greedy), case in zip(got, cases, strict=True):
        n = len(case.continuation)
        assert ll == pytest.approx(case.loglikelihood, abs=TOL * n), case
        if case.clear:
            assert greedy == case.is_greedy, case


@pytest.mark.parametrize("max_tokens", [1, 0])
def test_token_id_batches_sent_concurrently(server, cases, max_tokens):
    batches = [cases[i:i + 3] for i in range(0, len(cases), 3)]
    bodies = asyncio.run(post_all(server, [payload([c.ids for c in b], max_tokens)
                                           for b in batches], num_concurrent=4))
    for body, batch in zip(bodies, batches, strict=True):
        assert len(body["choices"]) == len(batch)
        for choice, case in zip(sorted(body["choices"], key=lambda c: c["index"]), batch):
            lp = choice["logprobs"]
            assert len(lp["token_logprobs"]) == len(case.ids) + max_tokens
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
            assert all(len(t) in (1, 2) for t in lp["top_logprobs"][1:])  # top-1 (+ the token)
        check(parse(body, [len(c.context) for c in batch], max_tokens), batch)
    assert sum(c.clear for c in cases) >= len(cases) - 2


def test_string_prompts_score_the_tokens_the_server_made(server, cases):
    """`tokenized_requests=False`: the prompt is text; lm-eval finds the context length with
    the same tokenizer, and slices the echoed text by the tokens' offsets."""
    tok = load_tokenizer(EMBEDDED_MODEL)
    texts = [tok.decode(c.ids) for c in cases]
    assert [tok.encode(t, add_special_tokens=False) for t in texts] == [c.ids for c in cases]
    body = asyncio.run(post_all(server, [payload(texts, 1)], num_concurrent=1))[0]
    check(parse(body, [len(c.context) for c in cases], 1), cases)
    for choice, text in zip(sorted(body["choices"], key=lambda c: c["index"]), texts):
        assert choice["text"].startswith(text)
        lp = choice["logprobs"]
        for token, offset in zip(lp["tokens"], lp["text_offset"]):  # (bytes:\x..: part of
            if not token.startswith("bytes:"):  # a character)
                assert choice["text"][offset:offset + len(token)] == token


def test_the_same_request_alone_and_in_a_crowd_agrees(server, cases):
    """A request's scores do not depend on what else the server batches with it."""
    alone = [parse(asyncio.run(post_all(server, [payload([c.ids], 1)], 1))[0],
                   [len(c.context)], 1)[0] for c in cases[:4]]
    crowd = asyncio.run(post_all(server, [payload([c.ids], 1) for c in cases * 2], 8))
    together = [parse(b, [len(c.context)], 1)[0] for b, c in zip(crowd, cases * 2)]
    for (ll_a, g_a), (ll_b, g_b) in zip(alone, together[:4]):
        assert ll_b == pytest.approx(ll_a, abs=TOL) and g_a == g_b
