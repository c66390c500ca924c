"""Model resolution: local folders, pickled checkpoints, the conversion cache, and one-line failures."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file

from kettle.hub import ModelNotFound, resolve_model
from kettle.hub.cache import build_once
from kettle.hub.torch_weights import safetensors_name


@pytest.fixture(autouse=True)
def kettle_cache(tmp_path, monkeypatch):
    cache = tmp_path / "kettle-cache"
    monkeypatch.setenv("KETTLE_CACHE", str(cache))
    return cache


@pytest.fixture
def pickled_model(tiny_llama_path, tmp_path):
    """The tiny Llama with its weights saved as pytorch_model.bin (embedding tied to the LM head)."""
    folder = tmp_path / "pickled"
    shutil.copytree(tiny_llama_path, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    state = load_file(tiny_llama_path / "model.safetensors")
    state["lm_head.weight"] = state["model.embed_tokens.weight"]  # shares memory, as tied weights do
    torch.save(state, folder / "pytorch_model.bin")
    (folder / "training_args.bin").write_bytes(b"not weights")
    return folder, state


def test_a_local_safetensors_folder_is_used_as_is(tiny_llama_path):
    model = resolve_model(str(tiny_llama_path))
    assert model.path == tiny_llama_path
    assert model.display_id == str(tiny_llama_path)
    assert model.sha is None


def test_pickled_weights_are_converted_once_with_equal_tensors(pickled_model, kettle_cache):
    folder, state = pickled_model
    model = resolve_model(str(folder))
    assert model.path.parent == kettle_cache / "models"
    converted = load_file(model.path / "model.safetensors")
    assert converted.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(converted[name], tensor), name
    assert (model.path / "config.json").exists() and (model.path / "tokenizer.json").exists()
    assert not (model.path / "pytorch_model.bin").exists()
    written = (model.path / "model.safetensors").stat().st_mtime_ns
    assert resolve_model(str(folder)).path == model.path
    assert (model.path / "model.safetensors").stat().st_mtime_ns == written  # reused, not rebuilt


def test_sharded_checkpoint_names_follow_transformers():
    assert safetensors_name("pytorch_model-00001-of-00002.bin") == "model-00001-of-00002.safetensors"
    assert safetensors_name("pytorch_model.bin") == "model.safetensors"
    assert safetensors_name("weights.pt") == "weights.safetensors"


def test_a_failed_build_leaves_nothing_behind(kettle_cache):
    target = kettle_cache / "models" / "broken-123"

    def build(out):
        (out / "half.safetensors").write_bytes(b"partial")
        raise RuntimeError("crash in the middle")

    with pytest.raises(RuntimeError):
        build_once(target, build, what="broken")
    assert not target.exists()
    assert list((kettle_cache / "models").iterdir()) == []


def test_temporary_folders_of_dead_builders_are_swept(kettle_cache):
    abandoned = kettle_cache / "models" / ".tmp-old-999999999"  # no such pid: its builder was SIGKILLed
    abandoned.mkdir(parents=True)
    build_once(kettle_cache / "models" / "fresh-1", lambda out: (out / "f").write_text("x"), what="fresh")
    assert not abandoned.exists()


def test_a_build_finished_by_another_process_is_reused(kettle_cache):
    target = kettle_cache / "models" / "raced-123"

    def build(out):
        (out / "ours").write_text("ours")
        target.mkdir(parents=True)  # the other process renames its copy into place first
        (target / "theirs").write_text("theirs")

    assert build_once(target, build, what="raced") == target
    assert (target / "theirs").exists()
    assert [path.name for path in (kettle_cache / "models").iterdir()] == ["raced-123"]


@pytest.mark.parametrize("missing", ["./no/such/folder", "/no/such/model.gguf", "~/nothing-here"])
def test_a_missing_local_path_is_one_clear_line(missing):
    with pytest.raises(ModelNotFound) as error:
        resolve_model(missing)
    message = str(error.value)
    assert missing in message and "\n" not in message


def test_a_folder_without_config_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFound, match=r"no config\.json"):
        resolve_model(str(tmp_path / "empty"))


def test_a_non_gguf_file_is_refused(tmp_path):
    path = tmp_path / "weights.txt"
    path.write_text("x")
    with pytest.raises(ModelNotFound, match=r"not a \.gguf"):
        resolve_model(str(path))


def test_offline_missing_hub_model_is_one_clear_line(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelNotFound) as error:
        resolve_model("kettle-tests/not-a-real-model", hub_cache=str(tmp_path / "hub"))
    message = str(error.value)
    assert "kettle-tests/not-a-real-model" in message
    assert "HF_HUB_OFFLINE" in message
    assert "\n" not in message
