"""`phaseflip serve` refuses what it cannot serve before the engine starts: a bad server flag,
a port in use, a model directory without config.json, a layout the model cannot hold, a
HiCache directory that is a file. One line, exit code 2, no traceback, no model loaded."""

from __future__ import annotations

import math
import socket
import subprocess
import sys
import time

import pytest

from tests.server_process import free_port


def _serve(*args: str, deadline_s: float = 60) -> tuple[int, list[str], float]:
    """Runs `phaseflip serve` that should fail at once: its exit code, output lines and
    seconds taken."""
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "phaseflip.cli", "serve", "--device", "cpu", *args],
        capture_output=True, text=True, timeout=deadline_s)
    return (done.returncode, (done.stdout + done.stderr).strip().splitlines(),
            time.monotonic() - start)


@pytest.mark.parametrize("field, value, says", [
    ("port", 70000, "0-65535"),
    ("port", -1, "0-65535"),
    ("host", "", "0.0.0.0"),
    ("api_key", "", "unset environment variable"),
    ("api_key", "  ", "unset environment variable"),
    ("max_request_bytes", -1, ">= 1"),
    ("max_queued_requests", 0, ">= 1"),
    ("shutdown_timeout", -5.0, ">= 0"),
    ("shutdown_timeout", math.nan, ">= 0"),
    ("responses_kept", -1, ">= 0"),
    ("responses_kept_bytes", 0, ">= 1"),
    ("flip_timeout_s", -1.0, "> 0"),
])
def test_server_config_refuses_values_that_would_serve_wrongly(field, value, says):
    from phaseflip.errors import InvalidRequestError
    from phaseflip.server.context import ServerConfig

    with pytest.raises(InvalidRequestError) as e:
        ServerConfig(**{field: value})
    flag = "--" + field.replace("_", "-")
    assert e.value.param == field and flag in str(e.value) and says in str(e.value)


def test_server_config_keeps_the_edges_that_mean_something():
    from phaseflip.server.context import ServerConfig

    ServerConfig(port=0, shutdown_timeout=0, responses_kept=0, api_key="k", host="::1")


def test_an_empty_api_key_is_refused_in_one_line():
    code, lines, _ = _serve("--port", str(free_port()), "--api-key", "")
    assert code == 2 and len(lines) == 1, lines
    assert "--api-key" in lines[0] and "unset environment variable" in lines[0], lines


def test_a_port_in_use_fails_before_the_model_loads():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, lines, seconds = _serve("--port", str(port))
    assert code == 2 and len(lines) == 1, lines
    assert f"--port {port}" in lines[0] and "in use" in lines[0], lines
    assert seconds < 20, seconds  # (imports only: the model load alone used to pass 5 s)


def test_a_directory_without_config_json_is_one_line(tmp_path):
    code, lines, _ = _serve("--port", str(free_port()), "--model", str(tmp_path))
    assert code == 2 and len(lines) == 1, lines
    assert "config.json" in lines[0] and str(tmp_path) in lines[0], lines


def test_engine_checks_run_before_the_engine_starts(tmp_path):
    """A layout the model cannot hold, --fp8-lm-head without FP8 weights, a --max-model-len
    past the model's positions and a HiCache directory that is a file: what the engine found
    seconds into its start (a traceback, exit code 1) is the launcher's one line now
    (`preflight`, called in-process here)."""
    from phaseflip.config import EngineConfig
    from phaseflip.errors import PhaseflipError
    from phaseflip.model.resolve import resolve_model
    from phaseflip.server.launch import preflight

    a_file = tmp_path / "afile"
    a_file.write_text("")
    for flags, says in (({"tp_size": 3}, "tp_size=3 does not split"),
                        ({"pp_size": 8}, "pp_size=8 exceeds the model's 4 layers"),
                        ({"fp8_lm_head": True}, "--fp8-lm-head"),
                        ({"max_model_len": 4096}, "exceeds the model's context of 1024"),
                        ({"enable_hicache": True, "hicache_dir": str(a_file / "d")},
                         f"{a_file} is a file"),
                        ({"enable_hicache": True, "hicache_host_gb": 2.0**40},
                         "--hicache-host-gb"),
                        ({"enable_hicache": True, "hicache_dir": "/proc/phaseflip/kv"},
                         "cannot create it")):  # (even as root)
        cfg = resolve_model(EngineConfig(device="cpu", **flags))
        with pytest.raises(PhaseflipError, match=says):
            preflight(cfg)
    preflight(resolve_model(EngineConfig(device="cpu", enable_hicache=True,
                                         hicache_dir=str(tmp_path / "new"))))
