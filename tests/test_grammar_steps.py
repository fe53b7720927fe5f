"""`benchmarks/grammar_steps.py`: the ITL split of a one-wave comparison (what the pooled p99
mixes) and a small host-phase run of a constrained wave (so the benchmark does not rot)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks import common, grammar_steps

EMBEDDED = Path(grammar_steps.__file__).resolve().parent.parent / "phaseflip" / "assets" \
    / "tiny-llama"


def _run(ttfts: list[float], itls: list[list[float]]) -> dict:
    return {"requests": [{"ttft": t, "itls": g} for t, g in zip(ttfts, itls)]}


def test_the_split_puts_waits_that_began_before_the_last_first_token_in_the_prefill_window(
) -> None:
    # request 0 starts at 0.1 s and waits out two 0.2 s prefill steps; request 1's first
    # token at 0.5 s ends the window; every other gap is a 10 ms decode step
    early = [0.01, 0.2, 0.2] + [0.01] * 47
    late = [0.01] * 50
    out = common.itl_split(_run([0.1, 0.5], [early, late]))
    assert out["itls"] == 100 and out["p99_rank"] == 1
    assert out["prefill_window_itls"] == 3  # the gaps that began at 0.1, 0.11 and 0.31 s
    assert out["over_30ms"] == 2
    assert out["decode_p50_ms"] == out["decode_p99_ms"] == out["decode_max_ms"] == 10.0
    # two waits are 2 % of the pooled gaps: the pooled p99 is a prefill wait
    assert out["p99_ms"] == 200.0


def test_split_main_reads_a_comparison(tmp_path: Path) -> None:
    """One wave (every request sent at once) is split; spread arrivals are not (their prompts
    keep prefilling past any cut)."""
    wave = {"request_rate": "inf", "max_concurrency": None, "num_prompts": 1}
    runs = {name: _run([0.1], [[0.01] * 10]) | wave for name in ("unconstrained", "constrained")}
    runs["unconstrained"]["request_rate"] = 4.0
    path = tmp_path / "cmp.json"
    path.write_text(json.dumps(runs))
    out = grammar_steps.split_main(path)
    assert out["constrained"]["prefill_window_itls"] == 0
    assert out["constrained"]["decode_p50_ms"] == 10.0
    assert "unconstrained" not in out


def test_a_small_constrained_wave_times_its_masks() -> None:
    from phaseflip.sampling.grammar import GrammarSpec

    args = argparse.Namespace(model=str(EMBEDDED), device="cpu", dtype="float32",
                              load_format=None, null_forward=True, requests=4, prompt_len=16,
                              max_new=48, temperature=1.0, profile=None)
    spec = GrammarSpec.json_schema(json.loads(grammar_steps.SCHEMA.read_text()))
    run = grammar_steps.run_wave(args, spec)
    assert run["turns"] and run["mean_output"] > 0
    assert any(t.get("masks", 0) > 0 for t in run["turns"])
    assert sum(t["prefill"] for t in run["turns"]) == 4 * 16
    summary = grammar_steps.summarise("constrained", run)
    assert summary["turns"] == len(run["turns"]) and "masks" in summary["phases_ms"]
