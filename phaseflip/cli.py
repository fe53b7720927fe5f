"""Command line: `phaseflip serve` and `phaseflip generate`.

Flags are generated from the fields of `EngineConfig` and `ServerConfig` (and their docstrings
become the help text), so nothing is written twice.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import sys
import types
import typing

from phaseflip.config import EngineConfig, resolve_model


def _field_docs(cls: type) -> dict[str, str]:
    """The docstring under each dataclass field (the flag's help text)."""
    tree = ast.parse(inspect.getsource(cls))
    docs, body = {}, tree.body[0].body
    for prev, node in zip(body, body[1:]):
        if isinstance(prev, ast.AnnAssign) and isinstance(node, ast.Expr):
            docs[prev.target.id] = str(node.value.value)
    return docs


def add_config_flags(parser: argparse.ArgumentParser, cls: type = EngineConfig) -> None:
    docs, hints = _field_docs(cls), typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        kind = hints[f.name]
        if isinstance(kind, types.UnionType):
            kind = next(a for a in kind.__args__ if a is not type(None))
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default,
                                help=docs.get(f.name, ""))
        else:
            parser.add_argument(flag, type=kind, default=f.default,
                                help=f"{docs.get(f.name, '')} (default: %(default)s)")


def config_from_args(args: argparse.Namespace, cls: type = EngineConfig):
    cfg = cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})
    return resolve_model(cfg) if isinstance(cfg, EngineConfig) else cfg


def _serve(args: argparse.Namespace) -> int:
    from phaseflip.server.context import ServerConfig
    from phaseflip.server.launch import serve

    cfg = config_from_args(args)
    if cfg.node_rank > 0:  # another host's ranks: no HTTP, no scheduler
        from phaseflip.distributed.driver import run_node_workers

        return run_node_workers(cfg)
    return serve(cfg, config_from_args(args, ServerConfig))


def _generate(args: argparse.Namespace) -> int:
    from phaseflip import Engine, SamplingParams

    cfg = config_from_args(args)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.sampling_seed)
    prompts = args.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    with Engine(**dataclasses.asdict(cfg)) as engine:
        outs = engine.generate(prompts, params, use_tqdm=len(prompts) > 1)
    for prompt, out in zip(prompts, outs):
        if args.json:
            print(json.dumps({"prompt": prompt, "text": out.text,
                              "finish_reason": out.outputs[0].finish_reason}))
        else:
            print(f"{prompt}\033[1m{out.text}\033[0m" if sys.stdout.isatty() else prompt + out.text)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="phaseflip", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate completions offline (prompts from args/stdin)")
    gen.add_argument("prompt", nargs="*", help="prompts (default: one per line on stdin)")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--json", action="store_true", help="one JSON object per line")
    add_config_flags(gen)
    srv = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    from phaseflip.server.context import ServerConfig

    add_config_flags(srv, ServerConfig)
    add_config_flags(srv)
    args = parser.parse_args(argv)
    return _serve(args) if args.command == "serve" else _generate(args)


if __name__ == "__main__":
    sys.exit(main())
