"""Every script in examples/ runs as a user would run it (CPU, the tiny shipped model) and
says what it promises."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize("script,expect", [
    ("offline_batch.py", ["6 prompts,", "sample 1:"]),
    ("streaming_client.py", ["model: tiny-llama", "usage: 4 prompt + 24 completion tokens"]),
    ("hicache_restart.py", ["restart:\nprompt 397 tokens, 384 read from the cache"]),
    ("flip_under_load.py", ["flip tp2×pp1 -> tp1×pp2", "now serving tp1 x pp2",
                            "4/4 requests gave the same text"]),
])
def test_example_runs(script, expect):
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    r = subprocess.run([sys.executable, str(EXAMPLES / script)], capture_output=True, text=True,
                       timeout=280, env=env, cwd=EXAMPLES.parent)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for needle in expect:
        assert needle in r.stdout, r.stdout[-3000:]
