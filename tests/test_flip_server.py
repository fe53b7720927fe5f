"""The phase flip through a real `phaseflip serve`: `POST /admin/flip` under a streaming
completion, and the auto policy flipping a server by itself (moved out of test_flip.py, whose
tests drive the engine in-process)."""

from __future__ import annotations

import concurrent.futures
import time

import httpx

from tests.server_process import start_server, stop_server


def _poll_during_flip(httpx, url: str, flip_call) -> dict:
    """Polls /server_info and /metrics and tries a second flip while `flip_call` runs; notes
    whether the info said a flip was in progress and whether the second flip got 409."""
    seen = {"info": False, "conflict": False}
    while not flip_call.done():
        info = httpx.get(url + "/server_info", timeout=5)
        assert info.status_code == 200, info.text
        in_seam = info.json().get("flip_in_progress") == "tp1×pp2"
        seen["info"] |= in_seam
        assert httpx.get(url + "/metrics", timeout=5).status_code == 200
        if in_seam:  # only then: sent before the test's own flip arrived (a loaded box can
            # run this loop first), a second flip would be the one that runs, and the
            # test's flip the one refused. After the seam the same target is refused as
            # the current layout, not run again.
            again = httpx.post(url + "/admin/flip", json={"tp_size": 1, "pp_size": 2},
                               timeout=5)
            assert again.status_code in (400, 409), again.text
            seen["conflict"] |= again.status_code == 409
        time.sleep(0.05)
    return seen


def _wait_running(httpx, url: str, deadline_s: float = 30.0) -> None:
    """Returns once the engine runs a request (not a fixed sleep: a slow box may not have
    admitted it yet, a fast one may have finished it)."""
    end = time.monotonic() + deadline_s
    while httpx.get(url + "/server_info", timeout=5).json()["running"] < 1:
        assert time.monotonic() < end, "the completion never started running"
        time.sleep(0.01)


def test_admin_flip_over_http_under_load():
    """`POST /admin/flip` while a completion streams: the completion ends with the text of an
    unflipped server (the same server's, before its first flip); bad bodies and targets get
    4xx with a message."""
    # 150 tokens: ~2.7 s of tp2 decode on a 2-core box, the flip is sent once it runs
    body = {"model": "tiny-llama", "prompt": "def main():", "max_tokens": 150, "temperature": 0,
            "ignore_eos": True}
    args = ("--tp-size", "2", "--enable-flip", "--enable-hicache", "--hicache-host-gb", "0.01")
    proc, url = start_server(*args)
    try:
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        unflipped = r.json()["choices"][0]["text"]
        # the next completion starts with an empty prefix cache, as on a fresh server
        assert httpx.post(url + "/flush_cache", timeout=30).status_code == 200
        with concurrent.futures.ThreadPoolExecutor(1) as pool, \
                concurrent.futures.ThreadPoolExecutor(1) as pool_flip:
            fut = pool.submit(httpx.post, url + "/v1/completions", json=body, timeout=120)
            _wait_running(httpx, url)  # the completion is under way
            flip_call = pool_flip.submit(
                httpx.post, url + "/admin/flip", json={"tp_size": 1, "pp_size": 2},
                timeout=120)
            _poll_during_flip(httpx, url, flip_call)
            r = flip_call.result()
            assert r.status_code == 200, r.text
            # the status endpoints answered 200 throughout (_poll_during_flip). Whether a poll
            # lands inside the seam depends on its length (0.05-0.2 s on CPU since ranks
            # persist): the mid-seam answers (flip_in_progress, 409) are checked
            # deterministically, with the engine frozen, in tests/test_flip_guard.py
            census = r.json()
            assert census["target"] == "tp1×pp2" and census["rows_moved"] == 0
            assert census["retracted"] == 1, census  # it flipped under the request
            assert census["worst_segment"] in census["segments"]
            flipped = fut.result().json()["choices"][0]["text"]
        for bad in ({"tp_size": 1, "pp_size": 2}, {"tp_size": 4, "pp_size": 1}):
            r = httpx.post(url + "/admin/flip", json=bad, timeout=30)
            assert r.status_code == 400 and r.json()["error"]["message"], r.text
            assert r.json()["error"]["param"] == "layout", r.text  # (was null: engine-side)
        r = httpx.post(url + "/admin/flip", json={"tp_size": "2"}, timeout=30)
        assert r.status_code in (400, 422), r.text
        info = httpx.get(url + "/server_info", timeout=30).json()
        assert (info["config"]["tp_size"], info["config"]["pp_size"]) == (1, 2)
        # a manual flip's seam is busy time: idle, a flip back adds at least its seam
        back = httpx.post(url + "/admin/flip", json={"tp_size": 2, "pp_size": 1},
                          timeout=120)
        assert back.status_code == 200, back.text
        busy = httpx.get(url + "/server_info", timeout=30).json()["busy_s"]
        assert busy - info["busy_s"] >= back.json()["total_s"] > 0
    finally:
        stop_server(proc)
    assert flipped == unflipped and unflipped


def test_auto_policy_flips_a_server_by_itself():
    """`--flip-policy auto` with seeds saying pp2 prefills 10× faster and seams cost ~nothing,
    and prompts prefilled 64 tokens a step (a backlog the policy can see): the server flips to
    pp2 by itself and back; every completion equals the manual-policy server's, and
    /server_info says what the policy did (its Ready re-send keeps the front end serving)."""
    prompts = [f"def f{i}(x):\n    return x + {i}\n" * 12 for i in range(4)]
    base = ("--tp-size", "2", "--enable-flip", "--enable-hicache", "--hicache-host-gb", "0.01",
            "--chunked-prefill-size", "64")
    auto = ("--flip-policy", "auto", "--flip-seed-pp-speedup", "10", "--flip-seed-to-pp-s",
            "0.001", "--flip-seed-to-tp-s", "0.001", "--flip-min-dwell-s", "0",
            "--flip-min-dwell-steps", "1")
    texts, infos = [], []
    # both servers start (and stop) side by side, ~7 s less than one after the other; each
    # serves its completions alone (an idle server takes ~2 % of a core)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        starts = [pool.submit(start_server, *args) for args in (base, base + auto)]
    procs = [f.result()[0] for f in starts if f.exception() is None]
    try:
        for start in starts:
            url = start.result()[1]  # (raises if that server did not start)

            def complete(prompt: str, url: str = url) -> str:
                r = httpx.post(url + "/v1/completions", timeout=180, json={
                    "model": "tiny-llama", "prompt": prompt, "max_tokens": 24,
                    "temperature": 0, "ignore_eos": True})
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["text"]

            with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
                texts.append(list(pool.map(complete, prompts)))
            infos.append(httpx.get(url + "/server_info", timeout=30).json())
    finally:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            list(pool.map(stop_server, procs))
    assert texts[0] == texts[1] and all(texts[0])
    manual, policy = infos[0]["flip_policy"], infos[1]["flip_policy"]
    assert manual["policy"] == "manual" and manual["flips"] == 0
    assert policy["policy"] == "auto" and policy["auto_flips"] >= 1, policy
    assert policy["estimates"]["prefill_tps"]["X"]["provenance"] == "measured", policy
