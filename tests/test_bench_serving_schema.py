"""`bench_serving --json-schema` (the structured-output cost benchmark): its schema checker,
the way it counts answers, and a run against a real `phaseflip serve` (the embedded model,
CPU) in which every answer that finished must parse and validate."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks import bench_serving, schema_check
from benchmarks.bench_serving import RequestResult

SCHEMAS = Path(__file__).resolve().parent.parent / "benchmarks" / "schemas"
NESTED = json.loads((SCHEMAS / "nested.json").read_text())
GOOD = {"thought": "look", "action": "search", "confidence": 7,
        "arguments": {"path": "a.py", "max_results": 3},
        "plan": [{"id": 1, "tool": "git", "done": True, "note": None}], "tags": ["x"]}


def _with(path: tuple, value) -> dict:
    """GOOD with the value at `path` replaced (or added)."""
    out = json.loads(json.dumps(GOOD))
    node = out
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return out


def test_the_bundled_schemas_compile_and_are_fully_checked() -> None:
    from phaseflip.sampling.grammar import GrammarSpec

    for path in SCHEMAS.glob("*.json"):
        schema = json.loads(path.read_text())
        GrammarSpec.json_schema(schema).check()
        assert schema_check.unchecked_keywords(schema) == [], path
    assert schema_check.problems(GOOD, NESTED) == []


@pytest.mark.parametrize("value, problem", [
    (_with(("action",), "fly"), "$.action: 'fly' is not one of"),
    (_with(("confidence",), True), "$.confidence: bool True is not of type integer"),
    (_with(("confidence",), 101), "$.confidence: 101 breaks maximum 100"),
    (_with(("thought",), "x" * 81), "$.thought: length 81 > maxLength 80"),
    (_with(("extra",), 1), "$: unexpected property 'extra'"),
    (_with(("arguments", "extra"), 1), "$.arguments: unexpected property 'extra'"),
    (_with(("plan",), []), "$.plan: 0 items, fewer than minItems 1"),
    (_with(("plan", 0, "done"), 1), "$.plan[0].done: int 1 is not of type boolean"),
    (_with(("plan", 0, "tool"), "vim"), "$.plan[0].tool: 'vim' is not one of"),
    (_with(("tags",), ["a"] * 4), "$.tags: 4 items, more than maxItems 3"),
    ({k: v for k, v in GOOD.items() if k != "plan"}, "$: missing required 'plan'"),
    ([GOOD], "$: list"),
])
def test_the_checker_names_each_problem(value, problem) -> None:
    found = schema_check.problems(value, NESTED)
    assert any(p.startswith(problem) for p in found), found


def test_unknown_keywords_are_reported_not_passed() -> None:
    schema = {"type": "object", "properties": {"ids": {"type": "array", "uniqueItems": True},
                                              "at": {"type": "string", "format": "date"}}}
    assert schema_check.unchecked_keywords(schema) == ["format", "uniqueItems"]


def test_only_finished_answers_are_checked_and_counted() -> None:
    def done(text: str | None, reason: str | None) -> RequestResult:
        return RequestResult(prompt_len=1, target_len=9, ok=True, finish_reason=reason,
                             text=text)

    results = [done(json.dumps(GOOD), "stop"), done('{"thought": "x"', "stop"),
               done(json.dumps(_with(("confidence",), -1)), "stop"),
               done('{"thought": "cut', "length"), done(None, None)]
    fmt = bench_serving.response_format_of(str(SCHEMAS / "nested.json"))
    assert fmt["json_schema"]["name"] == "nested" and fmt["json_schema"]["strict"] is True
    s = bench_serving.structured_summary("nested.json", fmt, results)
    assert s["finish_reasons"] == {"length": 1, "none": 1, "stop": 3}
    assert (s["finished"], s["parsed"], s["valid"]) == (3, 2, 1)
    assert s["problems"][0] == "$.confidence: -1 breaks minimum 0"
    assert s["problems"][1].startswith("not JSON") and len(s["problems"]) == 2
    assert results[3].schema_problems is None and results[1].schema_problems[0].startswith(
        "not JSON")


def test_compare_needs_a_schema() -> None:
    with pytest.raises(SystemExit):
        bench_serving.parse_args(["--compare-unconstrained"])


@pytest.mark.timeout(120, method="thread")
def test_json_schema_run_against_a_live_server(tmp_path) -> None:
    from tests.server_process import start_server, stop_server

    proc, url = start_server()
    try:
        out = tmp_path / "structured.json"
        # greedy, 6 answers of the nested schema with room to finish (~300 tokens each)
        bench_serving.main(["--base-url", url, "--num-prompts", "6", "--dataset", "fixed",
                            "--input-len", "12", "--output-len", "400", "--timeout", "60",
                            "--json-schema", str(SCHEMAS / "nested.json"),
                            "--compare-unconstrained", "--out", str(out)])
    finally:
        stop_server(proc)
    data = json.loads(out.read_text())
    free, bound = data["unconstrained"], data["constrained"]
    assert (free["completed"], free["output_tokens"]) == (6, 6 * 400), free["errors"]
    assert "structured" not in free and free["flushed_tokens"] is not None
    assert bound["completed"] == 6 and bound["failed"] == 0, bound["errors"]
    assert bound["flushed_tokens"] > 0  # the unconstrained run's prompts were cached
    s = bound["structured"]
    assert s["finished"] >= 3 and s["parsed"] == s["valid"] == s["finished"], s
    assert s["unchecked_keywords"] == [] and s["schema_name"] == "nested"
    assert bound["warmup_s"] > 0 and bound["warmup_error"] is None
    for r in bound["requests"]:
        if r["finish_reason"] == "stop":
            assert schema_check.problems(json.loads(r["text"]), NESTED) == []
    assert data["itl_p50_ratio"] > 0 and math.isfinite(data["output_tokens_per_s_ratio"])
    split = data["itl_split"]["constrained"]
    assert split["itls"] == sum(len(r["itls"]) for r in bound["requests"])
    assert split["decode_p50_ms"] is not None and data["decode_itl_p50_ratio"] > 0
