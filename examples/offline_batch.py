"""Offline batch generation with the Python API: many prompts, one call, no server.

    python examples/offline_batch.py                      # the tiny model shipped with phaseflip
    python examples/offline_batch.py --model ORG/NAME     # a model in the local HF cache
"""

from __future__ import annotations

import argparse
import time

from phaseflip import Engine, SamplingParams

PROMPTS = [
    "Return the",
    "def fibonacci(n):",
    "If the file does not exist,",
    "This module provides",
    "Raise ValueError if",
    "import os\nimport sys\n\n",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="directory or ORG/NAME (default: tiny)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args()

    greedy = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0)
    sampled = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.8, top_p=0.95,
                             seed=1, n=2)
    with Engine(args.model, device=args.device) as engine:
        start = time.perf_counter()
        outs = engine.generate(PROMPTS, greedy)
        elapsed = time.perf_counter() - start
        for prompt, out in zip(PROMPTS, outs):
            print(f"{prompt!r} -> {out.text!r} ({out.outputs[0].finish_reason})")
        tokens = sum(o.usage.completion_tokens for o in outs)
        print(f"{len(PROMPTS)} prompts, {tokens} tokens in {elapsed:.2f} s")
        # n=2 samples share the prompt's KV; the seed makes them reproducible
        for sample in engine.generate(["Return the"], sampled)[0].outputs:
            print(f"sample {sample.index}: {sample.text!r}")


if __name__ == "__main__":
    main()
