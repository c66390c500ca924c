"""Model resolution: local folders, pickled checkpoints, the conversion cache, and one-line failures."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kettle.hub import ModelNotFound, resolve_model
from kettle.hub.cache import SOURCES_FILE, build_once, converted_dir, source_key
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


def test_a_build_under_way_is_waited_for_not_repeated(kettle_cache):
    """A second builder of the same target (the shards, while the launcher compiles the kernels) waits for the
    first and reuses its folder; the lock file goes with the build."""
    target = kettle_cache / "kernels" / "cpu-123"
    started, builds = threading.Event(), []

    def slow(out):
        builds.append("first")
        started.set()
        time.sleep(0.5)
        (out / "lib").write_text("first")

    first = threading.Thread(target=build_once, args=(target, slow, "kernels"))
    first.start()
    assert started.wait(10)
    assert build_once(target, lambda out: builds.append("second"), what="kernels") == target
    first.join()
    assert builds == ["first"] and (target / "lib").read_text() == "first"
    assert [path.name for path in (kettle_cache / "kernels").iterdir()] == ["cpu-123"]


def test_after_a_failed_build_the_waiting_builder_builds(kettle_cache):
    target = kettle_cache / "kernels" / "cpu-456"
    started = threading.Event()

    def failing(out):
        started.set()
        time.sleep(0.3)
        raise RuntimeError("no compiler")

    def run_failing():
        with pytest.raises(RuntimeError):
            build_once(target, failing, what="kernels")

    first = threading.Thread(target=run_failing)
    first.start()
    assert started.wait(10)
    assert build_once(target, lambda out: (out / "lib").write_text("second"), what="kernels") == target
    first.join()
    assert (target / "lib").read_text() == "second"


def convert(source: Path) -> Path:
    """A stand-in conversion of `source`, keyed and recorded as the resolver's are."""
    target = converted_dir(source.stem, source_key(source))
    return build_once(target, lambda out: (out / "weights").write_text(source.read_text()), source.name, [source])


def test_conversions_whose_source_is_gone_or_changed_are_removed_by_the_next_build(kettle_cache, tmp_path):
    kept, deleted, edited = (tmp_path / f"{name}.gguf" for name in ("kept", "deleted", "edited"))
    for source in (kept, deleted, edited):
        source.write_text(source.name)
    folders = {source.stem: convert(source) for source in (kept, deleted, edited)}
    deleted.unlink()
    edited.write_text("rewritten, longer contents")  # a new size and modification time: a new key
    fresh = convert(edited)
    assert fresh != folders["edited"]
    remaining = sorted(path.name for path in (kettle_cache / "models").iterdir())
    assert remaining == sorted([folders["kept"].name, fresh.name])


def test_a_folder_built_before_the_record_gets_it_when_next_used(kettle_cache, tmp_path):
    source = tmp_path / "model.gguf"
    source.write_text("weights")
    target = converted_dir(source.stem, source_key(source))
    build_once(target, lambda out: (out / "weights").write_text("x"), source.name)  # as an older version did
    assert not (target / SOURCES_FILE).exists()
    assert convert(source) == target
    assert json.loads((target / SOURCES_FILE).read_text()) == [str(source.resolve())]


def test_folders_from_before_the_record_go_only_when_their_links_dangle(kettle_cache, tmp_path):
    models = kettle_cache / "models"
    gone, alive, unknown = models / "gone-gguf-111", models / "alive-gguf-222", models / "converted-333"
    for folder in (gone, alive, unknown):
        folder.mkdir(parents=True)
    (gone / "model.gguf").symlink_to(tmp_path / "deleted.gguf")
    source = tmp_path / "alive.gguf"
    source.write_text("weights")
    (alive / "model.gguf").symlink_to(source)
    (unknown / "model.safetensors").write_text("no record, no link: nothing tells whether it is stale")
    convert(source)
    assert not gone.exists() and alive.exists() and unknown.exists()


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
