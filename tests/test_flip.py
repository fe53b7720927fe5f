"""The phase flip's seam over real ranks (gloo on CPU): TP ⇄ PP mid-generation.

MISSION C6's correctness bar: greedy outputs identical with and without flips, no request lost
or duplicated across any number of flips, pool accounting exact after every seam (the seam
checks it and raises), three and more cycles in a row without drift.
"""

from __future__ import annotations

import pytest

from phaseflip import Engine, SamplingParams
from phaseflip.errors import InvalidRequestError
from tests.conftest import prompts_for

pytestmark = pytest.mark.timeout(240, method="thread")  # signals cannot interrupt gloo
PARAMS = SamplingParams(temperature=0.0, max_new_tokens=14, ignore_eos=True, logprobs=0)
CFG = {"device": "cpu", "dtype": "float32", "max_total_tokens": 4096, "dist_timeout_s": 60,
       "check_accounting": True}
FLIP = {"enable_flip": True, "enable_hicache": True, "hicache_host_gb": 0.01}


def _drive(engine: Engine, prompts, flips: dict[int, tuple[int, int]]) -> tuple[dict, list]:
    """Runs the prompts step by step on the engine's core, flipping to flips[k] before step k;
    returns {rid: (token ids, logprobs, finish reasons)} and the censuses."""
    core = engine.core
    for i, p in enumerate(prompts):
        core.add_request(f"r{i}", p, PARAMS)
    outs: dict[str, tuple[list, list, list]] = {f"r{i}": ([], [], []) for i in range(len(prompts))}
    censuses, step = [], 0
    while core.has_work():
        deltas = []
        if step in flips:
            census, deltas = core.flip(*flips[step])
            censuses.append(census)
        for d in deltas + core.step():
            ids, lps, reasons = outs[d.request_id]
            ids += d.token_ids
            lps += d.logprobs or []
            if d.finish_reason is not None:
                reasons.append(d.finish_reason)
        step += 1
    core.kv.check(core.scheduler.running)
    return outs, censuses


def test_three_flip_cycles_match_the_unflipped_run(model_dirs):
    """tp2 → pp2 → tp2 → pp2 → tp2 mid-generation, the first before any decode finished and
    one while prompts are still being admitted; each output equals the single-process run."""
    prompts = prompts_for(300) * 2
    with Engine(str(model_dirs["llama"]), **CFG) as e:
        want, _ = _drive(e, prompts, {})
    flips = {2: (1, 2), 5: (2, 1), 7: (1, 2), 11: (2, 1)}
    with Engine(str(model_dirs["llama"]), tp_size=2, max_running_requests=6, **FLIP,
                **CFG) as e:
        got, censuses = _drive(e, prompts, flips)
        assert (e.core.cfg.tp_size, e.core.cfg.pp_size) == (2, 1)
    assert [c.target for c in censuses] == ["tp1×pp2", "tp2×pp1", "tp1×pp2", "tp2×pp1"]
    for c in censuses:
        assert c.rows_moved == 0 and c.fence_s is not None and c.retracted > 0
        assert list(c.segments) == ["fence", "retract", "drop", "teardown", "relayout"]
        assert "DONE" in c.done_line() and c.worst()[0] in c.segments
    for rid, (ids, lps, reasons) in got.items():
        assert reasons == ["length"], rid  # finished exactly once: none lost, none doubled
        assert ids == want[rid][0], rid
        assert lps == pytest.approx(want[rid][1], abs=1e-4), rid


def test_flip_needs_the_flag_and_a_host_tier(model_dirs):
    from phaseflip.config import EngineConfig

    with pytest.raises(InvalidRequestError, match="--enable-hicache"):
        EngineConfig(model=str(model_dirs["llama"]), enable_flip=True)
    with Engine(str(model_dirs["llama"]), tp_size=2, **CFG) as e:
        with pytest.raises(InvalidRequestError, match="--enable-flip"):
            e.flip(1, 2)


def test_bad_targets_are_refused_before_anything_changes(model_dirs):
    with Engine(str(model_dirs["llama"]), tp_size=2, **FLIP, **CFG) as e:
        e.core.add_request("a", prompts_for(300)[3], PARAMS)
        e.core.step()
        for tp, pp in ((2, 1), (4, 1), (1, 1), (3, 1)):
            with pytest.raises(InvalidRequestError):
                e.flip(tp, pp)
        assert e.core.scheduler.running and (e.core.cfg.tp_size, e.core.cfg.pp_size) == (2, 1)
        while e.core.has_work():
            e.core.step()


def test_dropping_the_tree_before_retracting_is_refused(model_dirs):
    """Law 6: retract strictly before the tree reset. A reset while requests still lock
    prefixes would orphan them; the drop refuses instead of corrupting the pool."""
    with Engine(str(model_dirs["llama"]), **CFG) as e:
        prompt = prompts_for(300)[-1]
        e.generate([prompt], PARAMS, use_tqdm=False)  # its prefix is now cached
        e.core.add_request("b", prompt, PARAMS)
        e.core.step()  # "b" holds a lock on the cached prefix
        with pytest.raises(RuntimeError, match="protected tokens remain"):
            e.core.kv.tree.evict_all_and_reset()
        while e.core.has_work():
            e.core.step()


def test_admin_flip_over_http_under_load():
    """`POST /admin/flip` while a completion streams: the completion ends with the text of an
    unflipped server; bad bodies and targets get 4xx with a message."""
    import concurrent.futures
    import time

    import httpx

    from tests.server_process import start_server, stop_server

    body = {"model": "tiny-llama", "prompt": "def main():", "max_tokens": 300, "temperature": 0,
            "ignore_eos": True}
    args = ("--tp-size", "2", "--enable-flip", "--enable-hicache", "--hicache-host-gb", "0.01")
    texts = []
    for flip in (False, True):
        proc, url = start_server(*args)
        try:
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                fut = pool.submit(httpx.post, url + "/v1/completions", json=body, timeout=120)
                if flip:
                    time.sleep(0.3)  # the completion is under way
                    r = httpx.post(url + "/admin/flip", json={"tp_size": 1, "pp_size": 2},
                                   timeout=120)
                    assert r.status_code == 200, r.text
                    census = r.json()
                    assert census["target"] == "tp1×pp2" and census["rows_moved"] == 0
                    assert census["retracted"] == 1, census  # it flipped under the request
                    assert census["worst_segment"] in census["segments"]
                texts.append(fut.result().json()["choices"][0]["text"])
            if flip:
                for bad in ({"tp_size": 1, "pp_size": 2}, {"tp_size": 4, "pp_size": 1}):
                    r = httpx.post(url + "/admin/flip", json=bad, timeout=30)
                    assert r.status_code == 400 and r.json()["error"]["message"], r.text
                r = httpx.post(url + "/admin/flip", json={"tp_size": "2"}, timeout=30)
                assert r.status_code in (400, 422), r.text
                info = httpx.get(url + "/server_info", timeout=30).json()
                assert (info["config"]["tp_size"], info["config"]["pp_size"]) == (1, 2)
        finally:
            stop_server(proc)
    assert texts[0] == texts[1] and texts[0]
