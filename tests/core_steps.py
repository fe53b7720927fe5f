"""Requests straight into an `EngineCore`, in the order given: `Engine.generate` submits its
batch longest output first, and a test whose scenario needs arrival order (who is retracted,
who is admitted first) submits through here instead."""

from __future__ import annotations

from phaseflip.sampling.params import SamplingParams


def run_in_order(core, prompts: list[list[int]], params: list[SamplingParams]) -> None:
    """Adds the requests as r0, r1, ... in order and steps until all finished."""
    for i, (ids, p) in enumerate(zip(prompts, params)):
        core.add_request(f"r{i}", ids, p)
    done: set[str] = set()
    while len(done) < len(prompts):
        done.update(d.request_id for d in core.step() if d.usage is not None)
