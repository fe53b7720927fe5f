"""The command line: aliases, choices, errors as messages, --version, and a --help that imports
nothing heavy."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from phaseflip.cli import build_parser, config_from_args, main
from phaseflip.config import EMBEDDED_MODEL, EngineConfig

REPO = Path(__file__).resolve().parents[1]


def parse(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_spellings_people_bring_map_to_the_same_settings():
    args = parse("--model-path", str(EMBEDDED_MODEL), "-tp", "2", "-pp", "1",
                 "--gpu-memory-utilization", "0.5", "--max-num-seqs", "8", "--context-length",
                 "128", "--max-num-batched-tokens", "64", "--enforce-eager",
                 "--disable-radix-cache", "--dtype", "half")
    cfg = config_from_args(args)
    assert (cfg.tp_size, cfg.pp_size, cfg.mem_fraction, cfg.max_running_requests) == (2, 1, 0.5, 8)
    assert (cfg.max_model_len, cfg.max_prefill_tokens) == (128, 64)
    assert cfg.disable_cuda_graph and not cfg.enable_prefix_cache and cfg.dtype == "float16"
    assert parse("--mem-fraction-static", "0.7").mem_fraction == 0.7
    assert parse("--tensor-parallel-size", "4", "--pipeline-parallel-size", "2").pp_size == 2


@pytest.mark.parametrize("spelling,dtype", [
    ("fp16", "float16"), ("float16", "float16"), ("bf16", "bfloat16"), ("BF16", "bfloat16"),
    ("fp32", "float32"), ("float", "float32"), ("auto", "auto"),
])
def test_dtype_spellings(spelling, dtype):
    assert parse("--dtype", spelling).dtype == dtype


def test_defaults_are_the_config_defaults():
    args = parse()
    cfg = config_from_args(args)
    assert cfg == EngineConfig(model=cfg.model)
    assert (args.enable_prefix_cache, args.disable_cuda_graph) == (True, False)


@pytest.mark.parametrize("argv,needle", [
    (["--dtype", "fp8"], "invalid dtype 'fp8'"),
    (["--schedule-policy", "lifo"], "invalid choice: 'lifo'"),
    (["--log-level", "loud"], "invalid choice: 'loud'"),
    (["--device", "tpu"], "invalid device 'tpu'"),
    (["--tp-size", "two"], "invalid int value"),
])
def test_bad_values_are_usage_errors(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        parse(*argv)
    assert e.value.code == 2 and needle in capsys.readouterr().err


def test_a_config_the_engine_refuses_is_a_message_not_a_traceback(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--cpu-threads", "0", "hello"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "cpu_threads" in err and "Traceback" not in err
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", "/nonexistent/model-dir", "hello"])
    assert e.value.code == 2 and "does not exist" in capsys.readouterr().err


def test_help_states_each_default_once_and_no_design_jargon():
    parser = build_parser()
    sub = parser._subparsers._group_actions[0].choices  # noqa: SLF001 — argparse has no API
    for name in ("serve", "generate"):
        for action in sub[name]._actions:  # noqa: SLF001
            text = (action.help or "").replace("%(default)s", "")
            assert text.lower().count("default") <= 1, (action.dest, text)
            assert "law " not in text and "H200" not in text, (action.dest, text)
            if action.dest in ("dtype", "schedule_policy", "log_level", "flip_policy"):
                assert action.choices or action.metavar, action.dest


def test_help_and_version_import_neither_torch_nor_transformers():
    code = ("import sys; from phaseflip.cli import build_parser, version_text; build_parser(); "
            "print(version_text()); print(sorted(m for m in ('torch', 'transformers') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out[0].startswith("phaseflip ") and "torch " in out[0] and out[1] == "[]"


def test_version_flag():
    r = subprocess.run([sys.executable, "-m", "phaseflip.cli", "--version"], capture_output=True,
                       text=True)
    assert r.returncode == 0 and r.stdout.startswith("phaseflip 0.") and "python" in r.stdout


def test_bench_lists_the_benchmarks_and_passes_flags_through(capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["bench", "nope"])
    assert e.value.code == 2 and "latency" in capsys.readouterr().err
    args = build_parser().parse_args(["bench", "offline", "--num-prompts", "4"])
    assert (args.benchmark, args.bench_args) == ("offline", ["--num-prompts", "4"])


def test_version_info_is_what_get_version_answers():
    from phaseflip import __version__
    from phaseflip.versions import version_info

    info = version_info()
    assert info["version"] == __version__ and info["torch"] and info["python"]
    assert set(info) == {"version", "torch", "transformers", "triton", "python"}


def test_served_model_name_is_the_id_asked_for():
    from phaseflip.cli import served_model_name

    assert served_model_name(parse("--model", "Qwen/Qwen2.5-7B")) == "Qwen/Qwen2.5-7B"
    assert served_model_name(parse("--model", "Qwen/Qwen2.5-7B", "--served-model-name", "q")) == "q"
    assert served_model_name(parse("--model", str(EMBEDDED_MODEL))) is None  # the directory's


def test_no_gpu_warning_only_when_the_device_was_left_to_choose(caplog, monkeypatch):
    import torch

    from phaseflip.cli import _warn_if_cpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _warn_if_cpu(EngineConfig())
    assert "no GPU found" in caplog.text and "docs/gpu.md" in caplog.text
    caplog.clear()
    _warn_if_cpu(EngineConfig(device="cpu"))
    assert caplog.text == ""


def test_server_flags_read_from_source_match_the_class():
    """--help reads the server config's fields from its source (importing its module pulls in
    the engine); they must be the class's."""
    from phaseflip.cli import _fields_from_source, _fields_of
    from phaseflip.server.context import ServerConfig

    assert _fields_from_source("phaseflip.server.context", "ServerConfig") == \
        _fields_of(ServerConfig)


def test_the_command_freezes_its_heap_for_the_exit():
    """`phaseflip` (console script and `python -m phaseflip`) is `cli.entry`: `main`, then the
    heap frozen, so a stopping server's exit skips the collector's walks of the import heap
    (its stop took 1.9-2.1 s on the 2-core box, 0.5-0.6 s frozen). `main` alone must not
    freeze: tests call it in their own process. Red with the freeze left out of `entry`."""
    import tomllib

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["phaseflip"] == "phaseflip.cli:entry"
    assert "sys.exit(entry())" in (REPO / "phaseflip" / "__main__.py").read_text()
    code = ("import gc, sys; from phaseflip import cli; cli.main = lambda: 7; "
            "assert gc.get_freeze_count() == 0; code = cli.entry(); "
            "print(code, gc.get_freeze_count())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=REPO, check=True).stdout.split()
    assert out[0] == "7" and int(out[1]) > 1000
