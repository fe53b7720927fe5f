"""Write a random-weight Hugging Face checkpoint of a real model shape (no download).

    python tools/make_random_checkpoint.py --model llama-3.1-8b --out /tmp/llama8b \
        [--dtype bfloat16] [--shard-gb 5] [--seed 0]

For the end-to-end loading path (safetensors shards + index, config, generation_config,
tokenizer) and for side-by-side runs with `transformers`, which need files on disk. Tensors are
drawn and written one at a time, so memory stays at about the largest tensor (the embedding),
never the model. The values equal `--load-format dummy` with the same seed on a CPU model
(see `phaseflip.model.dummy`); the tokenizer is the tiny model's, so text is meaningless.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from phaseflip.model.bundled import bundled_models
from phaseflip.model.dummy import write_random_checkpoint

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True,
                    help=f"bundled name ({', '.join(bundled_models())}) or a dir with config.json")
    ap.add_argument("--out", required=True, help="output directory (created)")
    ap.add_argument("--dtype", choices=sorted(_DTYPES), default=None,
                    help="default: the config's dtype")
    ap.add_argument("--shard-gb", type=float, default=5.0, help="max shard size (GB, 1e9 bytes)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu",
                    help="where the tensors are drawn: 'cuda' writes an 8B checkpoint in "
                         "seconds (another draw than the CPU's, which equals a CPU dummy model)")
    args = ap.parse_args(argv)
    if not Path(args.model).is_dir() and args.model.lower() not in bundled_models():
        ap.error(f"--model {args.model!r} is neither a directory nor a bundled model "
                 f"({', '.join(bundled_models())})")
    out = write_random_checkpoint(args.model, args.out,
                                  dtype=_DTYPES[args.dtype] if args.dtype else None,
                                  shard_gb=args.shard_gb, seed=args.seed,
                                  device=args.device)
    print(f"wrote {out}", file=sys.stderr)
    return out


if __name__ == "__main__":
    main()
