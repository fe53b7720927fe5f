"""HiCache across a restart: the first engine process computes a long prompt's KV and stores
its pages in a disk tier; a second process (a restart) reads them back instead of computing
them again, and generates the same tokens.

    python examples/hicache_restart.py [--dir /var/tmp/phaseflip-kv] [--model DIR]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile

TEXT = ("Return the value of the named attribute of object. If the file does not exist, "
        "raise an error. This module provides access to some variables used by the "
        "interpreter. ") * 12


def once(kv_dir: str, model: str | None) -> None:
    from phaseflip import Engine, SamplingParams

    with Engine(model, device="cpu", enable_hicache=True, hicache_dir=kv_dir,
                hicache_host_gb=0.05) as engine:
        out = engine.generate([TEXT], SamplingParams(max_new_tokens=16, temperature=0),
                              use_tqdm=False)[0]
    print(f"prompt {out.usage.prompt_tokens} tokens, {out.usage.cached_tokens} read from the "
          f"cache; output {out.text!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", help="disk tier directory (default: a new temporary one)")
    parser.add_argument("--model", default=None)
    parser.add_argument("--once", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.once:
        return once(args.dir, args.model)
    kv_dir = args.dir or tempfile.mkdtemp(prefix="phaseflip-kv-")
    child = [sys.executable, __file__, "--once", "--dir", kv_dir,
             *(["--model", args.model] if args.model else [])]
    for run in ("first start", "restart"):
        print(f"{run}:", flush=True)
        subprocess.run(child, check=True)


if __name__ == "__main__":
    main()
