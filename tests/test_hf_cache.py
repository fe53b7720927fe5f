"""`--model ORG/NAME` from a local Hugging Face cache (laid out here as huggingface_hub lays it
out, in tmp), --revision, --tokenizer, --chat-template and --trust-remote-code."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from phaseflip.config import EMBEDDED_MODEL, EngineConfig
from phaseflip.errors import ModelLoadError
from phaseflip.model.loader import is_overlay, load_tokenizer
from phaseflip.model.resolve import resolve_model

MAIN = "a" * 40
V1 = "b" * 40


def add_snapshot(cache: Path, repo_id: str, commit: str, src: Path, ref: str | None) -> Path:
    """models--ORG--NAME/{blobs,snapshots/<commit>,refs/<ref>}: snapshot files link to blobs."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for f in src.iterdir():
        blob = repo / "blobs" / f"{commit[:8]}-{f.name}"
        shutil.copyfile(f, blob) if f.stat().st_size < 1 << 20 else blob.symlink_to(f)
        (snap / f.name).symlink_to(blob)
    if ref is not None:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snap


@pytest.fixture
def hub(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    add_snapshot(cache, "tiny-org/tiny-llama", MAIN, EMBEDDED_MODEL, "main")
    add_snapshot(cache, "tiny-org/tiny-llama", V1, EMBEDDED_MODEL, "v1")
    return cache


def test_repo_id_resolves_to_its_snapshot(hub):
    cfg = resolve_model(EngineConfig(model="tiny-org/tiny-llama"))
    assert Path(cfg.model) == hub / "models--tiny-org--tiny-llama" / "snapshots" / MAIN
    assert resolve_model(cfg) == cfg  # resolving twice changes nothing


@pytest.mark.parametrize("revision,commit", [("main", MAIN), ("v1", V1), (V1, V1)])
def test_revision_is_a_branch_tag_or_commit(hub, revision, commit):
    cfg = resolve_model(EngineConfig(model="tiny-org/tiny-llama", revision=revision))
    assert Path(cfg.model).name == commit


def test_a_miss_says_how_to_fetch_and_that_nothing_is_downloaded(hub):
    with pytest.raises(ModelLoadError) as e:
        resolve_model(EngineConfig(model="meta-llama/Llama-3.1-8B-Instruct"))
    msg = str(e.value)
    assert "hf download meta-llama/Llama-3.1-8B-Instruct" in msg and "offline" in msg
    assert str(hub) in msg and "HF_HUB_CACHE" in msg
    with pytest.raises(ModelLoadError, match=r"revision 'v9'.*holds it at main, v1"):
        resolve_model(EngineConfig(model="tiny-org/tiny-llama", revision="v9"))


def test_hf_home_is_used_without_hf_hub_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    add_snapshot(tmp_path / "hf" / "hub", "o/m", MAIN, EMBEDDED_MODEL, "main")
    assert Path(resolve_model(EngineConfig(model="o/m")).model).name == MAIN


def test_a_cached_model_generates_what_its_directory_does(hub):
    from phaseflip import Engine, SamplingParams

    params = SamplingParams(max_new_tokens=6, temperature=0)
    with Engine("tiny-org/tiny-llama", device="cpu", max_total_tokens=512) as e:
        cached = e.generate(["Return the"], params)[0].text
    with Engine(str(EMBEDDED_MODEL), device="cpu", max_total_tokens=512) as e:
        local = e.generate(["Return the"], params)[0].text
    assert cached == local and cached


def test_chat_template_replaces_the_tokenizers(tmp_path):
    inline = resolve_model(EngineConfig(chat_template="<<{{ messages[0]['content'] }}>>"))
    assert is_overlay(inline.model) and Path(inline.model).name == EMBEDDED_MODEL.name
    msgs = [{"role": "user", "content": "hi"}]
    tok = load_tokenizer(inline.model)
    assert tok.apply_chat_template(msgs, tokenize=False) == "<<hi>>"
    path = tmp_path / "t.jinja"
    path.write_text("[{{ messages[0]['role'] }}]")
    from_file = resolve_model(EngineConfig(chat_template=str(path)))
    assert load_tokenizer(from_file.model).apply_chat_template(msgs, tokenize=False) == "[user]"
    with pytest.raises(ModelLoadError, match="neither a file nor a Jinja template"):
        resolve_model(EngineConfig(chat_template="templates/missing.jinja"))


def test_tokenizer_from_another_directory(tmp_path, llama_dir):
    cfg = resolve_model(EngineConfig(model=str(EMBEDDED_MODEL), tokenizer=str(llama_dir)))
    model = Path(cfg.model)
    assert (model / "tokenizer.json").resolve() == (llama_dir / "tokenizer.json").resolve()
    assert (model / "model.safetensors").resolve() == EMBEDDED_MODEL / "model.safetensors"
    assert len(load_tokenizer(cfg.model)) == len(load_tokenizer(llama_dir))
    with pytest.raises(ModelLoadError, match="no tokenizer files"):
        resolve_model(EngineConfig(tokenizer=str(tmp_path)))


def _with_config(tmp_path: Path, **changes) -> Path:
    out = tmp_path / "custom"
    shutil.copytree(EMBEDDED_MODEL, out, ignore=shutil.ignore_patterns("*.safetensors"))
    raw = json.loads((out / "config.json").read_text())
    raw.update(changes)
    (out / "config.json").write_text(json.dumps(raw))
    return out


def test_trust_remote_code_cannot_add_an_architecture(tmp_path):
    custom = _with_config(tmp_path, architectures=["FancyForCausalLM"],
                          auto_map={"AutoModelForCausalLM": "modeling_fancy.FancyForCausalLM"})
    with pytest.raises(ModelLoadError, match=r"FancyForCausalLM with its own code.*never a "
                       "checkpoint's code"):
        resolve_model(EngineConfig(model=str(custom), trust_remote_code=True))
    # a supported architecture is served with or without the flag
    assert resolve_model(EngineConfig(trust_remote_code=True)).model == str(EMBEDDED_MODEL)


def test_a_missing_tokenizer_names_the_flag(tmp_path):
    """The loader speaks of "model directory": with --tokenizer that read as --model's."""
    with pytest.raises(ModelLoadError, match=r"^--tokenizer .*nothing: "):
        resolve_model(EngineConfig(device="cpu", tokenizer=str(tmp_path / "nothing")))


def test_revision_with_a_local_directory_warns(hub, caplog):
    """--revision picks a snapshot of a cached hub id; with a directory it does nothing, and
    the user is told so once (a hub id's revision, resolved to its snapshot, is no warning)."""
    from phaseflip.cli import build_parser, config_from_args

    parser = build_parser()
    with caplog.at_level("WARNING", logger="phaseflip"):
        args = parser.parse_args(["serve", "--model", str(EMBEDDED_MODEL), "--revision", "v1"])
        config_from_args(args)
    assert "--revision v1 is ignored" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="phaseflip"):
        args = parser.parse_args(["serve", "--model", "tiny-org/tiny-llama", "--revision", "v1"])
        assert Path(config_from_args(args).model).name == V1
    assert "is ignored" not in caplog.text
