"""Multi-node edges, second part: what identifies the model across hosts, a node 0 that freezes
or goes away while node k's ranks run, and how long each side waits for the other.

Node 0 is played by its rendezvous alone (a TCPStore and `NodeCheckIns` in a process of its
own, which the test stops or ends) and node k by a real `phaseflip serve --node-rank 1` or by
`NodeLink` itself: the edges need no server on node 0, and the whole file stays near 20 s.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from phaseflip.config import EMBEDDED_MODEL, EngineConfig
from phaseflip.distributed.group import JOIN_KEY, DistSpec, _await_ranks
from phaseflip.distributed.rendezvous import (
    FINGERPRINT,
    HUB_ID,
    NODE0_GONE_EXIT,
    GroupFormationError,
    NodeCheckIns,
    NodeLink,
    differences,
    node0_gone,
    split_addr,
)
from phaseflip.model.config import ModelConfig
from phaseflip.model.resolve import resolve_model
from tests.server_process import free_port
from tests.test_multi_node_edges import Node, client

pytestmark = pytest.mark.timeout(90, method="thread")  # signals cannot interrupt gloo
HUB_MODEL = "meta-llama/Llama-3.1-8B"


@pytest.fixture
def nodes():
    started: list[Node] = []
    yield started
    for n in started:
        n.kill()


@pytest.fixture
def store():
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=10))
    yield master, f"127.0.0.1:{port}"


def hub_cache(root: Path, repo: str = HUB_MODEL, commit: str = "a" * 40,
              weights: Path | None = None) -> Path:
    """A local Hugging Face cache at `root` holding the tiny model as `repo` (its files
    linked, as the hub links them to blobs); `weights` replaces model.safetensors."""
    snapshot = root / f"models--{repo.replace('/', '--')}" / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text(commit)
    for f in EMBEDDED_MODEL.iterdir():
        src = weights if weights is not None and f.name == "model.safetensors" else f
        (snapshot / f.name).symlink_to(src)
    return root


def agreement(model: str, hub: Path | None = None) -> dict[str, str]:
    """The check-in flags of `serve --model MODEL --tp-size 2 --nnodes 2` (MODEL resolved in
    the hub cache `hub`, as on a host whose HF_HUB_CACHE is `hub`)."""
    env = {"HF_HUB_CACHE": str(hub)} if hub is not None else {}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        cfg = resolve_model(EngineConfig(model=model, device="cpu", tp_size=2, nnodes=2,
                                         dist_init_addr="127.0.0.1:29500"))
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return dict(DistSpec.from_config(cfg, ModelConfig.from_dir(cfg.model)).agreement)


def test_the_model_is_known_by_its_hub_id_and_files_not_by_its_path(tmp_path):
    """A hub id whose snapshot lies at another path on each host checks in (it was refused:
    node 0's resolved path was a checked flag), and so does a copy of the files in a plain
    directory; another id, or a fine-tune with its base's names and sizes, is refused."""
    node0 = agreement(HUB_MODEL, hub_cache(tmp_path / "hub0"))
    assert node0[HUB_ID] == HUB_MODEL
    same = [agreement(HUB_MODEL, hub_cache(tmp_path / "hub1", commit="b" * 40)),
            agreement(str(EMBEDDED_MODEL))]  # the files, at a path of their own
    for node1 in same:
        assert differences(node0, node1, "on node 0", "on node 1") == []
        assert differences(node1, node0, "on node 1", "on node 0") == []
    other_id = agreement("meta-llama/Llama-3.1-8B-Instruct",
                         hub_cache(tmp_path / "hub2", repo="meta-llama/Llama-3.1-8B-Instruct"))
    assert differences(node0, other_id, "on node 0", "on node 1") == [
        f"{HUB_ID} meta-llama/Llama-3.1-8B-Instruct on node 1, {HUB_MODEL} on node 0"]
    tuned = tmp_path / "tuned.safetensors"
    data = bytearray((EMBEDDED_MODEL / "model.safetensors").read_bytes())
    data[len(data) // 2] ^= 0xFF  # same names, shapes and size; other weights
    tuned.write_bytes(bytes(data))
    fine_tune = agreement(HUB_MODEL, hub_cache(tmp_path / "hub3", weights=tuned))
    assert [d.split(" ")[0] for d in differences(node0, fine_tune, "", "")] == \
           [FINGERPRINT.split(" ")[0]]


def fake_node0(addr: str, hub: str, until: str) -> None:
    """Node 0's rendezvous alone, as `serve --model HUB_MODEL --tp-size 2 --nnodes 2` with
    HF_HUB_CACHE=`hub` opens it: answers check-ins until the key `until` is set, then ends
    (its store closes with it, as when node 0 stops)."""
    os.environ["HF_HUB_CACHE"] = hub
    cfg = resolve_model(EngineConfig(model=HUB_MODEL, device="cpu", tp_size=2, nnodes=2,
                                     dist_init_addr=addr))
    spec = DistSpec.from_config(cfg, ModelConfig.from_dir(cfg.model))
    host, port = split_addr(addr)
    master = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=30))
    check_ins = NodeCheckIns(master, 2, spec.agreement, addr)
    end = time.monotonic() + 60
    while not master.check([until]) and time.monotonic() < end:
        check_ins.poll()
        time.sleep(0.05)
    print("node 0 ends", flush=True)
    os._exit(0)


def start_fake_node0(addr: str, hub: Path, until: str) -> subprocess.Popen:
    code = f"from tests.test_multi_node_edges2 import fake_node0; " \
           f"fake_node0({addr!r}, {str(hub)!r}, {until!r})"
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize("until", ["phaseflip/node_verdict/1/read", f"{JOIN_KEY}1"],
                         ids=["before-its-ranks-join", "while-its-ranks-join"])
def test_node0_gone_after_the_check_in_ends_node_k_in_one_line(tmp_path, nodes, until):
    """Node 0 ends (a clean SIGTERM before ready) after node 1 checked in with the same hub id
    from another cache path: node 1 exits 1 within seconds, its last line naming node 0 and
    the address, and no rank prints a traceback (before: the ranks waited twice
    --dist-timeout-s for the closed store, then each printed one; or a rank's group init
    failed with a stall report and a traceback)."""
    addr = f"127.0.0.1:{free_port()}"
    node0 = start_fake_node0(addr, hub_cache(tmp_path / "hub0"), until)
    try:
        nodes.append(node1 := Node(
            tmp_path, "node1", "--node-rank", "1", "--nnodes", "2", "--tp-size", "2",
            "--model", HUB_MODEL, "--dist-init-addr", addr, "--dist-timeout-s", "60",
            env={"HF_HUB_CACHE": str(hub_cache(tmp_path / "hub1", commit="b" * 40))}))
        assert node0.wait(40) == 0, node1.output()
        gone = time.monotonic()
        assert node1.wait(20) == 1, node1.output()
        assert time.monotonic() - gone < 15
    finally:
        if node0.poll() is None:
            node0.kill()
    out = node1.output()
    last = out.strip().splitlines()[-1]
    assert f"phaseflip exits with code 1: node 1: node 0 at {addr} (--dist-init-addr) went " \
           "away before this node's ranks were done" in last, out
    assert "Traceback" not in out and "stalled at" not in out, out


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


def test_a_frozen_node0_stops_node_k_within_the_silence():
    """Node 0 stopped by SIGSTOP keeps its sockets open, so node k's beats (writes) never
    failed and its idle ranks waited forever; now node k stops them and says so once node 0
    has not answered for `silence_s`."""
    port = free_port()
    addr = f"127.0.0.1:{port}"
    master = subprocess.Popen(
        [sys.executable, "-c", "import datetime, sys, time, torch.distributed as dist\n"
         f"s = dist.TCPStore('127.0.0.1', {port}, is_master=True, wait_for_workers=False)\n"
         "print('up', flush=True)\ntime.sleep(120)"],
        stdout=subprocess.PIPE, text=True, start_new_session=True)
    rank = mp.get_context("fork").Process(target=_sleep, args=(60,), name="phaseflip-rank1")
    try:
        assert master.stdout.readline() == "up\n"
        link = NodeLink(client(addr), 1, addr, silence_s=1.5)
        rank.start()
        os.kill(master.pid, signal.SIGSTOP)
        start = time.monotonic()
        assert link.watch([rank]) == 1
        assert time.monotonic() - start < 8
        assert rank.exitcode == -signal.SIGTERM
        assert re.match(rf"node 1: node 0 at {addr} \(--dist-init-addr\) has not answered "
                        r"for \d+ s \(stopped, frozen, or its host is down\)", link.failure)
    finally:
        if rank.is_alive():
            rank.kill()
        master.kill()
        master.wait(10)


def test_node0_gone_is_told_from_a_live_node0():
    """What a failing rank of node k asks before it reports: a closed port is node 0 gone
    (the rank exits NODE0_GONE_EXIT quietly), a listening one is not."""
    closed = f"127.0.0.1:{free_port()}"
    assert node0_gone(closed, patience_s=0.5)
    port = free_port()
    listening = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    start = time.monotonic()
    assert not node0_gone(f"127.0.0.1:{port}", patience_s=0.5)
    assert 0.5 <= time.monotonic() - start < 3
    del listening
    assert NODE0_GONE_EXIT not in (0, 1)


def test_watch_names_node0_when_a_rank_found_it_gone(store):
    """A rank that exits NODE0_GONE_EXIT makes node k's one line about node 0, not about its
    ranks; ranks that ended cleanly after node 0 went away (its STOP) are a clean exit."""
    _, addr = store
    ctx = mp.get_context("fork")
    rank = ctx.Process(target=os._exit, args=(NODE0_GONE_EXIT,), name="phaseflip-rank1")
    rank.start()
    link = NodeLink(client(addr), 1, addr)
    assert link.watch([rank]) == 1
    assert link.failure.startswith(f"node 1: node 0 at {addr} (--dist-init-addr) went away")


def test_rank0_waits_dist_timeout_for_a_node_to_check_in(store):
    """Node k waits --dist-timeout-s for node 0; rank 0 waited at least 300 s for node k. Now
    a node that has not checked in after --dist-timeout-s is named, while a node that checked
    in gets the join floor for its ranks (they start a torch process each)."""
    master, addr = store
    spec = DistSpec(world_size=2, tp_size=2, pp_size=1, init_addr=addr, backend="gloo",
                    timeout_s=1.0, ranks_per_node=1, node_rank=0,
                    agreement=(("--tp-size", "2"),))
    master.set(f"{JOIN_KEY}0", "1")
    errors: list[BaseException] = []

    def await_ranks() -> None:
        try:
            _await_ranks(master, spec, lambda: [])
        except BaseException as e:  # noqa: BLE001 — the test inspects it
            errors.append(e)

    t = threading.Thread(target=await_ranks, daemon=True)
    t.start()
    t.join(6)
    assert not t.is_alive(), "rank 0 still waits for node 1 after --dist-timeout-s"
    assert isinstance(errors[0], GroupFormationError)
    assert "node 1 did not check in within 1 s (--dist-timeout-s)" in str(errors[0])
    assert f"--dist-init-addr {addr}" in str(errors[0])

    t = threading.Thread(target=lambda: _await_ranks(master, spec, lambda: []),
                         daemon=True)
    t.start()
    NodeLink(client(addr), 1).check_in((("--tp-size", "2"),), 10, addr)
    time.sleep(1.5)  # past --dist-timeout-s: node 1 checked in, its rank is still welcome
    assert t.is_alive()
    master.set(f"{JOIN_KEY}1", "1")
    t.join(5)
    assert not t.is_alive()

