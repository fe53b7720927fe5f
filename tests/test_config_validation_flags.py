"""Engine config values refused at construction (and so as flags, before any model loads):
types, NaN and infinities, negatives, and the enumerated flags' argparse choices."""

from __future__ import annotations

import sys
import types

import pytest

from phaseflip.cli import CHOICES, build_parser, main
from phaseflip.config import CHOICES as CONFIG_CHOICES
from phaseflip.config import EngineConfig
from phaseflip.errors import InvalidRequestError

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("field, value, why", [
    ("max_model_len", 0, r"must be >= 1 \(leave it unset"),  # served the model's 1024
    ("max_model_len", -5, "must be >= 1"),  # a traceback from torch.zeros
    ("max_logprobs", -1, "must be >= 0"),  # every logprobs request then failed
    ("chunked_prefill_size", -7, "0 or -1 to turn chunking off"),  # chunking silently off
    ("dist_timeout_s", NAN, "must be a finite number"),
    ("dist_timeout_s", INF, "must be a finite number"),  # timedelta overflows at launch
    ("watchdog_timeout_s", NAN, "must be a finite number"),
    ("hicache_host_gb", NAN, "must be a finite number"),
    ("flip_decode_slo_ms", NAN, "must be a finite number"),
    ("flip_seed_to_pp_s", INF, "must be a finite number"),
    ("mem_fraction", "0.5", "expected a number, got str"),
    ("max_total_tokens", 2.5, "expected an integer, got float"),
    ("max_running_requests", None, "expected an integer, got NoneType"),
    ("tp_size", True, "expected an integer, got bool"),
    ("seed", "1", "expected an integer, got str"),
])
def test_a_bad_number_is_refused_naming_its_field(field, value, why):
    with pytest.raises(InvalidRequestError, match=f"{field}=.*{why}") as e:
        EngineConfig(**{field: value})
    assert e.value.param == field


def test_a_disk_tier_of_no_size_is_refused():
    with pytest.raises(InvalidRequestError, match="hicache_disk_gb=-1.0: must be > 0"):
        EngineConfig(enable_hicache=True, hicache_dir="/tmp/tier", hicache_disk_gb=-1.0)
    EngineConfig(hicache_disk_gb=-1.0)  # no disk tier: the size is unused


def test_good_numbers_still_construct():
    import numpy as np

    cfg = EngineConfig(max_model_len=None, chunked_prefill_size=-1, max_logprobs=0,
                       mem_fraction=1, dist_timeout_s=30, max_total_tokens=np.int64(4096))
    assert cfg.chunk_size is None and cfg.context_len(1024) == 1024
    assert EngineConfig(chunked_prefill_size=0).chunk_size is None
    assert EngineConfig(max_model_len=128).context_len(1024) == 128


def test_every_enumerated_field_is_a_choice_of_its_flag():
    """--all-reduce had no choices: --help showed ALL_REDUCE and a typo failed in the engine."""
    assert CHOICES["all_reduce"] == ("nccl", "symm-mem", "auto")
    assert set(CHOICES) == set(CONFIG_CHOICES)
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # noqa: SLF001
    flags = {a.dest: a for a in serve._actions}  # noqa: SLF001
    for name in CONFIG_CHOICES:
        assert flags[name].choices or flags[name].metavar, name  # dtype: its own spellings
    assert "{nccl,symm-mem,auto}" in serve.format_help()


def test_a_bad_all_reduce_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", "--all-reduce", "bogus"])
    assert e.value.code == 2 and "invalid choice: 'bogus'" in capsys.readouterr().err


@pytest.mark.parametrize("argv, needle", [
    (["--max-model-len", "-5"], "max_model_len=-5: must be >= 1"),
    (["--max-logprobs", "-1"], "max_logprobs=-1: must be >= 0"),
    (["--chunked-prefill-size", "-7"], "chunked_prefill_size=-7"),
    (["--dist-timeout-s", "nan"], "dist_timeout_s=nan: must be a finite number"),
    (["--watchdog-timeout-s", "nan"], "watchdog_timeout_s=nan: must be a finite number"),
])
def test_bad_flags_are_one_line_before_any_model_loads(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--device", "cpu", *argv, "hi"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and needle in err and "Traceback" not in err


def test_a_benchmark_refused_by_the_engine_is_one_line(monkeypatch, capsys):
    """`phaseflip bench latency --batch-sizes 0` printed a traceback: `bench` did not catch the
    engine's errors as serve and generate do."""
    def refuse(argv):
        EngineConfig(max_running_requests=0)

    fake = types.ModuleType("benchmarks.bench_latency")
    fake.main = refuse
    monkeypatch.setitem(sys.modules, "benchmarks.bench_latency", fake)
    with pytest.raises(SystemExit) as e:
        main(["bench", "latency", "--batch-sizes", "0"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    assert err.startswith("phaseflip bench latency: error: invalid engine config")
