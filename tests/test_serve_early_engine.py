"""`phaseflip serve` starts its engine process before the front end loads its tokenizer, so
the two load side by side (a server answers ~1.5 s sooner on two cores). A tokenizer that
cannot be loaded still ends the start with its one line and exit code 2, and the engine that
had started is stopped, its IPC directory removed."""

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
