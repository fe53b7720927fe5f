"""A phase flip under load: two ranks serve streaming requests in the tensor-parallel layout,
`POST /admin/flip` re-lays them out as a two-stage pipeline while the requests run, and every
request still completes with the text it would have had without the flip.

Runs on a CPU (two gloo ranks, the tiny model) in about 15 s on 2 cores; on a GPU host pass
`--model DIR --device cuda`.

    python examples/flip_under_load.py
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import time

import httpx
from local_server import local_server

PROMPTS = ["def main():", "Return the", "If the file does not exist,", "This module provides"]


def complete(url: str, prompt: str, max_tokens: int) -> str:
    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    text = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    flags = ["--device", args.device, "--tp-size", "2", "--enable-flip", "--enable-hicache",
             "--hicache-host-gb", "0.05", *(["--model", args.model] if args.model else [])]
    with local_server(*flags) as url:
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            baseline = list(pool.map(lambda p: complete(url, p, args.max_tokens), PROMPTS))
            futures = [pool.submit(complete, url, p, args.max_tokens) for p in PROMPTS]
            time.sleep(0.5)  # the requests are decoding
            r = httpx.post(url + "/admin/flip", json={"tp_size": 1, "pp_size": 2}, timeout=600)
            r.raise_for_status()
            census = r.json()
            texts = [f.result() for f in futures]
        print(f"flip {census['source']} -> {census['target']} in {census['total_s']:.2f} s; "
              f"{census['retracted']} running requests retracted and re-admitted; slowest "
              f"segment {census['worst_segment']} ({census['worst_share']:.0%})")
        layout = httpx.get(url + "/server_info", timeout=30).json()["config"]
        print(f"now serving tp{layout['tp_size']} x pp{layout['pp_size']}")
    same = sum(a == b for a, b in zip(baseline, texts))
    print(f"{same}/{len(PROMPTS)} requests gave the same text as before the flip")
    if same != len(PROMPTS):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
