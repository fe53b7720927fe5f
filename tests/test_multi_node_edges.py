"""Multi-node launch edges: two `phaseflip serve` processes as node 0 and node 1 on loopback
(the embedded tiny model on CPU ranks, gloo), and the rendezvous pieces they stand on.

What operators hit: node 1 started before node 0, node 0 never coming, flags that differ
between the nodes, node 1 dying while node 0 idles, MASTER_ADDR/MASTER_PORT. Every process
runs one torch thread and every wait has a deadline below the test's, so a hang fails.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch.distributed as dist

from phaseflip.distributed.rendezvous import (
    GroupFormationError,
    NodeCheckIns,
    NodeJoinError,
    NodeLink,
    RemoteNodes,
    model_fingerprint,
    split_addr,
    wait_for_port,
)
from phaseflip.errors import InvalidRequestError
from tests.server_process import alive, free_port

pytestmark = pytest.mark.timeout(120, method="thread")  # signals cannot interrupt gloo
PROMPT = "Return the"


class Node:
    """One `phaseflip serve` process of a test, its output in a file (a pipe could fill)."""

    def __init__(self, tmp: Path, name: str, *args: str, env: dict[str, str] | None = None):
        self.log = tmp / f"{name}.log"
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "phaseflip.cli", "serve", "--device", "cpu", *args],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
        self.seen: set[int] = set()

    def output(self) -> str:
        return self.log.read_text()

    def remember_descendants(self) -> None:
        """Every process under this one, now (checked for orphans after it ends)."""
        from phaseflip.distributed.spawner import child_pids

        todo = [self.proc.pid]
        while todo:
            kids = child_pids(todo.pop())
            self.seen.update(kids)
            todo += kids

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running after {timeout} s:\n{self.output()}") from None

    def kill(self) -> None:
        self.remember_descendants()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        for pid in self.seen:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(10)


def common(addr: str, *extra: str) -> list[str]:
    return ["--nnodes", "2", "--dist-init-addr", addr, *extra]


def wait_health(url: str, node: Node, deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        assert node.proc.poll() is None, f"node 0 exited:\n{node.output()}"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"node 0 not healthy in {deadline_s} s:\n{node.output()}")


def complete(url: str, prompt: str | list[str] = PROMPT) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=60, json={
        "model": "tiny-llama", "prompt": prompt, "max_tokens": 8, "temperature": 0})


def no_orphans(*nodes: Node, deadline_s: float = 10) -> None:
    end = time.monotonic() + deadline_s
    left = [p for n in nodes for p in n.seen]
    while time.monotonic() < end and [p for p in left if alive(p)]:
        time.sleep(0.2)
    assert not [p for p in left if alive(p)], "orphaned processes"


@pytest.fixture
def nodes():
    started: list[Node] = []
    yield started
    for n in started:
        n.kill()


# ---- two processes --------------------------------------------------------------------------

def test_node1_waits_for_a_late_node0_and_both_stop_on_sigterm(tmp_path, nodes):
    """Node 1 first: it says it waits (naming the address and the deadline) and joins when
    node 0 comes 5 s later; the answers (a batch of two) equal one process's; node 0's SIGTERM
    ends both, no rank left behind."""
    from phaseflip import Engine, SamplingParams

    prompts = [PROMPT, "def main():"]
    with Engine(device="cpu", cpu_threads=1) as e:
        want = [o.text for o in e.generate(prompts, SamplingParams(
            temperature=0, max_new_tokens=8), use_tqdm=False)]
    addr, port = f"127.0.0.1:{free_port()}", free_port()
    args = common(addr, "--tp-size", "2", "--dist-timeout-s", "90")
    nodes.append(node1 := Node(tmp_path, "node1", "--node-rank", "1", *args))
    time.sleep(5)
    assert node1.proc.poll() is None, node1.output()
    assert f"waiting for node 0's rendezvous at {addr}" in node1.output()
    assert "up to 90 s (--dist-timeout-s)" in node1.output()
    nodes.append(node0 := Node(tmp_path, "node0", "--node-rank", "0", "--port", str(port),
                               *args))
    url = f"http://127.0.0.1:{port}"
    wait_health(url, node0, 90)
    r = complete(url, prompts)
    assert r.status_code == 200
    assert [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])] == want
    node0.remember_descendants()
    node1.remember_descendants()
    node0.proc.send_signal(signal.SIGTERM)
    assert node0.wait(30) == 0
    assert node1.wait(15) == 0, node1.output()
    no_orphans(node0, node1)


def test_node0_that_never_comes_is_named_within_the_timeout(tmp_path, nodes):
    addr = f"127.0.0.1:{free_port()}"
    start = time.monotonic()
    nodes.append(node1 := Node(tmp_path, "node1", "--node-rank", "1",
                               *common(addr, "--tp-size", "2", "--dist-timeout-s", "4")))
    assert node1.wait(40) == 1
    out = node1.output()
    assert time.monotonic() - start < 40
    assert f"node 0 did not open its rendezvous at {addr} (--dist-init-addr) within 4 s " \
           "(--dist-timeout-s)" in out, out
    assert "Traceback" not in out, out


# (one pair of processes: every other agreed flag, --dtype included, takes the same path:
# `test_dist_spec_carries_the_agreement…`, `test_check_in_names_every_differing_flag…`)
@pytest.mark.parametrize("node1_flags, named", [
    (("--tp-size", "4"), "--tp-size 4 on node 1, 2 on node 0"),  # other world: rank 0 hung 300 s
])
def test_mismatched_flags_are_named_on_both_sides(tmp_path, nodes, node1_flags, named):
    addr, port = f"127.0.0.1:{free_port()}", free_port()
    base = common(addr, "--dist-timeout-s", "60")
    nodes.append(node1 := Node(tmp_path, "node1", "--node-rank", "1", *base, *node1_flags))
    nodes.append(node0 := Node(tmp_path, "node0", "--node-rank", "0", "--port", str(port),
                               *base, "--tp-size", "2", "--dtype", "float32"))
    assert node1.wait(60) == 1
    assert node0.wait(30) == 1
    for node in (node0, node1):
        last = node.output().strip().splitlines()[-1]
        assert "phaseflip exits with code 1" in last and named in last, node.output()
        assert "start every node with the same flags" in last


def test_node1_killed_while_node0_idles_turns_health_unhealthy(tmp_path, nodes):
    """No request needed: node 1's beats stop, /health answers 503 within seconds and node 0
    exits 1 naming node 1 (before: /health 200 until a request failed)."""
    addr, port = f"127.0.0.1:{free_port()}", free_port()
    args = common(addr, "--pp-size", "2", "--dist-timeout-s", "60")
    nodes.append(node1 := Node(tmp_path, "node1", "--node-rank", "1", *args))
    nodes.append(node0 := Node(tmp_path, "node0", "--node-rank", "0", "--port", str(port),
                               *args))
    url = f"http://127.0.0.1:{port}"
    wait_health(url, node0, 90)
    assert complete(url).status_code == 200
    node0.remember_descendants()
    node1.kill()
    killed, status = time.monotonic(), 200
    while time.monotonic() - killed < 30 and status == 200:
        time.sleep(0.5)
        try:
            status = httpx.get(url + "/health", timeout=5).status_code
        except httpx.HTTPError:
            status = 0  # already gone: unhealthy too
    assert status != 200, "node 0 still healthy 30 s after node 1 died"
    assert node0.wait(30) == 1
    assert "node 1 (its `phaseflip serve --node-rank 1` sent no heartbeat" in node0.output()
    no_orphans(node0)


def test_master_addr_and_port_stand_for_dist_init_addr(tmp_path, nodes):
    port = free_port()
    nodes.append(node1 := Node(tmp_path, "node1", "--node-rank", "1", "--nnodes", "2",
                               "--tp-size", "2", "--dist-timeout-s", "2",
                               env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}))
    assert node1.wait(40) == 1, node1.output()
    assert f"rendezvous at 127.0.0.1:{port}" in node1.output()


def test_flips_across_nodes_are_refused_at_launch(tmp_path, nodes):
    """Flips need HiCache, whose host tier is one node's memory: refused before any rank."""
    nodes.append(node0 := Node(tmp_path, "node0", "--node-rank", "0", "--port", "0",
                               *common("127.0.0.1:1", "--tp-size", "2", "--enable-flip",
                                       "--enable-hicache")))
    assert node0.wait(40) == 2
    assert "needs every rank on one host" in node0.output()


# ---- the rendezvous pieces, in one process ----------------------------------------------------

@pytest.fixture
def store():
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=10))
    yield master, f"127.0.0.1:{port}"


def client(addr: str) -> dist.TCPStore:
    host, port = split_addr(addr)
    return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=10))


def test_split_addr():
    assert split_addr("10.0.0.1:29500") == ("10.0.0.1", 29500)
    assert split_addr("[fe80::1]:29500") == ("fe80::1", 29500)
    for bad in ("node0", "node0:", ":29500", "node0:http", "node0:70000"):
        with pytest.raises(InvalidRequestError, match="--dist-init-addr"):
            split_addr(bad)


def test_wait_for_port_names_the_address_and_the_timeout():
    addr = f"127.0.0.1:{free_port()}"
    start = time.monotonic()
    with pytest.raises(NodeJoinError, match=rf"at {addr} \(--dist-init-addr\) within 1.5 s"):
        wait_for_port(*split_addr(addr), 1.5, "node 1", addr)
    assert time.monotonic() - start < 5


def check_in(addr: str, node: int, flags: dict[str, str]
             ) -> tuple[list[BaseException], threading.Thread]:
    """A node's check-in, in a thread; returns the list its error lands in, and the thread."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            NodeLink(client(addr), node).check_in(tuple(flags.items()), 10, addr)
        except BaseException as e:  # noqa: BLE001 — the test inspects it
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    return errors, t


def poll_until(check_ins: NodeCheckIns, arrivals: int) -> None:
    end = time.monotonic() + 10
    while check_ins.seen < arrivals and time.monotonic() < end:
        check_ins.poll()
        time.sleep(0.05)


def test_check_in_names_every_differing_flag_on_both_sides(store):
    master, addr = store
    mine = {"--tp-size": "2", "--pp-size": "1", "--model": "/m"}
    check_ins = NodeCheckIns(master, 2, tuple(mine.items()), addr)
    errors, t = check_in(addr, 1, mine | {"--tp-size": "1", "--pp-size": "2"})
    with pytest.raises(GroupFormationError) as refused:
        poll_until(check_ins, 1)
    t.join(10)
    both = "--tp-size 1 on node 1, 2 on node 0; --pp-size 2 on node 1, 1 on node 0"
    assert both in str(refused.value)
    assert len(errors) == 1 and isinstance(errors[0], NodeJoinError)
    assert both in str(errors[0]) and addr in str(errors[0])


def test_a_second_host_checking_in_as_the_same_node_is_refused(store):
    master, addr = store
    flags = {"--tp-size": "2"}
    check_ins = NodeCheckIns(master, 2, tuple(flags.items()), addr)
    first, t1 = check_in(addr, 1, flags)
    poll_until(check_ins, 1)
    t1.join(10)
    assert not first
    second, t2 = check_in(addr, 1, flags)
    with pytest.raises(GroupFormationError, match="two hosts checked in as node 1"):
        poll_until(check_ins, 2)
    t2.join(10)
    assert second and "--node-rank 1 on both" in str(second[0])


def test_model_fingerprint_tells_checkpoints_apart(tmp_path):
    from types import SimpleNamespace

    def model(name: str, config: dict, weights: int) -> SimpleNamespace:
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(config))
        (d / "model.safetensors").write_bytes(b"\0" * weights)
        (d / "tokenizer.json").write_text(name)  # not part of the ranks' identity
        return SimpleNamespace(model_dir=str(d))

    a = model_fingerprint(model("a", {"hidden_size": 64}, 100))
    assert a == model_fingerprint(model("b", {"hidden_size": 64}, 100))
    assert a != model_fingerprint(model("c", {"hidden_size": 32}, 100))
    assert a != model_fingerprint(model("d", {"hidden_size": 64}, 101))


def test_remote_nodes_names_exited_ranks_and_silent_nodes(store):
    _, addr = store
    watcher = RemoteNodes(addr, 3, silence_s=1.5)
    node1, node2 = NodeLink(client(addr), 1), NodeLink(client(addr), 2)
    for i in range(3):
        node1.beat([])
        node2.beat(["phaseflip-rank2 (exit code -9)"] if i == 2 else [])
        time.sleep(1.05)
        failed = watcher.failed()
    assert failed == ["node 2: phaseflip-rank2 (exit code -9)"]
    time.sleep(2.6)  # nobody beats now
    failed = watcher.failed()
    assert failed[0].startswith("node 1 (its `phaseflip serve --node-rank 1` sent no heartbeat")
    assert failed[1] == "node 2: phaseflip-rank2 (exit code -9)" and len(failed) == 3


def test_dist_spec_carries_the_agreement_and_refuses_a_malformed_addr():
    """`serve --node-rank k` and rank 0 build their check-in from the same DistSpec; an address
    that is no host:port is named before any rank starts (it was an int() ValueError in a
    rank's join)."""
    from phaseflip.config import EngineConfig
    from phaseflip.distributed.group import DistSpec
    from phaseflip.model.config import ModelConfig

    cfg = EngineConfig(device="cpu", tp_size=2, nnodes=2, node_rank=1,
                       dist_init_addr="127.0.0.1:29500")
    spec = DistSpec.from_config(cfg, ModelConfig.from_dir(cfg.model))
    flags = dict(spec.agreement)
    assert spec.nnodes == 2 and flags["--tp-size"] == "2"
    assert flags["--dtype"] == str(cfg.dtype)  # (a node of another dtype was served silently)
    assert "--model" not in flags  # a local directory is known by its files, not its path
    assert flags["the model's config.json and weight files"]
    assert flags["the process-group backend"] == "gloo"
    one_node = EngineConfig(device="cpu", tp_size=2)
    assert DistSpec.from_config(one_node, ModelConfig.from_dir(cfg.model)).agreement == ()
    bad = EngineConfig(device="cpu", tp_size=2, nnodes=2, dist_init_addr="node0")
    with pytest.raises(InvalidRequestError, match="--dist-init-addr 'node0': expected host:port"):
        DistSpec.from_config(bad, ModelConfig.from_dir(bad.model))


def _exit_with(code: int) -> None:
    if code < 0:  # killed after the node's beats began: only its last beat can name it
        time.sleep(0.5)
        os.kill(os.getpid(), -code)
    sys.exit(code)


def test_watch_names_a_killed_rank_in_its_last_beat_and_fails(store):
    """A node whose rank was killed while its other rank ended cleanly exits 1 (it took the
    largest exit code: 0 over -9), and its last beat names the rank for rank 0."""
    import multiprocessing as mp

    _, addr = store
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_exit_with, args=(code,), name=f"phaseflip-rank{r}")
             for r, code in ((2, 0), (3, -signal.SIGKILL))]
    for p in procs:
        p.start()
    watcher = RemoteNodes(addr, 2, silence_s=30)
    assert NodeLink(client(addr), 1).watch(procs) == 1
    assert watcher.failed() == ["node 1: phaseflip-rank3 (exit code -9)"]
