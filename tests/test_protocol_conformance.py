"""Protocol conformance (issue 23): what real clients (lm-eval, the openai client) and a schema
fuzzer expect of the wire format."""

from __future__ import annotations

import asyncio

from tests.fake_engine import fake_server
from tests.test_server_ops import asgi


def test_completions_max_tokens_null_is_openais_default_16(tmp_path):
    async def go():
        async with fake_server(tmp_path) as (_, app, engine), asgi(app) as c:
            r = await c.post("/v1/completions", json={"model": "tiny", "prompt": ["a", "b"],
                                                      "max_tokens": None})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 32
            assert [a.params.max_new_tokens for a in engine.added] == [16, 16]

    asyncio.run(go())
