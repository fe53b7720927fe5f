"""The device runbook's scripts (`tools/device/*.sh`) call benchmarks with flags the code still
has: a renamed flag found only on a lent machine costs a call of a scarce 30-minute budget
(a GPU pair may come once in many sessions). Each script's `python3 -m benchmarks.X ...`
lines, with the script's and `lib.sh`'s variables expanded, are checked against X's own
argparse parser; `--engine-arg key=value` keys against the engine's options; the flags in
`--serve-args '...'` against `phaseflip serve`'s parser."""

from __future__ import annotations

import argparse
import importlib
import re
from pathlib import Path

import pytest

DEVICE = Path(__file__).resolve().parents[1] / "tools" / "device"
SCRIPTS = sorted(DEVICE.glob("*.sh"))
ASSIGN = re.compile(r"\b([A-Z][A-Z0-9_]*)=(\"[^\"]*\"|[^\s;\"]*)")
COMMAND = re.compile(r"python3 -m (benchmarks\.\w+)([^\"\n;&|>]*)")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def _parser_of(module: str) -> argparse.ArgumentParser:
    """The module's parser, caught where it would parse (its `parse_args` or `main`)."""
    mod = importlib.import_module(module)

    def catch(self, *_a, **_k):
        raise _Parsed(self)

    entry = getattr(mod, "parse_args", None) or mod.main
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(argparse.ArgumentParser, "parse_args", catch)
        try:
            entry([]) if entry is not mod.main or _takes_argv(mod.main) else entry()
        except _Parsed as p:
            return p.parser
    raise AssertionError(f"{module} built no parser")


def _takes_argv(fn) -> bool:
    return fn.__code__.co_argcount > 0


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}


def _variables(text: str) -> dict[str, str]:
    """Every assignment of a variable, joined (a variable set twice has both values' flags)."""
    out: dict[str, str] = {}
    for name, value in ASSIGN.findall(text):
        out[name] = (out.get(name, "") + " " + value.strip('"')).strip()
    return out


def _expand(text: str, env: dict[str, str]) -> str:
    text = re.sub(r"\$\(pl [^)]*\)", "--plot P", text)
    for _ in range(4):  # variables made of variables
        text = re.sub(r"\$\{?([A-Z][A-Z0-9_]*)\}?", lambda m: env.get(m.group(1), "V"), text)
    return text


def _commands(script: Path) -> list[tuple[str, str]]:
    lib = (DEVICE / "lib.sh").read_text()
    text = script.read_text()
    env = _variables(lib + "\n" + text)
    body = text if script.name != "lib.sh" else lib
    return [(m.group(1), _expand(m.group(2), env)) for m in COMMAND.finditer(body)]


def _serve_flags() -> set[str]:
    from phaseflip.cli import build_parser

    root = build_parser()
    sub = next(a for a in root._actions if isinstance(a, argparse._SubParsersAction))
    return _flags(sub.choices["serve"])


def _engine_options() -> set[str]:
    from phaseflip.config import SECTIONS, EngineConfig

    return {*EngineConfig.field_names(), *SECTIONS}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_device_scripts_use_flags_the_benchmarks_have(script: Path) -> None:
    problems = []
    for module, args in _commands(script):
        serve = re.findall(r"--serve-args '([^']*)'", args)
        args = re.sub(r"--serve-args '[^']*'", "--serve-args S", args)
        known = _flags(_parser_of(module))
        problems += [f"{module} {f}" for f in FLAG.findall(args) if f not in known]
        for pair in re.findall(r"--engine-arg[ =](\S+)", args):
            key, sep, _ = pair.partition("=")
            if not sep or key not in _engine_options():
                problems.append(f"{module} --engine-arg {pair}")
        problems += [f"serve {f}" for s in serve for f in FLAG.findall(s)
                     if f not in _serve_flags()]
    assert not problems, f"{script.name}: unknown flags {sorted(set(problems))}"


def test_the_check_sees_the_scripts_commands() -> None:
    """The checker finds the runbook's commands (a parse that found none would pass all)."""
    found = {m for s in SCRIPTS for m, _ in _commands(s)}
    assert {"benchmarks.bench_flip", "benchmarks.bench_offline", "benchmarks.bench_latency",
            "benchmarks.bench_flip_workload"} <= found
    _, args = next(c for c in _commands(DEVICE / "lib.sh"))
    assert "--serve-args '--model llama-3.1-8b" in args
