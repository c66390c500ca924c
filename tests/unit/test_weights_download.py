"""Weights: sharded pickled checkpoints converted once and served like their safetensors twin; the Hub cache
used offline (HF_HUB_OFFLINE, `--huggingface-hub-cache`); a missing model offline is one clear line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from kettle.hub import ModelNotFound, resolve_model
from tests.fixtures import make_tiny_llama
from tests.models.engine_driver import make_batch, run_to_end, warm_engine

SHA = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(autouse=True)
def kettle_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KETTLE_CACHE", str(tmp_path / "kettle-cache"))


@pytest.fixture(scope="module")
def tied_llama(tmp_path_factory):
    """The safetensors twin: a tiny Llama with its LM head tied to the embedding (saved once, as the embedding)."""
    return make_tiny_llama(tmp_path_factory.mktemp("tied-llama"), tie_word_embeddings=True)


@pytest.fixture
def sharded_bin(tied_llama, tmp_path):
    """The tied Llama as two pickled shards plus pytorch_model.bin.index.json, as `torch.save(state_dict)` of a
    tied model writes it: the LM head is a second name of the embedding's storage."""
    folder = tmp_path / "sharded"
    shutil.copytree(tied_llama, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    state = load_file(tied_llama / "model.safetensors")
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    names = sorted(state)
    shards = {"pytorch_model-00001-of-00002.bin": names[::2], "pytorch_model-00002-of-00002.bin": names[1::2]}
    weight_map = {}
    for file, keys in shards.items():
        torch.save({k: state[k] for k in keys}, folder / file)
        weight_map |= dict.fromkeys(keys, file)
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    return folder, state


def test_sharded_bin_converts_once_with_equal_tensors_and_index(sharded_bin):
    folder, state = sharded_bin
    model = resolve_model(str(folder))
    index = json.loads((model.path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
    converted = {}
    for file in set(index["weight_map"].values()):
        converted |= load_file(model.path / file)
    assert converted.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(converted[name], tensor), name
    assert not list(model.path.glob("*.bin")) and not (model.path / "pytorch_model.bin.index.json").exists()
    assert resolve_model(str(folder)).path == model.path  # converted once, reused


def test_converted_sharded_bin_serves_the_same_tokens_as_its_safetensors_twin(sharded_bin, tied_llama):
    folder, _ = sharded_bin
    prompts = [[5, 6, 7, 8], [9, 10]]
    outputs = []
    for path in (tied_llama, resolve_model(str(folder)).path):
        engine, _ = warm_engine(path)
        outputs.append(run_to_end(engine, make_batch(1, prompts, first_id=1, max_new_tokens=6)))
    assert outputs[0] == outputs[1]


def _fake_hub_snapshot(cache, model_id: str, source) -> None:
    """huggingface_hub's cache layout: models--org--name/{refs/main, snapshots/<sha>/...}."""
    repo = cache / ("models--" + model_id.replace("/", "--"))
    shutil.copytree(source, repo / "snapshots" / SHA)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(SHA)


def test_a_cached_hub_model_resolves_offline_from_the_given_hub_cache(tiny_llama_path, tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    hub_cache = tmp_path / "hub-cache"
    _fake_hub_snapshot(hub_cache, "kettle-tests/tiny", tiny_llama_path)
    model = resolve_model("kettle-tests/tiny", hub_cache=str(hub_cache))
    assert model.path == hub_cache / "models--kettle-tests--tiny" / "snapshots" / SHA
    assert model.sha == SHA and model.display_id == "kettle-tests/tiny"


def _offline_cli(tmp_path, *args: str) -> subprocess.CompletedProcess:
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home")}
    env.pop("HUGGINGFACE_HUB_CACHE", None)
    return subprocess.run(
        [sys.executable, "-m", "kettle.cli", *args], env=env, capture_output=True, text=True, timeout=120
    )


def test_download_weights_offline_finds_the_hf_home_cache(tiny_llama_path, tmp_path):
    _fake_hub_snapshot(tmp_path / "hf-home" / "hub", "kettle-tests/tiny", tiny_llama_path)
    result = _offline_cli(tmp_path, "download-weights", "kettle-tests/tiny")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith(f"snapshots/{SHA}")


def test_download_weights_offline_and_missing_is_one_clear_line(tmp_path):
    result = _offline_cli(tmp_path, "download-weights", "kettle-tests/not-cached", "--revision", "v1")
    assert result.returncode == 1
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert "'kettle-tests/not-cached' at revision 'v1'" in lines[0] and "HF_HUB_OFFLINE" in lines[0]
    assert "Traceback" not in result.stderr


def test_launch_refuses_custom_code_without_the_flag_in_one_line(tiny_llama_path, tmp_path):
    folder = tmp_path / "custom"
    shutil.copytree(tiny_llama_path, folder)
    config = json.loads((folder / "config.json").read_text())
    config |= {"model_type": "my-custom", "auto_map": {"AutoConfig": "configuration_my.MyConfig"}}
    (folder / "config.json").write_text(json.dumps(config))
    command = [sys.executable, "-m", "kettle.cli", "launch", "--model-id", str(folder)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    (line,) = [line for line in result.stderr.splitlines() if "ERROR" in line]
    assert "'my-custom'" in line and "pass --trust-remote-code" in line


def _gguf_snapshot(tmp_path, monkeypatch):
    """A Hub-cache snapshot of a GGUF repository holding two quantizations of one tiny Llama, offline."""
    from gguf import GGMLQuantizationType as T
    from huggingface_hub import constants

    from tests.gguf_files import tiny_model, write_gguf

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    source = tmp_path / "source"
    source.mkdir()
    model = tiny_model("llama", 64)
    for qtype in (T.Q4_0, T.Q8_0):
        folder = write_gguf(model, tmp_path / qtype.name, "llama", qtype)
        shutil.copy(folder / "model.gguf", source / f"tiny.{qtype.name}.gguf")
    hub_cache = tmp_path / "hub-cache"
    _fake_hub_snapshot(hub_cache, "kettle-tests/tiny-GGUF", source)
    return hub_cache


def test_the_quant_tag_picks_one_gguf_of_a_hub_snapshot(tmp_path, monkeypatch):
    from kettle.hub import resolve

    hub_cache = _gguf_snapshot(tmp_path, monkeypatch)
    prepared = []
    monkeypatch.setattr(resolve, "gguf_folder", lambda path, *_: prepared.append(path) or path)
    model = resolve_model("kettle-tests/tiny-GGUF:q8_0", hub_cache=str(hub_cache))
    snapshot = hub_cache / "models--kettle-tests--tiny-GGUF" / "snapshots" / SHA
    assert prepared == [snapshot / "tiny.Q8_0.gguf"] and model.path == prepared[0]
    assert model.display_id == "kettle-tests/tiny-GGUF:q8_0" and model.sha == SHA
    files = r"\(GGUF files there: tiny.Q4_0.gguf, tiny.Q8_0.gguf\)"
    with pytest.raises(ModelNotFound, match=rf"in the local cache has no GGUF file matching the tag 'Q6_K' {files}"):
        resolve_model("kettle-tests/tiny-GGUF:Q6_K", hub_cache=str(hub_cache))


def test_gguf_file_picks_that_file_of_a_hub_snapshot_through_the_same_resolver(tmp_path, monkeypatch):
    from kettle.hub import resolve

    hub_cache = _gguf_snapshot(tmp_path, monkeypatch)
    prepared = []
    monkeypatch.setattr(resolve, "gguf_folder", lambda path, *_: prepared.append(path) or path)
    model = resolve_model("kettle-tests/tiny-GGUF", hub_cache=str(hub_cache), gguf_file="tiny.Q4_0.gguf")
    snapshot = hub_cache / "models--kettle-tests--tiny-GGUF" / "snapshots" / SHA
    assert prepared == [snapshot / "tiny.Q4_0.gguf"] and model.path == prepared[0]
    assert model.display_id == "kettle-tests/tiny-GGUF" and model.sha == SHA
    files = r"\(GGUF files there: tiny.Q4_0.gguf, tiny.Q8_0.gguf\)"
    with pytest.raises(ModelNotFound, match=rf"in the local cache has no file 'tiny.Q6_K.gguf' {files}"):
        resolve_model("kettle-tests/tiny-GGUF", hub_cache=str(hub_cache), gguf_file="tiny.Q6_K.gguf")
    with pytest.raises(ModelNotFound, match="already picks a GGUF file by its tag 'Q8_0'"):
        resolve_model("kettle-tests/tiny-GGUF:Q8_0", hub_cache=str(hub_cache), gguf_file="tiny.Q4_0.gguf")


def test_online_the_pick_is_made_from_the_hub_list_and_only_that_file_is_downloaded(tmp_path, monkeypatch):
    import huggingface_hub
    from huggingface_hub import constants

    from kettle.hub import download, resolve

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    listing = ["README.md", "Q8_0/big.Q8_0.gguf", "tiny.Q4_K.gguf", "tiny.Q4_K_M.gguf", "tiny.Q4_K_S.gguf"]
    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files", lambda self, repo, revision=None: listing)
    fetched = []
    snapshot = tmp_path / "snapshots" / SHA

    def fake_snapshot(model_id, revision, hub_cache, patterns):
        fetched.append((model_id, revision, patterns))
        return snapshot

    monkeypatch.setattr(download, "_snapshot", fake_snapshot)
    monkeypatch.setattr(resolve, "gguf_folder", lambda path, *_: path)
    assert resolve_model("org/tiny-GGUF:q4_k", "v2").path == snapshot / "tiny.Q4_K.gguf"  # the tag standing alone
    assert resolve_model("org/tiny-GGUF", gguf_file="big.Q8_0.gguf").path == snapshot / "Q8_0/big.Q8_0.gguf"
    assert [patterns[-1] for _, _, patterns in fetched] == ["tiny.Q4_K.gguf", "Q8_0/big.Q8_0.gguf"]
    assert fetched[0][:2] == ("org/tiny-GGUF", "v2")
    assert all(not any(p.endswith("*.gguf") for p in patterns) for _, _, patterns in fetched)
    with pytest.raises(ModelNotFound, match=r"at revision 'v2' on the Hub has several GGUF files matching the tag"):
        resolve_model("org/tiny-GGUF:Q4", "v2")


def test_gguf_file_picks_a_file_of_a_local_folder(tmp_path, monkeypatch):
    from kettle.hub import resolve

    folder = tmp_path / "models"
    folder.mkdir()
    for name in ("a.Q4_0.gguf", "a.Q8_0.gguf"):
        (folder / name).write_bytes(b"GGUF")
    monkeypatch.setattr(resolve, "gguf_folder", lambda path, *_: path)
    assert resolve_model(str(folder), gguf_file="a.Q8_0.gguf").path == folder / "a.Q8_0.gguf"
    with pytest.raises(ModelNotFound, match=r"has no file 'b.gguf' \(GGUF files there: a.Q4_0.gguf, a.Q8_0.gguf\)"):
        resolve_model(str(folder), gguf_file="b.gguf")


@pytest.mark.parametrize("how", ["flag", "env"])
def test_download_weights_gguf_file_not_in_the_repo_is_one_line_listing_the_files(tmp_path, monkeypatch, how):
    (tmp_path / "hf-home").mkdir()
    shutil.move(_gguf_snapshot(tmp_path, monkeypatch), tmp_path / "hf-home" / "hub")
    args = ["--gguf-file", "tiny.Q6_K.gguf"] if how == "flag" else []
    if how == "env":
        monkeypatch.setenv("GGUF_FILE", "tiny.Q6_K.gguf")
    result = _offline_cli(tmp_path, "download-weights", "kettle-tests/tiny-GGUF", *args)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert "has no file 'tiny.Q6_K.gguf' (GGUF files there: tiny.Q4_0.gguf, tiny.Q8_0.gguf)" in lines[0]
