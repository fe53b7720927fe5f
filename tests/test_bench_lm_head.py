"""The LM head benchmark end to end on two gloo ranks on the CPU, under a deadline (gloo
cannot be interrupted by signals: the thread method turns a hang into a failure)."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks import bench_lm_head


@pytest.mark.timeout(120, method="thread")
def test_every_case_is_timed_and_only_the_old_head_sends_logits_to_every_rank(tmp_path):
    out = tmp_path / "lm_head.json"
    bench_lm_head.main(["--device", "cpu", "--vocab", "101", "--hidden", "16", "--batch", "1,4",
                        "--iters", "2", "--warmup", "1", "--deadline-s", "90",
                        "--out", str(out)])
    data = json.loads(out.read_text())
    assert (data["world_size"], data["backend"], data["dtype"]) == (2, "gloo", "float32")
    rows = {(r["case"], r["batch"]): r for r in data["rows"]}
    cases = ("local only", "all_gather (before)", "gather (now)")
    assert set(rows) == {(c, b) for c in cases for b in (1, 4)}  # no graph case on the CPU
    for r in rows.values():
        assert 0 < r["rank0_us"] and math.isfinite(r["others_max_us"]), r
    shard = 4 * 51 * 4  # 4 rows of half the vocabulary padded to 102, float32
    assert rows[("all_gather (before)", 4)]["others_received_bytes"] == shard
    assert rows[("gather (now)", 4)]["rank0_received_bytes"] == shard
    assert rows[("gather (now)", 4)]["others_received_bytes"] == 0
