"""Checkpoint streaming (sharded + single file), its validation errors, and tokenizer loading,
all on tiny checkpoints written by transformers in the test."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from phaseflip.errors import ModelLoadError
from phaseflip.model.config import ModelConfig
from phaseflip.model.loader import (
    checkpoint_tensor_names,
    iter_checkpoint_tensors,
    load_tokenizer,
)


def _tiny_llama(tie: bool = False) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(torch.bfloat16)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("loader")
    model = _tiny_llama()
    model.save_pretrained(root / "sharded", max_shard_size="50KB")
    model.save_pretrained(root / "single")
    _tiny_llama(tie=True).save_pretrained(root / "tied")
    torch.save(model.state_dict(), root / "reference.pt")
    return {"sharded": root / "sharded", "single": root / "single", "tied": root / "tied",
            "reference": root / "reference.pt"}


@pytest.fixture()
def reference(checkpoints: dict[str, Path]) -> dict[str, torch.Tensor]:
    return torch.load(checkpoints["reference"])


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_sharded_checkpoint_yields_every_tensor(
    checkpoints: dict[str, Path], reference: dict[str, torch.Tensor]
) -> None:
    d = checkpoints["sharded"]
    shards = sorted(d.glob("*.safetensors"))
    assert len(shards) > 1 and (d / "model.safetensors.index.json").is_file()
    loaded = dict(iter_checkpoint_tensors(d, progress=False))
    assert set(loaded) == set(reference) == checkpoint_tensor_names(d)
    for name, tensor in loaded.items():
        assert tensor.device.type == "cpu" and tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, reference[name]), name
    assert ModelConfig.from_dir(d).dtype == torch.bfloat16


def test_single_file_checkpoint(
    checkpoints: dict[str, Path], reference: dict[str, torch.Tensor]
) -> None:
    d = checkpoints["single"]
    assert [p.name for p in d.glob("*.safetensors")] == ["model.safetensors"]
    pairs = list(iter_checkpoint_tensors(str(d), progress=False))
    assert len(pairs) == len(reference)
    assert all(torch.equal(t, reference[n]) for n, t in pairs)


def test_tied_checkpoint_has_no_lm_head(checkpoints: dict[str, Path]) -> None:
    d = checkpoints["tied"]
    assert "lm_head.weight" not in checkpoint_tensor_names(d)
    assert ModelConfig.from_dir(d).tie_word_embeddings is True


def test_progress_bar(checkpoints: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    d = checkpoints["single"]
    n = len(list(iter_checkpoint_tensors(d, progress=False)))
    assert capsys.readouterr().err == ""
    assert len(list(iter_checkpoint_tensors(d, desc="Stage 0 weights"))) == n
    err = capsys.readouterr().err
    assert "Stage 0 weights" in err and f"{n}/{n}" in err


def test_iteration_is_lazy_and_can_stop_early(checkpoints: dict[str, Path]) -> None:
    it = iter_checkpoint_tensors(checkpoints["sharded"], progress=False)
    name, tensor = next(it)
    assert isinstance(name, str) and isinstance(tensor, torch.Tensor)
    it.close()


def test_missing_shard_is_named(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    d = _copy(checkpoints["sharded"], tmp_path / "m")
    victim = sorted(d.glob("model-*.safetensors"))[1]
    victim.unlink()
    for call in (lambda: iter_checkpoint_tensors(d), lambda: checkpoint_tensor_names(d)):
        with pytest.raises(ModelLoadError, match=f"shard '{victim.name}'.*is missing") as exc:
            call()
        assert str(victim) in str(exc.value)


def test_index_promising_an_absent_tensor(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    d = _copy(checkpoints["sharded"], tmp_path / "m")
    index_path = d / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    index["weight_map"]["model.layers.9.mlp.up_proj.weight"] = shard
    index_path.write_text(json.dumps(index))
    with pytest.raises(
        ModelLoadError, match=f"shard '{shard}' lacks 1 tensor.*model.layers.9.mlp.up_proj"
    ):
        iter_checkpoint_tensors(d, progress=False)


def test_index_is_authoritative(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """Stray tensors and stray files the index does not list are not loaded (as in HF)."""
    d = _copy(checkpoints["sharded"], tmp_path / "m")
    save_file({"layers.0.attention.wq.weight": torch.zeros(2)}, d / "consolidated.safetensors")
    index_path = d / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    dropped = sorted(index["weight_map"])[0]
    del index["weight_map"][dropped]
    index_path.write_text(json.dumps(index))
    names = {n for n, _ in iter_checkpoint_tensors(d, progress=False)}
    assert names == set(index["weight_map"]) == checkpoint_tensor_names(d)


def test_malformed_index(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    d = _copy(checkpoints["sharded"], tmp_path / "m")
    (d / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(ModelLoadError, match="no valid 'weight_map'"):
        checkpoint_tensor_names(d)
    (d / "model.safetensors.index.json").write_text("{")
    with pytest.raises(ModelLoadError, match="index.json is not valid JSON"):
        checkpoint_tensor_names(d)


def test_glob_fallback_without_index(tmp_path: Path) -> None:
    save_file({"a": torch.ones(2), "b": torch.zeros(3)}, tmp_path / "part-1.safetensors")
    save_file({"c": torch.arange(4)}, tmp_path / "part-2.safetensors")
    got = dict(iter_checkpoint_tensors(tmp_path, progress=False))
    assert sorted(got) == ["a", "b", "c"] and torch.equal(got["c"], torch.arange(4))
    save_file({"c": torch.arange(4)}, tmp_path / "part-3.safetensors")
    with pytest.raises(ModelLoadError, match="tensor 'c' appears in both part-2.*part-3"):
        checkpoint_tensor_names(tmp_path)
    # model.safetensors, when present without an index, is the checkpoint (as in HF).
    save_file({"x": torch.ones(1)}, tmp_path / "model.safetensors")
    assert checkpoint_tensor_names(tmp_path) == {"x"}


def test_only_pytorch_bin_is_rejected(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(2)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="only the safetensors format is supported") as exc:
        list(iter_checkpoint_tensors(tmp_path))
    assert "pytorch_model.bin" in str(exc.value) and str(tmp_path) in str(exc.value)


def test_corrupt_safetensors_file(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 8 + b"{}")
    with pytest.raises(ModelLoadError, match="corrupt header length.*model.safetensors"):
        checkpoint_tensor_names(tmp_path)
    (tmp_path / "model.safetensors").write_bytes((4).to_bytes(8, "little") + b"{no}")
    with pytest.raises(ModelLoadError, match="corrupt header"):
        checkpoint_tensor_names(tmp_path)


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        checkpoint_tensor_names(tmp_path / "absent")
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_tokenizer(tmp_path / "absent")


def _save_tiny_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(["hello world, hello phaseflip", "the quick brown fox"], trainer)
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(out)


def test_load_tokenizer(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    d = _copy(checkpoints["single"], tmp_path / "m")
    _save_tiny_tokenizer(d)
    tok = load_tokenizer(d)
    ids = tok.encode("hello world", add_special_tokens=False)
    assert ids and tok.decode(ids).replace(" ", "") == "helloworld"
    assert tok.eos_token == "</s>" and tok.convert_tokens_to_ids("</s>") == 2


def test_no_tokenizer_files(checkpoints: dict[str, Path]) -> None:
    with pytest.raises(ModelLoadError, match="no tokenizer files in .*single"):
        load_tokenizer(checkpoints["single"])


def test_broken_tokenizer_is_wrapped(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(ModelLoadError, match="cannot load the tokenizer"):
        load_tokenizer(tmp_path)


def test_the_load_bar_follows_the_log_level(monkeypatch):
    """`serve --log-level warning` silences the checkpoint's progress bar with the INFO lines
    (TQDM_DISABLE, which the explicit `disable=` had overridden; the engine and its ranks
    inherit it); at info, or unset, the bar shows."""
    import subprocess
    import sys

    from phaseflip import cli

    code = ("from phaseflip.config import EMBEDDED_MODEL\n"
            "from phaseflip.model.loader import iter_checkpoint_tensors\n"
            "list(iter_checkpoint_tensors(EMBEDDED_MODEL))\n")
    for env, bar in (({}, True), ({"TQDM_DISABLE": "1"}, False)):
        err = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=120, env={**os.environ, **env}).stderr
        assert ("tensor/s" in err or "tensor]" in err) == bar, (env, err[-500:])
    monkeypatch.setattr(cli.logging, "basicConfig", lambda **kw: None)  # (this process's)
    for level, quiet in (("info", False), ("warning", True)):
        monkeypatch.delenv("TQDM_DISABLE", raising=False)
        cli._setup_logging(level)
        assert (os.environ.get("TQDM_DISABLE") == "1") == quiet, level
