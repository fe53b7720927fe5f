"""`phaseflip serve` spawns its engine process before the front end imports torch, and the
engine imports beside it, then waits at a gate for the front end's go (`engine_start.py`):
the two load side by side. A flag or tokenizer that fails the front end's checks still ends
the start with its one line and exit code 2, and the engine that had started is stopped,
its IPC directory removed; a front end killed before its go takes the engine and the
directory with it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from phaseflip.config import EMBEDDED_MODEL
from tests.server_process import free_port
from tests.test_serve_lifecycle_signals import _engine_pid, _gone, _kill_all


def test_the_engine_starts_while_the_front_end_loads_its_tokenizer(tmp_path: Path) -> None:
    """Red before: the engine started only once the front end's tokenizer had loaded, so
    with a tokenizer that cannot load it never started (no engine process is found)."""
    model = tmp_path / "model"
    shutil.copytree(EMBEDDED_MODEL, model)
    (model / "tokenizer.json").write_text("{not json")
    tmp = tempfile.mkdtemp(prefix="pf-")  # short: the IPC socket paths live under it
    proc = subprocess.Popen(
        [sys.executable, "-m", "phaseflip.cli", "serve", "--model", str(model), "--port",
         str(free_port()), "--device", "cpu"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env=os.environ | {"TMPDIR": tmp})
    engine = None
    try:
        engine = _engine_pid(proc.pid, deadline_s=15)
        proc.wait(timeout=30)
        left = _gone([engine], 10)
    finally:
        _kill_all(proc, [engine] if engine else [])
        leaked = list(Path(tmp).glob("phaseflip-*"))
        shutil.rmtree(tmp)
    log = proc.stdout.read()
    assert proc.returncode == 2, (proc.returncode, log[-2000:])
    last = log.strip().splitlines()[-1]
    assert last.startswith("phaseflip serve: error: cannot load the tokenizer in "), log[-2000:]
    assert not left, f"engine {engine} left running; log:\n{log[-2000:]}"
    assert not leaked, leaked


def test_an_engine_that_fails_its_start_is_named_on_the_exit_line() -> None:
    """Red before (CI, a two-node flag mismatch): the exit watcher heard of the engine's exit
    before `_announce` read its reason, stopped the server, and the last line said "stopped
    before the engine was ready (stopped)" without the reason the engine had reported."""
    import asyncio
    from types import SimpleNamespace

    from phaseflip.server.engine_client import EngineState
    from phaseflip.server.launch import Outcome, _stop_if_engine_dies

    state = EngineState()
    state.dead, state.unhealthy = "engine process exited with code 1", "GroupFormationError: x"
    server, outcome = SimpleNamespace(should_exit=False), Outcome()
    asyncio.run(_stop_if_engine_dies(SimpleNamespace(state=state), SimpleNamespace(exitcode=1),
                                     server, outcome))
    assert server.should_exit and outcome.code == 1
    assert outcome.reason == "engine failed to start: GroupFormationError: x"


def test_the_engine_is_spawned_before_the_front_end_imports_torch() -> None:
    """The spawn comes first: red with `--model` resolved through a module that imports torch
    (the loader did, through the bundled configs' module) or with the engine started by the
    launcher after its imports."""
    code = """
import sys
from phaseflip import cli
from phaseflip.server import engine_start

class Stop(Exception):
    pass

def spawned(cfg):
    print("torch imported:", "torch" in sys.modules, flush=True)
    raise Stop

engine_start.EngineStart = spawned
try:
    cli.main(["serve", "--device", "cpu"])
except Stop:
    pass
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert "torch imported: False" in out, out


GATE_DRIVER = """
import os, signal, sys
from phaseflip.config import EngineConfig
from phaseflip.server.engine_start import EngineStart

if __name__ == "__main__":
    start = EngineStart(EngineConfig(device="cpu"))
    print(start.proc.pid, start.ipc_dir, flush=True)
    if sys.argv[1] == "close":
        start.close()
        print("closed", start.proc.exitcode, flush=True)
    else:  # killed before its go: the engine reads EOF at the gate
        os.kill(os.getpid(), signal.SIGKILL)
"""


def _gate_driver(tmp_path: Path, how: str) -> tuple[int, Path, str]:
    script = tmp_path / "driver.py"
    script.write_text(GATE_DRIVER)
    proc = subprocess.run([sys.executable, str(script), how], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).resolve().parents[1])
    first, *rest = proc.stdout.splitlines()
    pid, ipc_dir = first.split()
    return int(pid), Path(ipc_dir), "\n".join(rest) + proc.stderr


def test_an_engine_that_never_gets_its_go_is_ended_and_its_ipc_dir_removed(tmp_path):
    """`close` before `go` (a check failed): the engine, importing or at the gate, is ended
    and the IPC directory removed; it printed nothing."""
    pid, ipc_dir, out = _gate_driver(tmp_path, "close")
    assert "closed -15" in out, out
    assert not ipc_dir.exists()
    assert not _gone([pid], 1), pid
    assert "Traceback" not in out, out


def test_a_front_end_killed_before_the_go_takes_the_engine_and_its_ipc_dir(tmp_path):
    """The front end SIGKILLed before its go: the engine reads EOF at the gate, removes the
    IPC directory and exits. Red without the removal at EOF (the directory stays)."""
    pid, ipc_dir, out = _gate_driver(tmp_path, "kill")
    left = _gone([pid], 30)
    assert not left, f"engine {pid} left running"
    assert not ipc_dir.exists(), ipc_dir
    assert "Traceback" not in out, out


def test_an_engine_dead_before_its_go_is_not_a_broken_pipe() -> None:
    """An engine that died while importing (a broken install, the OOM killer): the go finds
    its end closed and says nothing; the launcher reports the exit. Red without the
    suppression (BrokenPipeError out of `go`, a traceback out of `phaseflip serve`)."""
    from phaseflip.config import EngineConfig
    from phaseflip.server.engine_start import EngineStart

    start = EngineStart(EngineConfig(device="cpu"))
    try:
        start.proc.kill()
        start.proc.join(30)
        start.go()
        assert start.opened and start.proc.exitcode == -9
    finally:
        start.close()
    assert not Path(start.ipc_dir).exists()
