"""The grammar trial child's memory bound: a compile that would take the host's RAM before
its time budget ran out fails an allocation in the child (RLIMIT_DATA, headroom over what the
started child holds) and its request gets the 400 of a grammar past its budget, naming the
limit; so does a trial whose child the system killed. The next trial gets a fresh child.

The limit here is tiny (16 MiB over the started child) and the grammar the 2 600 optional
integer properties of `test_grammar_bounds` (its compile takes 30 MB within a second)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from phaseflip.sampling.grammar import GrammarSpec, _toolchain
from phaseflip.sampling.grammar_worker import (
    TRIAL_MEMORY_BYTES,
    GrammarProbes,
    GrammarTooComplexError,
)
from tests.fake_engine import tokenizer
from tests.test_grammar_bounds import SLOW_COMPILE, SMALL, _gone

TINY = 16 * 2**20
BUDGET_S = 20.0  # far past the out-of-memory (a fraction of a second): never the cause here
REGEX = GrammarSpec("regex", "[0-9]{3}")


@pytest.fixture(scope="module")
def tokenizer_json() -> str:
    tok = tokenizer()
    return _toolchain(tok, len(tok)).tokenizer_json


def _probes(tokenizer_json: str, memory_bytes: int = TRIAL_MEMORY_BYTES) -> GrammarProbes:
    return GrammarProbes(BUDGET_S, 1, lambda: tokenizer_json, memory_bytes)


def _data_limit(pid: int) -> int:
    """The soft RLIMIT_DATA of process `pid`, in bytes."""
    line = next(x for x in Path(f"/proc/{pid}/limits").read_text().splitlines()
                if x.startswith("Max data size"))
    return int(line.split()[3])


def _vm_data(pid: int) -> int:
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines()
                if x.startswith("VmData:"))
    return int(line.split()[1]) * 1024


def test_a_compile_past_the_memory_limit_is_a_400_and_the_child_restarts(tokenizer_json):
    """Red before: the child had no limit, so this compile ran on (to the budget here; for
    a grammar that eats memory, until the host's RAM was gone). Now an allocation fails, the
    child exits, the request gets GrammarTooComplexError naming the limit, and the next
    trial runs in a new child, a normal grammar passing within the same tiny limit."""
    probes = _probes(tokenizer_json, TINY)
    try:
        assert probes.problem(SMALL) is None
        first = probes.pids
        assert _data_limit(first[0]) == pytest.approx(_vm_data(first[0]) + TINY, abs=8 * 2**20)
        t0 = time.monotonic()
        with pytest.raises(GrammarTooComplexError) as e:
            probes.problem(SLOW_COMPILE, param="tool_choice")
        assert time.monotonic() - t0 < BUDGET_S / 2
        assert str(e.value).startswith("grammar too complex to compile within 16 MiB of memory:"
                                       " simplify the json_schema"), e.value
        assert "exit code" not in str(e.value) and e.value.param == "tool_choice"
        assert SLOW_COMPILE not in probes._outcomes  # (tried again next time, as past the budget)
        assert all(_gone(pid, 5.0) for pid in first)
        assert probes.problem(REGEX) is None and probes.pids and probes.pids != first
    finally:
        probes.close()


def test_a_child_killed_during_a_trial_is_the_same_400(tokenizer_json):
    """Red before: a trial whose child died (the OOM killer's SIGKILL) was `invalid ...:
    compiling it ended the compile process`, blaming the grammar's text. Now it is the
    too-complex 400 naming the limit and the exit code; the next trial gets a new child."""
    probes = _probes(tokenizer_json)
    try:
        assert probes.problem(SMALL) is None
        pid = probes.pids[0]
        assert _data_limit(pid) < _vm_data(pid) + TRIAL_MEMORY_BYTES + 8 * 2**20
        out: list[BaseException] = []

        def slow() -> None:
            try:
                probes.problem(SLOW_COMPILE)
            except Exception as e:  # noqa: BLE001 — the test looks at which
                out.append(e)

        thread = threading.Thread(target=slow, daemon=True)
        thread.start()
        time.sleep(1.0)  # (the trial is under way: it takes minutes)
        os.kill(pid, signal.SIGKILL)
        thread.join(BUDGET_S / 2)
        assert out and isinstance(out[0], GrammarTooComplexError), out
        assert str(out[0]).startswith(
            "grammar too complex to compile within 4 GiB of memory (compiling it ended the "
            f"compile process, exit code {-signal.SIGKILL}): simplify the json_schema"), out[0]
        assert probes.problem(REGEX) is None and probes.pids not in ([], [pid])
    finally:
        probes.close()

