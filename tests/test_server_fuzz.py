"""Property-based fuzz of the HTTP API from its own OpenAPI schema: no request may cause a 5xx.

Drives schemathesis's strategies with hypothesis directly (no pytest plugin), so the test does
not depend on the plugin keeping up with pytest releases.
"""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402

from tests.server_process import start_server, stop_server  # noqa: E402


@pytest.fixture(scope="module")
def fuzz_server():
    # a short context keeps every generated request fast on the CPU
    proc, url = start_server("--max-model-len", "48")
    yield url
    stop_server(proc)


def test_no_server_errors(fuzz_server):
    schema = schemathesis.openapi.from_url(fuzz_server + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 12
    seen = set()
    for op in operations:
        fuzz(op, seen)
    assert any(kind == 4 for _, _, kind in seen), "the fuzzer never sent an invalid request"


def fuzz(op, seen: set) -> None:
    @settings(max_examples=25, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=op.as_strategy())
    def check(case):
        response = case.call(timeout=60)
        seen.add((op.method.upper(), op.path, response.status_code // 100))
        assert response.status_code < 500, (
            f"{case.method} {case.path} -> {response.status_code}: {response.text[:500]}")
        if response.status_code >= 400:
            err = response.json()["error"]
            assert err["message"] and err["type"]

    check()
