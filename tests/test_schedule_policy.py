"""Longest output first: an offline batch ends when its last request does, and a request with
a long output admitted late sets that step. `Engine.generate` submits its batch longest
`max_new_tokens` first; `schedule_policy="lof"` orders any waiting queue so (the server)."""

from __future__ import annotations

import pytest

from phaseflip.errors import InvalidRequestError
from phaseflip.sampling.params import SamplingParams
from tests.core_steps import run_in_order

# four short requests, then one long one, two at a time: in arrival order the long one starts
# after two pairs of short ones; longest first it starts at once and the short ones ride along
OUTPUTS = (2, 2, 2, 2, 24)


def params_for(outputs) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True) for n in outputs]


def prompts_for(outputs) -> list[list[int]]:
    return [[7 + i, 11, 13, 17] for i in range(len(outputs))]


class Recorder:
    """Counts `core.step` calls and the order requests reach the running list."""

    def __init__(self, core):
        self.core, self.steps, self.admitted, self._seen = core, 0, [], set()
        self._step = core.step
        core.step = self

    def __call__(self):
        self.steps += 1
        for r in self.core.scheduler.running:
            if r.rid not in self._seen:
                self._seen.add(r.rid)
                self.admitted.append(r.params.max_new_tokens)
        return self._step()

    def close(self):
        self.core.step = self._step


def run_core(engine, outputs=OUTPUTS) -> Recorder:
    """Submits in arrival order straight to the core (no reordering) and steps to the end."""
    rec = Recorder(engine.core)
    try:
        run_in_order(engine.core, prompts_for(outputs), params_for(outputs))
    finally:
        rec.close()
    return rec


@pytest.fixture
def engines(llama_dir, make_engine):
    def build(policy: str = "fcfs"):
        return make_engine(llama_dir, schedule_policy=policy, max_running_requests=2,
                           overlap_schedule=False)
    return build


def test_lof_policy_admits_the_longest_first_and_ends_sooner(engines):
    fcfs, lof = run_core(engines("fcfs")), run_core(engines("lof"))
    assert fcfs.admitted[:2] == [2, 2] and lof.admitted[0] == 24
    # in arrival order the long request starts after two pairs of short ones
    assert lof.steps < fcfs.steps - 2, (lof.steps, fcfs.steps)


def test_lof_keeps_arrival_order_among_equals(engines):
    assert run_core(engines("lof"), (3, 5, 3, 5)).admitted == [5, 5, 3, 3]


def test_generate_submits_longest_first_and_answers_in_order(engines):
    engine = engines("fcfs")
    rec = Recorder(engine.core)
    try:
        out = engine.generate(prompts_for(OUTPUTS), params_for(OUTPUTS), use_tqdm=False)
    finally:
        rec.close()
    assert [o.prompt_token_ids for o in out] == prompts_for(OUTPUTS)  # the caller's order
    assert [len(o.token_ids) for o in out] == list(OUTPUTS)  # nothing lost or cut short
    assert rec.admitted[0] == 24
    assert rec.steps < run_core(engines("fcfs")).steps - 2


def test_unknown_policy_is_refused(llama_dir, make_engine):
    with pytest.raises((InvalidRequestError, ValueError), match="lof"):
        make_engine(llama_dir, schedule_policy="longest")
