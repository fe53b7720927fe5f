"""Property-based fuzz of the HTTP API from its own OpenAPI schema: no request may cause a 5xx."""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402

from tests.test_server import start_server, stop_server  # noqa: E402


@pytest.fixture(scope="module")
def fuzz_server():
    # a short context keeps every generated request fast on the CPU
    proc, url = start_server("--max-model-len", "48")
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    return schemathesis.openapi.from_url(fuzz_server + "/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                 HealthCheck.function_scoped_fixture])
def test_no_server_errors(case, fuzz_server):
    response = case.call(timeout=60)
    assert response.status_code < 500, (
        f"{case.method} {case.path} -> {response.status_code}: {response.text[:500]}\n"
        f"{case.as_curl_command()}")
    if response.status_code >= 400:
        err = response.json()["error"]
        assert err["message"] and err["type"]
