"""The offline API and `phaseflip generate` at their edges: Ctrl-C in `generate` (no request
left running), text that is not valid Unicode, an engine dropped or left open at exit after
streaming, a closed stdout pipe, Ctrl-C in the CLI, and flag errors told before the load."""

from __future__ import annotations

import asyncio
import gc
import io
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from pathlib import Path

import pytest

from phaseflip import Engine, InvalidRequestError, SamplingParams
from phaseflip.cli import main
from phaseflip.config import EMBEDDED_MODEL
from phaseflip.engine.outputs import CompletionOutput, RequestOutput

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_new_tokens=400, ignore_eos=True)
ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}


# ---------------------------------------------------------------------- Engine


@pytest.mark.timeout(60)
def test_ctrl_c_in_generate_leaves_no_request_running(make_engine, monkeypatch):
    """A SIGINT during `generate` (here: while its third step runs) ends the call with
    KeyboardInterrupt and takes its requests out of the engine; they used to run on, holding
    KV and the steps of every later call."""
    engine = make_engine(EMBEDDED_MODEL)
    want = [o.token_ids for o in engine.generate(["a b c", "d e"], GREEDY, use_tqdm=False)]
    real_step, calls = engine.core.step, []

    def step(sink=None):
        calls.append(1)
        if len(calls) == 3:
            signal.raise_signal(signal.SIGINT)  # Ctrl-C, as the step runs
        return real_step(sink=sink)

    monkeypatch.setattr(engine.core, "step", step)
    with pytest.raises(KeyboardInterrupt):
        engine.generate(["x y z"] * 4, LONG, use_tqdm=False)
    monkeypatch.undo()
    assert not engine.core.groups and not engine.core.scheduler.running
    acc = engine.pool_accounting()
    assert acc.balanced and acc.private == 0 and acc.protected == 0, acc
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    got = [o.token_ids for o in engine.generate(["a b c", "d e"], GREEDY, use_tqdm=False)]
    assert got == want


@pytest.mark.timeout(60)
def test_a_lone_surrogate_in_a_prompt_is_an_invalid_request(make_engine):
    """Text no tokenizer can encode (what undecodable input becomes) is InvalidRequestError
    naming the prompt, not a TypeError from inside the tokenizer; the engine goes on."""
    engine = make_engine(EMBEDDED_MODEL)
    with pytest.raises(InvalidRequestError) as e:
        engine.generate(["fine", "a\ud800b"], GREEDY, use_tqdm=False)
    assert e.value.param == "prompt" and "surrogate" in str(e.value)

    async def stream():
        async for _ in engine.generate_stream("x\udcff", GREEDY):
            pass

    with pytest.raises(InvalidRequestError):
        asyncio.run(asyncio.wait_for(stream(), 20))
    assert len(engine.generate("fine", GREEDY, use_tqdm=False)[0].token_ids) == 6


@pytest.mark.timeout(60)
def test_an_engine_dropped_after_streaming_is_collected_and_its_loop_ends():
    """The streaming loop's thread held its engine for good: dropped without `shutdown`, the
    engine (weights, KV pool, rank processes) stayed until the interpreter's exit."""
    engine = Engine(device="cpu", dtype="float32", max_total_tokens=4096)

    async def stream(e):
        return [d async for d in e.generate_stream("hi", GREEDY)]

    assert asyncio.run(asyncio.wait_for(stream(engine), 20))[-1].finish_reason == "length"
    thread = next(t for t in threading.enumerate() if t.name == "phaseflip-engine")
    ref = weakref.ref(engine)
    del engine
    deadline = time.monotonic() + 10
    while ref() is not None and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    assert ref() is None, "the engine was not collected"
    thread.join(10)
    assert not thread.is_alive()


@pytest.mark.timeout(90)
def test_exit_with_a_stream_in_flight_is_clean(tmp_path):
    """The interpreter exiting while the loop's daemon thread runs a step aborted the process
    ("terminate called without an active exception", exit code 134)."""
    script = tmp_path / "exit_mid_stream.py"
    script.write_text(textwrap.dedent("""
        import asyncio
        from phaseflip import Engine, SamplingParams
        engine = Engine(device="cpu", max_total_tokens=4096)
        params = SamplingParams(max_new_tokens=900, ignore_eos=True)
        stream = engine.generate_stream("hi", params)
        asyncio.new_event_loop().run_until_complete(stream.__anext__())
        print("leaving", flush=True)
    """))
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                       timeout=80, env=_env(), cwd=ROOT)
    assert p.returncode == 0 and "leaving" in p.stdout, (p.returncode, p.stderr[-2000:])


# ---------------------------------------------------------------------- CLI


class _FakeEngine:
    """Stands in for Engine in `phaseflip generate`: echoes each prompt's length."""

    made: list[_FakeEngine] = []
    interrupt = False

    def __init__(self, **cfg) -> None:
        self.made.append(self)

    def __enter__(self) -> _FakeEngine:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def generate(self, prompts, params, use_tqdm=True):
        if self.interrupt:
            raise KeyboardInterrupt
        return [RequestOutput(f"gen-{i}", [1], [CompletionOutput(0, text=f" {len(p)}",
                                                                 finish_reason="length")])
                for i, p in enumerate(prompts)]


@pytest.fixture
def fake_engine(monkeypatch):
    import phaseflip
    import phaseflip.threads

    _FakeEngine.made, _FakeEngine.interrupt = [], False
    monkeypatch.setattr(phaseflip, "Engine", _FakeEngine)
    monkeypatch.setattr(phaseflip.threads, "apply_cpu_threads", lambda cfg: None)
    return _FakeEngine


def _stdin(monkeypatch, data: bytes) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"))


@pytest.mark.parametrize("argv,flag", [
    (["--top-p", "0"], "--top-p"), (["--temperature", "nan"], "--temperature"),
    (["--max-new-tokens", "-1"], "--max-new-tokens"),
])
def test_bad_sampling_flags_are_told_before_the_model_loads(fake_engine, capsys, argv, flag):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--device", "cpu", *argv, "hello"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"argument {flag}:" in err and "Traceback" not in err
    assert not fake_engine.made


def test_stdin_that_is_not_utf8_is_a_usage_error(fake_engine, monkeypatch, capsys):
    _stdin(monkeypatch, b"fine\nhel\xfflo\n")
    with pytest.raises(SystemExit) as e:
        main(["generate", "--device", "cpu"])
    assert e.value.code == 2 and "stdin line 2 is not valid UTF-8" in capsys.readouterr().err
    assert not fake_engine.made


def test_stdin_blank_lines_skipped_and_empty_stdin_loads_nothing(fake_engine, monkeypatch,
                                                                 capsys):
    _stdin(monkeypatch, b"\n  \nhello\n\nab\n")
    assert main(["generate", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.splitlines() == ["hello 5", "ab 2"]
    _stdin(monkeypatch, b"")
    fake_engine.made.clear()
    assert main(["generate", "--device", "cpu"]) == 0
    assert "no prompts" in capsys.readouterr().err and not fake_engine.made


def test_ctrl_c_is_one_line_and_exit_code_130(fake_engine, capsys):
    fake_engine.interrupt = True
    try:
        assert main(["generate", "--device", "cpu", "hello"]) == 130
    except KeyboardInterrupt:  # (escaping, it would end the test session)
        pytest.fail("KeyboardInterrupt escaped main()")
    err = capsys.readouterr().err
    assert "phaseflip generate: interrupted" in err and "Traceback" not in err


def test_a_closed_stdout_pipe_ends_quietly(fake_engine, monkeypatch):
    """`phaseflip generate ... | head -1`: the reader leaves, the writer gets EPIPE; no
    BrokenPipeError traceback, exit code 141 as a process SIGPIPE ended."""
    read_fd, write_fd = os.pipe()
    os.close(read_fd)  # the reader is gone
    out = open(write_fd, "w", encoding="utf-8", buffering=1)
    monkeypatch.setattr(sys, "stdout", out)
    try:
        assert main(["generate", "--device", "cpu", *["p" * 100] * 2000]) == 141
    finally:
        monkeypatch.undo()
        out.close()


def test_a_benchmark_names_itself_in_its_errors(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    with pytest.raises(SystemExit) as e:
        main(["bench", "latency", "--no-such-flag"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert "phaseflip bench latency: error: unrecognized arguments: --no-such-flag" in err


@pytest.mark.timeout(90)
@pytest.mark.parametrize("tp", [1, 2])
def test_ctrl_c_during_a_real_generate_exits_130_without_a_traceback(tmp_path, tp):
    """SIGINT to `phaseflip generate`'s process group mid-run (a terminal's Ctrl-C; the embedded
    model on the CPU): the engine stops between two steps and shuts down, one line on stderr,
    exit code 130. Its ranks (tp 2) ignore the signal: the driver ends them."""
    prompts = "".join(f"prompt {i} " * 20 + "\n" for i in range(300))
    err_path = tmp_path / "err.txt"
    with open(err_path, "wb") as err:
        p = subprocess.Popen(
            [sys.executable, "-m", "phaseflip.cli", "generate", "--device", "cpu",
             "--max-new-tokens", "200", "--log-level", "warning", "--tp-size", str(tp)],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=err,
            env={**_env(), "TQDM_DISABLE": "0"}, cwd=ROOT, start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        threading.Thread(target=lambda: (p.stdin.write(prompts.encode()), p.stdin.close()),
                         daemon=True).start()
        deadline = time.monotonic() + 60
        while b"Generating" not in err_path.read_bytes() and time.monotonic() < deadline:
            assert p.poll() is None, err_path.read_text()[-2000:]
            time.sleep(0.1)
        time.sleep(0.5)  # steps under way
        os.killpg(p.pid, signal.SIGINT)
        rc = p.wait(30)
    text = err_path.read_text()
    assert rc == 130, text[-2000:]
    assert "Traceback" not in text and "phaseflip generate: interrupted" in text


def test_an_engine_made_while_a_rank_process_bootstraps_says_what_to_do() -> None:
    """A script that makes an engine at import time (no `__main__` guard) runs again in every
    rank while it starts: there the engine must refuse, naming the guard, before it loads
    anything (the user saw only "the rank group did not form")."""
    import multiprocessing

    me = multiprocessing.current_process()
    me._inheriting = True  # what multiprocessing sets while a child imports the main module
    try:
        with pytest.raises(RuntimeError, match='if __name__ == "__main__"'):
            Engine(device="cpu")
    finally:
        del me._inheriting
