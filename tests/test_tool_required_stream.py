"""`tool_choice: "required"` streams: each delta costs what it brings. The arguments were
copied and right-stripped whole at every delta, so a call whose arguments held a long run of
whitespace (inside a string: the grammar allows no other) was quadratic: 400 000 spaces in
4-character deltas took 12.6 s, now under a second. What is sent is unchanged: the streamed
arguments assemble to the whole answer's, however the text is cut."""

from __future__ import annotations

import random
import time

import pytest

from phaseflip.server import tools
from phaseflip.server.tool_parsers import split_required
from tests.test_structured_output import _plan


def _streamed(plan: tools.ToolPlan, text: str, cuts: list[int], eos: bool) -> tuple[str, str]:
    """(name, arguments) as the deltas of `text` cut at `cuts` assemble."""
    streamer, deltas = tools.ToolStreamer(plan), []
    bounds = [0, *cuts, len(text)]
    for k, (a, b) in enumerate(zip(bounds, bounds[1:])):
        deltas += streamer.feed(text[a:b], not eos and k == len(bounds) - 2)[1]
    if eos:
        deltas += streamer.feed("", True)[1]
    names = [d.function.name for d in deltas if d.id is not None]
    assert len(names) == 1, names
    return names[0], "".join(d.function.arguments or "" for d in deltas)


def _texts(rng: random.Random) -> list[str]:
    """Required calls with whitespace where the model may put it: around the header's
    punctuation, inside strings (runs), before the wrapper's closing brace."""
    out = []
    for _ in range(60):
        ws = lambda: rng.choice(["", " ", "\n", "  \t", " " * rng.randint(1, 40)])  # noqa: E731
        city = "".join(rng.choice(["a", " ", "  ", "\\\"", "}", "\n"]) for _ in range(
            rng.randint(0, 30)))
        args = f'{{"city": "{city}"}}' if rng.random() < 0.8 else "{}"
        out.append(f'{ws()}{{{ws()}"name"{ws()}:{ws()}"get_weather"{ws()},{ws()}"arguments"'
                   f'{ws()}:{ws()}{args}{ws()}}}')
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_required_deltas_assemble_to_the_whole_answer(seed: int) -> None:
    """Red check: a streamer that took the call's header as certain before the whitespace
    after `"arguments":` ended fails here (arguments sent with a leading space)."""
    rng, plan = random.Random(seed), _plan(tool_choice="required")
    for text in _texts(rng):
        whole = split_required(text)
        assert whole is not None and whole[0] == "get_weather"
        for _ in range(6):
            cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1,
                                                              rng.randint(1, 12))))
            if rng.random() < 0.3:
                cuts = list(range(1, len(text)))  # a character a delta
            assert _streamed(plan, text, cuts, rng.random() < 0.5) == whole, (text, cuts)


@pytest.mark.parametrize("body", [" " * 400_000, "x" + " " * 400_000 + "y"])
def test_a_whitespace_run_in_the_arguments_costs_what_it_brings(body: str) -> None:
    """Red before: 12.6 s on a 2-core box (each delta right-stripped the run again); now
    ~1 s, bounded at 5 s for a slow shared machine."""
    plan = _plan(tool_choice="required")
    args = f'{{"city": "{body}"}}'
    text = f'{{"name": "get_weather", "arguments": {args} }}'
    t0 = time.perf_counter()
    got = _streamed(plan, text, list(range(4, len(text), 4)), True)
    assert time.perf_counter() - t0 < 5.0
    assert got == ("get_weather", args)
