"""How far an FP8 engine is from its float reference, on a fixed prompt set.

Both engines score the same prompts (teacher-forced prompt logprobs) and decode greedily from
them. Reported:

* `mean_abs_dlogprob` / `max_abs_dlogprob`: |logprob_fp8 - logprob_ref| of each prompt token
  (given the same prefix), averaged over every scored token of every prompt;
* `top1_agreement`: the share of prompt positions where both engines' most likely next token is
  the same (a greedy step taken from identical contexts);
* `greedy_agreement`: the share of generated tokens before the two greedy continuations first
  differ (1.0: every continuation identical to the end).

`python -m benchmarks.fp8_accuracy` prints the table of docs/quantization.md.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from typing import Any

from phaseflip.config import EMBEDDED_MODEL

EMBEDDED_HELDOUT = EMBEDDED_MODEL / "heldout_sample.txt"


@dataclass(frozen=True)
class AccuracyReport:
    prompts: int
    scored_tokens: int
    mean_abs_dlogprob: float
    max_abs_dlogprob: float
    top1_agreement: float
    greedy_agreement: float


def embedded_prompts(tokenizer, n: int = 16, length: int = 96) -> list[list[int]]:
    """`n` consecutive windows of `length` tokens of the embedded model's held-out text."""
    ids = tokenizer(EMBEDDED_HELDOUT.read_text(encoding="utf-8"))["input_ids"]
    return [ids[i * length:(i + 1) * length] for i in range(n)]


def id_prompts(vocab_size: int, n: int = 8, length: int = 48, seed: int = 0) -> list[list[int]]:
    """Seeded random token-id prompts (random-weight models have no meaningful text)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab_size, (n, length), generator=gen).tolist()


def _run(engine_kwargs: dict[str, Any], prompts: list[list[int]], max_new: int):
    from phaseflip import Engine, SamplingParams

    params = SamplingParams(temperature=0.0, max_new_tokens=max_new, ignore_eos=True,
                            prompt_logprobs=1)
    with Engine(**engine_kwargs) as engine:
        return engine.generate(prompts, params, use_tqdm=False)


def _first_diff(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def compare(reference: dict[str, Any], candidate: dict[str, Any], prompts: list[list[int]],
            max_new: int = 16) -> AccuracyReport:
    """Runs both engines (Engine keyword arguments) on `prompts`; see the module docstring."""
    ref, got = _run(reference, prompts, max_new), _run(candidate, prompts, max_new)
    diffs: list[float] = []
    top1 = positions = agree = 0
    for r, g in zip(ref, got):
        diffs += [abs(a - b) for a, b in zip(r.prompt_logprobs[1:], g.prompt_logprobs[1:])]
        for a, b in zip(r.prompt_top_logprobs[1:], g.prompt_top_logprobs[1:]):
            positions += 1
            top1 += a[0][0] == b[0][0]
        agree += _first_diff(r.token_ids, g.token_ids)
    return AccuracyReport(
        prompts=len(prompts), scored_tokens=len(diffs),
        mean_abs_dlogprob=sum(diffs) / len(diffs), max_abs_dlogprob=max(diffs),
        top1_agreement=top1 / positions, greedy_agreement=agree / (max_new * len(prompts)))


VARIANTS = {"w8": {"quantization": "fp8"}, "kv8": {"kv_cache_dtype": "fp8_e4m3"},
            "w8kv8": {"quantization": "fp8", "kv_cache_dtype": "fp8_e4m3"},
            "w8kv8lm8": {"quantization": "fp8", "kv_cache_dtype": "fp8_e4m3",
                         "fp8_lm_head": True}}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model directory (default: the embedded one)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", help="the reference engine's dtype")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=16)
    args = ap.parse_args(argv)
    base: dict[str, Any] = {"device": args.device, "dtype": args.dtype,
                            "max_total_tokens": 8192}
    if args.model:
        base["model"] = args.model
    from phaseflip.model.loader import load_tokenizer

    if args.model is None:
        from phaseflip.config import EMBEDDED_MODEL

        prompts = embedded_prompts(load_tokenizer(EMBEDDED_MODEL), args.prompts)
    else:
        from phaseflip.model.config import ModelConfig

        prompts = id_prompts(ModelConfig.from_dir(args.model).vocab_size, args.prompts)
    for name, extra in VARIANTS.items():
        report = compare(base, {**base, **extra}, prompts, args.max_new)
        print(json.dumps({"variant": name, **asdict(report)}))


if __name__ == "__main__":
    main()
