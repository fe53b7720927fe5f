"""phaseflip: serve a Hugging Face model behind an OpenAI-compatible API, generate offline, or
run a benchmark.

Flags are generated from the fields of the engine and server configurations (their docstrings
are the help text), so nothing is written twice. Nothing heavy (torch, transformers) is
imported until a command runs, so `--help` and `--version` answer at once.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import logging
import os
import re
import sys
import types
import typing
from pathlib import Path

from phaseflip.config import CHOICES as CONFIG_CHOICES
from phaseflip.config import SECTIONS, EngineConfig
from phaseflip.versions import version_info

# Values an enumerated flag accepts: the config's own (None: the flag left out).
CHOICES: dict[str, tuple[str, ...]] = {
    name: tuple(c for c in values if c is not None) for name, values in CONFIG_CHOICES.items()}
# The spellings other servers' users bring, for the same setting.
ALIASES: dict[str, tuple[str, ...]] = {
    "model": ("--model-path",),
    "tp_size": ("-tp", "--tensor-parallel-size"),
    "pp_size": ("-pp", "--pipeline-parallel-size"),
    "mem_fraction": ("--gpu-memory-utilization", "--mem-fraction-static"),
    "max_model_len": ("--context-length",),
    "max_running_requests": ("--max-num-seqs",),
    "max_prefill_tokens": ("--max-num-batched-tokens",),
}
# Flags that set a boolean field to a fixed value: `--enforce-eager` = --disable-cuda-graph.
FLAG_ALIASES: dict[str, tuple[str, bool, str]] = {
    "--enforce-eager": ("disable_cuda_graph", True, "same as --disable-cuda-graph"),
    "--disable-radix-cache": ("enable_prefix_cache", False,
                              "same as --no-enable-prefix-cache"),
}
DTYPE_SPELLINGS = {
    "auto": "auto", "float32": "float32", "fp32": "float32", "float": "float32",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
}
BENCHMARKS = {
    "latency": "one batch: prefill and per-token decode time",
    "offline": "offline throughput over a generated workload",
    "serving": "an online serving run (Poisson arrivals; TTFT/ITL/E2E percentiles)",
    "flip": "phase flips under load (seam census per flip)",
    "hicache": "HiCache tiers: hit rates and copy rates",
}


def _dtype(text: str) -> str:
    try:
        return DTYPE_SPELLINGS[text.lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(
            f"invalid dtype {text!r} (choose from {', '.join(DTYPE_SPELLINGS)})") from None


def _device(text: str) -> str:
    if text in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", text):
        return text
    raise argparse.ArgumentTypeError(f"invalid device {text!r} (choose from auto, cpu, cuda, "
                                     "cuda:N)")


@dataclasses.dataclass(frozen=True)
class _Field:
    """One config field as a flag: its name, value type, default and docstring."""

    name: str
    kind: type
    default: object
    doc: str
    section: str = ""  # the EngineConfig section it belongs to ("": the top level)


def _docs(node: ast.ClassDef) -> dict[str, str]:
    """The docstring under each dataclass field (the flag's help text)."""
    docs, body = {}, node.body
    for prev, nxt in zip(body, body[1:]):
        if isinstance(prev, ast.AnnAssign) and isinstance(nxt, ast.Expr):
            docs[prev.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def _fields_of(cls: type) -> list[_Field]:
    """The scalar fields of `cls`, and for EngineConfig those of each of its sections."""
    parts = [("", cls)] + (list(SECTIONS.items()) if cls is EngineConfig else [])
    out = []
    for section, part in parts:
        docs = _docs(ast.parse(inspect.getsource(part)).body[0])
        hints = typing.get_type_hints(part)
        for f in dataclasses.fields(part):
            if part is EngineConfig and f.name in SECTIONS:
                continue
            kind = hints[f.name]
            if isinstance(kind, types.UnionType):
                kind = next(a for a in kind.__args__ if a is not type(None))
            out.append(_Field(f.name, kind, f.default, docs.get(f.name, ""), section))
    return out


_SCALARS = {"str": str, "int": int, "float": float, "bool": bool}
_ARITHMETIC = (ast.Expression, ast.Constant, ast.BinOp, ast.UnaryOp, ast.operator, ast.unaryop)


def _fields_from_source(module: str, name: str) -> list[_Field] | None:
    """The fields of dataclass `name` read from `module`'s source without importing it (the
    server's module imports the engine, and --help should not wait for that); None when a
    type or default is more than a scalar type and literal arithmetic."""
    import importlib.util

    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return None
    tree = ast.parse(open(spec.origin, encoding="utf-8").read())
    node = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name), None)
    if node is None:
        return None
    docs, out = _docs(node), []
    for item in node.body:
        if not isinstance(item, ast.AnnAssign) or item.value is None:
            continue
        kind = _SCALARS.get(ast.unparse(item.annotation).removesuffix(" | None"))
        expr = ast.Expression(item.value)
        if kind is None or not all(isinstance(n, _ARITHMETIC) for n in ast.walk(expr)):
            return None
        default = eval(compile(expr, module, "eval"), {"__builtins__": {}})  # literals only
        out.append(_Field(item.target.id, kind, default, docs.get(item.target.id, "")))
    return out


def _help(doc: str, default: object, show_default: bool) -> str:
    """The help text: the field's docstring without design-document references or
    measurement notes, and the default unless the text already says it."""
    doc = re.sub(r"\blaw \d+: ", "", doc)
    doc = " ".join(s for s in re.split(r"(?<=\.) (?=[A-Z])", doc) if "H200" not in s)
    if show_default and default is not None and "default" not in doc.lower():
        doc += " (default: %(default)s)"
    return doc.replace("%", "%%").replace("%%(default)s", "%(default)s")


def add_config_flags(parser: argparse.ArgumentParser, cls: type = EngineConfig,
                     fields: list[_Field] | None = None) -> None:
    """Flags for the fields of `cls` (or the given `fields` of a server config)."""
    engine = fields is None and cls is EngineConfig
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in fields if fields is not None else _fields_of(cls):
        title = ("server" if not engine else f.section or "engine") + " options"
        group = groups.get(title) or groups.setdefault(title, parser.add_argument_group(title))
        flags = ["--" + f.name.replace("_", "-"), *ALIASES.get(f.name, ())]
        if f.kind is bool:
            action = group.add_argument(*flags, action=argparse.BooleanOptionalAction,
                                        default=f.default, help=_help(f.doc, None, False))
            if "%(default)s" not in action.help:  # some Pythons' BooleanOptionalAction add it
                action.help += " (default: %(default)s)"
            continue
        kwargs: dict[str, typing.Any] = {"type": f.kind, "default": f.default,
                                         "help": _help(f.doc, f.default, show_default=True)}
        if f.name == "dtype":
            kwargs.update(type=_dtype, metavar="{" + ",".join(DTYPE_SPELLINGS) + "}")
        elif f.name == "device":
            kwargs.update(type=_device, metavar="{auto,cpu,cuda,cuda:N}")
        elif f.name in CHOICES:
            kwargs["choices"] = CHOICES[f.name]
        group.add_argument(*flags, dest=f.name, **kwargs)
    if engine:
        for flag, (name, value, text) in FLAG_ALIASES.items():
            groups["engine options"].add_argument(flag, dest=name, action="store_const",
                                                  const=value, help=text)


def config_from_args(args: argparse.Namespace, cls: type = EngineConfig):
    from phaseflip.model.resolve import resolve_model

    names = (cls.field_names() if cls is EngineConfig else
             [f.name for f in dataclasses.fields(cls)])
    if cls is EngineConfig:
        _init_addr_from_env(args)
    cfg = cls(**{name: getattr(args, name) for name in names})
    if not isinstance(cfg, EngineConfig):
        return cfg
    if cfg.revision is not None and Path(cfg.model).expanduser().is_dir():
        # here, not in resolve_model: the engine re-resolves the hub snapshot's directory
        logging.getLogger("phaseflip").warning(
            "--revision %s is ignored: --model %s is a local directory (a revision picks a "
            "snapshot of a Hugging Face id in the local cache)", cfg.revision, cfg.model)
    return resolve_model(cfg)


def _init_addr_from_env(args: argparse.Namespace) -> None:
    """--dist-init-addr from MASTER_ADDR and MASTER_PORT, the standard names (torchrun, SLURM
    scripts) of node 0's rendezvous, when the ranks span nodes and the flag is not given."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if args.dist_init_addr is None and args.nnodes > 1 and host and port:
        args.dist_init_addr = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(name)s %(message)s")
    if logging.getLevelName(level.upper()) > logging.INFO:  # progress bars are INFO chatter
        os.environ.setdefault("TQDM_DISABLE", "1")  # the engine and its ranks inherit it


def _warn_if_cpu(cfg: EngineConfig) -> None:
    if cfg.device != "auto" or cfg.load_format == "dummy":
        return
    import torch

    if not torch.cuda.is_available():
        logging.getLogger("phaseflip").warning(
            "no GPU found: the engine runs on the CPU, which suits the bundled tiny model and "
            "small tests, not real models. For a GPU machine see docs/gpu.md; "
            "--device cpu silences this warning")


def served_model_name(args: argparse.Namespace) -> str | None:
    """--served-model-name, else the Hugging Face id the model was asked for (ORG/NAME), else
    None (the server names it after its directory)."""
    from phaseflip.model.loader import looks_like_repo_id

    if args.served_model_name is None and looks_like_repo_id(args.model) \
            and not os.path.isdir(args.model):
        return args.model
    return args.served_model_name


def _serve(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    if cfg.node_rank > 0:  # another host's ranks: no HTTP, no scheduler, no ready line
        from phaseflip.distributed.rank_set import run_node_workers
        from phaseflip.threads import plan_for

        _warn_if_cpu(cfg)
        logging.getLogger("phaseflip.threads").info("%s", plan_for(cfg).describe())
        return run_node_workers(cfg)
    from phaseflip.server.engine_start import EngineStart

    # the engine imports beside this process's imports, then waits for serve's go
    start = EngineStart(cfg)
    try:
        from phaseflip.server.context import ServerConfig
        from phaseflip.server.launch import serve

        _warn_if_cpu(cfg)
        args.served_model_name = served_model_name(args)
        server_cfg = config_from_args(args, ServerConfig)
    except BaseException:
        start.close()
        raise
    return serve(cfg, server_cfg, start)


# `generate`'s sampling flags, by the SamplingParams field each sets
SAMPLING_FLAGS = {"max_new_tokens": "--max-new-tokens", "temperature": "--temperature",
                  "top_p": "--top-p", "seed": "--sampling-seed"}


def _prompts(args: argparse.Namespace) -> list[str]:
    """`generate`'s prompts: the arguments, else the non-blank lines of stdin. Text that is
    not UTF-8 is an InvalidRequestError naming where it is (before the model loads)."""
    from phaseflip.errors import InvalidRequestError

    if args.prompt:
        for n, prompt in enumerate(args.prompt, 1):
            try:
                prompt.encode("utf-8")  # (undecodable bytes of argv arrive as surrogates)
            except UnicodeEncodeError:
                raise InvalidRequestError(f"prompt argument {n} is not valid UTF-8",
                                          "prompt") from None
        return args.prompt
    prompts = []
    data = b"" if sys.stdin is None else sys.stdin.buffer.read()
    for n, line in enumerate(data.split(b"\n"), 1):
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InvalidRequestError(f"stdin line {n} is not valid UTF-8 ({e.reason} at byte "
                                      f"{e.start})", "prompt") from None
        if text.strip():
            prompts.append(text)
    return prompts


def _generate(args: argparse.Namespace) -> int:
    from phaseflip import Engine, SamplingParams
    from phaseflip.errors import InvalidRequestError
    from phaseflip.threads import apply_cpu_threads

    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.sampling_seed)
    try:  # a bad value is told at once, not after the model has loaded
        params.validate(vocab_size=sys.maxsize)
    except InvalidRequestError as e:
        raise InvalidRequestError(f"argument {SAMPLING_FLAGS.get(e.param, e.param)}: {e}",
                                  e.param) from None
    prompts = _prompts(args)
    if not prompts:
        print("phaseflip generate: no prompts (give them as arguments, or one per line on "
              "stdin)", file=sys.stderr)
        return 0
    cfg = config_from_args(args)
    _warn_if_cpu(cfg)
    apply_cpu_threads(cfg)  # the engine runs in this process
    with Engine(**cfg.flat_dict()) as engine:
        outs = engine.generate(prompts, params, use_tqdm=len(prompts) > 1)
    try:
        for prompt, out in zip(prompts, outs):
            if args.json:
                print(json.dumps({"prompt": prompt, "text": out.text,
                                  "finish_reason": out.outputs[0].finish_reason}))
            elif sys.stdout.isatty():
                print(f"{prompt}\033[1m{out.text}\033[0m")
            else:
                print(prompt + out.text)
        sys.stdout.flush()
    except BrokenPipeError:  # the reader went away (`| head -1`): what it read is all it wants
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (the exit's flush)
        return 128 + 13  # as a process that SIGPIPE ended
    return 0


def _bench(args: argparse.Namespace) -> int:
    """Runs `benchmarks.bench_<name>` with the remaining arguments."""
    import importlib

    try:
        module = importlib.import_module(f"benchmarks.bench_{args.benchmark}")
    except ModuleNotFoundError as e:
        hint = (" (pip install 'phaseflip[bench]')" if e.name not in
                ("benchmarks", f"benchmarks.bench_{args.benchmark}") else "")
        print(f"phaseflip bench: cannot import the benchmark: {e}{hint}", file=sys.stderr)
        return 2
    main = module.main
    # (its usage and errors then name `phaseflip bench NAME`, argparse's prog)
    sys.argv = [f"phaseflip bench {args.benchmark}", *args.bench_args]
    if inspect.signature(main).parameters:
        main(args.bench_args)
    else:  # a benchmark that reads sys.argv itself
        main()
    return 0


def version_text() -> str:
    info = version_info()
    deps = ", ".join(f"{k} {v}" for k, v in info.items() if k != "version" and v is not None)
    return f"phaseflip {info['version']} ({deps})"


class _VersionAction(argparse.Action):
    """`--version`, with the versions looked up only when asked."""

    def __init__(self, option_strings, dest, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="print the versions of phaseflip, torch, transformers, triton "
                              "and Python")

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(version_text())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="phaseflip", description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--version", action=_VersionAction)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    srv = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API",
                         usage="phaseflip serve [--model MODEL] [options]",
                         description="Serve a model behind an OpenAI-compatible HTTP API. "
                         "Without --model, the tiny model shipped with phaseflip.")
    server_fields = _fields_from_source("phaseflip.server.context", "ServerConfig")
    if server_fields is None:  # not plain literals: import it (slower)
        from phaseflip.server.context import ServerConfig

        server_fields = _fields_of(ServerConfig)
    add_config_flags(srv, fields=server_fields)
    add_config_flags(srv)
    gen = sub.add_parser("generate", help="generate completions offline (prompts from args/stdin)",
                         usage="phaseflip generate [--model MODEL] [options] [PROMPT ...]",
                         description="Generate completions offline, one per prompt.")
    gen.add_argument("prompt", nargs="*", help="prompts (default: one per line on stdin)")
    gen.add_argument("--max-new-tokens", type=int, default=64, help="(default: %(default)s)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy "
                     "(default: %(default)s)")
    gen.add_argument("--top-p", type=float, default=1.0, help="(default: %(default)s)")
    gen.add_argument("--sampling-seed", type=int, default=None, help="seed of the sampling")
    gen.add_argument("--json", action="store_true", help="one JSON object per line")
    add_config_flags(gen)
    bench = sub.add_parser(
        "bench", help="run a benchmark (`phaseflip bench NAME --help` for its flags)",
        description="Run a benchmark; it prints a table and writes JSON. "
        + "; ".join(f"{k}: {v}" for k, v in BENCHMARKS.items()) + ".")
    bench.add_argument("benchmark", choices=tuple(BENCHMARKS))
    bench.add_argument("bench_args", nargs=argparse.REMAINDER,
                       help="the benchmark's own flags")
    return parser


def main(argv: list[str] | None = None) -> int:
    from phaseflip.errors import PhaseflipError

    parser = build_parser()
    args = parser.parse_args(argv)
    command = {"serve": _serve, "generate": _generate, "bench": _bench}[args.command]
    name = " ".join(filter(None, (args.command, getattr(args, "benchmark", None))))
    if args.command != "bench":  # a benchmark sets up its own logging
        _setup_logging(args.log_level)
    try:
        return command(args)
    except PhaseflipError as e:  # a bad flag value or model: a message, not a traceback
        parser.exit(2, f"phaseflip {name}: error: {e}\n")
    except KeyboardInterrupt:  # Ctrl-C: the engine is shut down on the way out
        print(f"\nphaseflip {name}: interrupted", file=sys.stderr)
        return 128 + 2


def entry() -> int:
    """The `phaseflip` command (console script, `python -m phaseflip`): `main`, then the heap
    frozen for the interpreter's exit (`heap.freeze_for_exit`; `main` itself also runs in
    test processes, which must not freeze theirs)."""
    from phaseflip.heap import freeze_for_exit

    code = main()
    freeze_for_exit()
    return code


if __name__ == "__main__":
    sys.exit(entry())
