"""The host-image weights strategy of the phase flip (`model/weight_image.py`):
the checkpoint in one shared-memory file, checksummed, which a flip's new ranks copy their
shards from instead of reading the checkpoint again."""

from __future__ import annotations

import errno
import logging
import shutil
from pathlib import Path

import pytest
import torch

from phaseflip import Engine, SamplingParams
from phaseflip.config import EngineConfig
from phaseflip.errors import InvalidRequestError
from phaseflip.model import weight_image
from phaseflip.model.loader import iter_checkpoint_tensors
from phaseflip.model.weight_image import (
    WeightImage,
    WeightImageError,
    flip_weights_strategy,
    image_for_engine,
)
from tests.conftest import build_model, prompts_for

PARAMS = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True, logprobs=0)
CFG = {"device": "cpu", "dtype": "float32", "max_total_tokens": 4096, "dist_timeout_s": 60,
       "check_accounting": True}
FLIP = {"enable_flip": True, "enable_hicache": True, "hicache_host_gb": 0.01}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_image_round_trips_every_tensor_bit_exactly(tmp_path, dtype):
    model_dir = build_model(tmp_path / "m", "llama", dtype=dtype)
    path = tmp_path / "image"
    image = WeightImage.build(model_dir, path, register=False)
    try:
        want = list(iter_checkpoint_tensors(model_dir, progress=False))
        mapped = WeightImage.open(path, register=False)  # as a rank maps it, by name
        for img in (image, mapped):
            got = list(img.tensors())
            assert [n for n, _ in got] == [n for n, _ in want]
            for (name, g), (_, w) in zip(got, want):
                assert g.dtype == w.dtype == dtype and g.shape == w.shape, name
                assert torch.equal(_bits(g), _bits(w)), name
        assert mapped.verify() == sum(w.numel() * w.element_size() for _, w in want)
        mapped.close()
        assert path.exists()  # only the creator unlinks
    finally:
        image.close()
    assert not path.exists()


def test_a_corrupted_byte_fails_the_checksum_naming_its_tensor(llama_dir, tmp_path):
    image = WeightImage.build(llama_dir, tmp_path / "image", register=False)
    other = WeightImage.open(image.path, register=False)
    try:
        image.verify()
        name = "model.layers.1.mlp.down_proj.weight"
        e = other.entries[name]
        other.buf[e.offset + e.nbytes // 2] ^= 0x10  # a stray write into the shared memory
        with pytest.raises(WeightImageError, match=r"'model\.layers\.1\.mlp\.down_proj\.weight'"
                           r".*checksum"):
            image.verify()
        image.verify([n for n in image.entries if n != name])  # the others are intact
        # the pipelined load's stream: every tensor before it comes out, checked; it raises
        before = list(image.entries)[:list(image.entries).index(name)]
        seen = []
        with pytest.raises(WeightImageError, match="down_proj.*checksum"):
            for n, t in image.verified(image.entries, threads=2):
                seen.append(n)
                assert torch.equal(t, other.tensor(n))
        assert seen == before
    finally:
        other.close()
        image.close()



def test_a_mapping_checks_each_tensor_once_when_asked(llama_dir, tmp_path):
    """A flip's later seams copy what the rank's mapping already checked (`once`): the checks
    were the seam's floor. Without `once` (and with `verify`) every pass checks."""
    image = WeightImage.build(llama_dir, tmp_path / "image", register=False)
    try:
        names = list(image.entries)[:4]
        first = image.verified(names, threads=2, once=True)
        assert [n for n, _ in first] == names and first.nbytes > 0
        again = image.verified(names, threads=2, once=True)
        got = dict(again)
        assert again.nbytes == 0 and all(torch.equal(got[n], image.tensor(n)) for n in names)
        later = list(image.entries)[4:6]  # not checked yet: checked now
        stream = image.verified(names + later, threads=2, once=True)
        list(stream)
        assert stream.nbytes == sum(image.entries[n].nbytes for n in later)
        full = image.verified(names, threads=2)
        list(full)
        assert full.nbytes == sum(image.entries[n].nbytes for n in names)
    finally:
        image.close()


def test_host_image_refused_with_dummy_weights():
    with pytest.raises(InvalidRequestError, match="--flip-weights auto or reload") as exc:
        EngineConfig(load_format="dummy", flip_weights="host-image", tp_size=2, **FLIP)
    assert exc.value.param == "flip_weights"
    with pytest.raises(InvalidRequestError,
                       match="expected auto, resident, peer, host-image or reload"):
        EngineConfig(flip_weights="disk")
    # dummy weights have no checkpoint to image: auto means reload, the census says so
    assert flip_weights_strategy(EngineConfig(load_format="dummy", tp_size=2, **FLIP)) == "reload"
    assert flip_weights_strategy(EngineConfig(tp_size=2, **FLIP)) == "host-image"
    assert flip_weights_strategy(EngineConfig(tp_size=2, flip_weights="reload", **FLIP)) \
        == "reload"


@pytest.mark.parametrize("failure", ["shm too small", "no shm directory"])
def test_auto_falls_back_to_reload_when_the_image_cannot_be_built(llama_dir, tmp_path,
                                                                   monkeypatch, caplog,
                                                                   failure):
    if failure == "shm too small":
        monkeypatch.setattr(weight_image, "image_path", lambda: tmp_path / "image")

        def full(fd, offset, length):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(weight_image.os, "posix_fallocate", full)
    else:
        monkeypatch.setattr(weight_image, "image_path", lambda: tmp_path / "missing" / "img")
    base = {"model": str(llama_dir), "tp_size": 2, **FLIP}
    with caplog.at_level(logging.WARNING, logger=weight_image.__name__):
        assert image_for_engine(EngineConfig(**base)) is None
    assert "falling back to reload" in caplog.text
    with pytest.raises(WeightImageError, match="/dev/shm.*--flip-weights reload"):
        image_for_engine(EngineConfig(flip_weights="host-image", **base))
    assert list(tmp_path.iterdir()) == []  # nothing half-built left behind



@pytest.mark.timeout(120, method="thread")
def test_an_engine_whose_planner_chose_the_image_falls_back_to_reload(llama_dir, tmp_path,
                                                                    monkeypatch, caplog):
    """The engine's planner resolves `auto` before the image is built, so the config says
    host-image by then: a /dev/shm that cannot hold it must still fall back to reload
    (it raised, refusing to launch), and the ranks are told reload."""
    from phaseflip.flip import weights

    monkeypatch.setattr(weights, "RESIDENT_MAX_SHARE", 0.0)  # the planner picks the image
    monkeypatch.setattr(weight_image, "image_path", lambda: tmp_path / "missing" / "img")
    with caplog.at_level(logging.WARNING, logger=weight_image.__name__), \
            Engine(str(llama_dir), device="cpu", tp_size=2, **FLIP) as e:
        assert e.core.weights_plan.strategy == "host-image"
        assert e.core.weight_image is None and e.core.cfg.flip_weights == "reload"
    assert "falling back to reload" in caplog.text

def test_images_of_gone_engines_are_removed_and_headroom_is_kept(llama_dir, tmp_path,
                                                                   monkeypatch):
    """A killed engine cannot unlink its image: the next build removes images whose process
    is gone (and keeps a live one's). An image that would leave its tmpfs without
    SHM_HEADROOM free for NCCL's shared memory is refused, naming both fixes."""
    import os
    import subprocess
    import sys

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    stale = tmp_path / f"phaseflip-weights-{gone}-abcd"
    live = tmp_path / f"phaseflip-weights-{os.getpid()}-beef"
    stale.write_bytes(b"x")
    live.write_bytes(b"x")
    image = WeightImage.build(llama_dir, tmp_path / f"phaseflip-weights-{os.getpid()}-0001",
                              register=False)
    try:
        assert not stale.exists() and live.exists()
    finally:
        image.close()

    class Full:
        f_bavail, f_frsize = 1, 4096  # 4 KiB free

    monkeypatch.setattr(weight_image.os, "statvfs", lambda _: Full())
    with pytest.raises(WeightImageError, match="headroom.*--shm-size.*--flip-weights reload"):
        WeightImage.build(llama_dir, tmp_path / "img", register=False)
    assert not (tmp_path / "img").exists()


def _drive(engine: Engine, prompts, flips: dict, seam=None) -> tuple[dict, list]:
    core = engine.core
    for i, p in enumerate(prompts):
        core.add_request(f"r{i}", p, PARAMS)
    outs = {f"r{i}": ([], [], []) for i in range(len(prompts))}
    censuses, step = [], 0
    while core.has_work():
        deltas = []
        if step in flips:
            seam and seam("before")
            census, deltas = core.flip(*flips[step])
            censuses.append(census)
            seam and seam("after")
        for d in deltas + core.step():
            ids, lps, reasons = outs[d.request_id]
            ids += d.token_ids
            lps += d.logprobs or []
            reasons += [d.finish_reason] if d.finish_reason else []
        step += 1
    return outs, censuses


@pytest.mark.timeout(180, method="thread")  # signals cannot interrupt gloo
def test_flip_loads_from_the_host_image_and_not_the_checkpoint(llama_dir, tmp_path,
                                                               monkeypatch):
    """tp2 → pp2 → tp2 of a real checkpoint with --flip-weights host-image: during each seam
    the checkpoint's shards are moved away (a worker rank reading them would fail) and the
    driver's checkpoint reader is spied on; outputs equal the unflipped single-process run."""
    model_dir = Path(shutil.copytree(llama_dir, tmp_path / "llama"))
    prompts = prompts_for(300)
    with Engine(str(model_dir), **CFG) as e:
        want, _ = _drive(e, prompts, {})
    reads: list[str] = []
    real = weight_image.iter_checkpoint_tensors

    def spy(model_dir, **kw):
        reads.append(str(model_dir))
        return real(model_dir, **kw)

    shards = sorted(model_dir.glob("*.safetensors"))
    assert shards

    def seam(when: str) -> None:
        if when == "before":
            monkeypatch.setattr(weight_image, "iter_checkpoint_tensors", spy)
            for f in shards:
                f.rename(f.with_suffix(".away"))
        else:
            monkeypatch.undo()
            for f in shards:
                f.with_suffix(".away").rename(f)

    with Engine(str(model_dir), tp_size=2, flip_weights="host-image", **FLIP, **CFG) as e:
        image = e.core.weight_image
        assert image is not None and image.path.exists()
        got, censuses = _drive(e, prompts, {2: (1, 2), 5: (2, 1)}, seam)
        assert e.core.weight_image is image  # the engine's, across every flip
    assert not image.path.exists()  # unlinked at the engine's end
    assert reads == [], "rank 0 read the checkpoint during a flip"
    assert [c.target for c in censuses] == ["tp1×pp2", "tp2×pp1"]
    for c in censuses:
        assert c.weights == "host-image"
        assert c.weights_load_s is not None and c.weights_read_s is not None
        assert c.weights_h2d_wait_s is None and c.weights_drain_s is None  # CPU: no device copy
        assert "weights host-image (rank 0" in c.done_line()
    for rid, (ids, lps, reasons) in got.items():
        assert reasons == ["length"], rid
        assert ids == want[rid][0], rid
        assert lps == pytest.approx(want[rid][1], abs=1e-4), rid
