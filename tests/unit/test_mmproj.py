"""Finding a GGUF model's projector file (`mmproj`), as llama.cpp does: beside the model file (a file, a folder,
a Hub repository's snapshot), or named by `--mmproj` (flag and `MMPROJ`); a projector Kettle does not serve
refused in one line naming its type and the supported ones (found beside the model instead: a warning, and the
text served as before); a projector passed as the model refused in one line."""

from __future__ import annotations

import shutil

import pytest
from typer.testing import CliRunner

from kettle.cli import app
from kettle.hub import PreparationError, resolve_model
from kettle.hub.mmproj import MMPROJ_LINK, choose
from kettle.launcher.config import LauncherConfig
from tests.mmproj_files import write_pair
from tests.vision_fixtures import make_idefics3_folder

runner = CliRunner()


@pytest.fixture(autouse=True)
def kettle_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KETTLE_CACHE", str(tmp_path / "kettle-cache"))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny SmolVLM's language GGUF and its projector, side by side (tiny-vlm-F32.gguf, mmproj-tiny-vlm-f16.gguf)."""
    import torch
    from transformers import Idefics3ForConditionalGeneration

    root = tmp_path_factory.mktemp("smolvlm")
    folder = make_idefics3_folder(root / "hf", weights=True)
    model = Idefics3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32)
    return write_pair(model, folder, root / "gguf", "llama", "idefics3")


def copy(paths, where):
    where.mkdir(parents=True, exist_ok=True)
    return [shutil.copy(path, where / path.name) for path in paths]


def model_type(folder) -> str:
    import json

    return json.loads((folder / "config.json").read_text())["model_type"]


def test_the_projector_beside_a_model_file_is_used(files, tmp_path):
    language, _ = copy(files, tmp_path / "models")
    folder = resolve_model(str(language)).path
    assert (folder / MMPROJ_LINK).resolve() == (tmp_path / "models" / files[1].name).resolve()
    assert model_type(folder) == "idefics3"


def test_a_folder_with_a_model_and_its_projector_serves_the_model(files, tmp_path):
    copy(files, tmp_path / "models")
    folder = resolve_model(str(tmp_path / "models")).path
    assert model_type(folder) == "idefics3" and (folder / MMPROJ_LINK).exists()


def test_mmproj_names_the_projector_elsewhere(files, tmp_path):
    (language,), (projector,) = copy(files[:1], tmp_path / "model"), copy(files[1:], tmp_path / "elsewhere")
    assert model_type(resolve_model(str(language)).path) == "llama"  # nothing beside it: text only
    folder = resolve_model(str(language), mmproj=str(projector)).path
    assert (folder / MMPROJ_LINK).resolve() == projector.resolve() and model_type(folder) == "idefics3"
    with pytest.raises(PreparationError, match=r"--mmproj '.*missing.gguf' does not exist on this machine"):
        resolve_model(str(language), mmproj=str(tmp_path / "missing.gguf"))


def test_a_hub_snapshot_serves_the_tagged_model_with_the_projector_beside_it(files, tmp_path, monkeypatch):
    from huggingface_hub import constants

    from tests.unit.test_weights_download import SHA, _fake_hub_snapshot

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    copy(files[:1], tmp_path / "repo")
    shutil.copy(files[1], tmp_path / "repo" / "mmproj-tiny-vlm-F32.gguf")  # the tag names the model, not it
    _fake_hub_snapshot(tmp_path / "hub", "kettle-tests/tiny-vlm-GGUF", tmp_path / "repo")
    model = resolve_model("kettle-tests/tiny-vlm-GGUF:F32", hub_cache=str(tmp_path / "hub"))
    assert model.sha == SHA and model_type(model.path) == "idefics3"


def test_a_repository_with_several_projectors_takes_the_float16_one_beside_the_model():
    names = ["m-Q8_0.gguf", "mmproj-m-Q8_0.gguf", "mmproj-m-f16.gguf", "sub/mmproj-other-f16.gguf"]
    assert choose(names, "m-Q8_0.gguf") == "mmproj-m-f16.gguf"
    assert choose(["a/m.gguf", "a/mmproj.gguf", "mmproj-x.gguf"], "a/m.gguf") == "a/mmproj.gguf"
    assert choose(["m.gguf"], "m.gguf") is None


def write_projector(path, kind: str):
    import gguf

    writer = gguf.GGUFWriter(path, "clip")
    writer.add_clip_has_vision_encoder(True)
    writer.add_clip_projector_type(kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_projector_type_kettle_does_not_serve_is_refused_in_one_line(files, tmp_path):
    (language,) = copy(files[:1], tmp_path / "model")
    pixtral = write_projector(tmp_path / "mmproj-pixtral.gguf", "pixtral")
    supported = r"supported: mlp \(llava\), idefics3 \(idefics3\), gemma3 \(gemma3\), qwen2vl_merger \(qwen2_vl\)"
    with pytest.raises(PreparationError, match=rf"projector type 'pixtral' is not one Kettle serves.*{supported}"):
        resolve_model(str(language), mmproj=str(pixtral))
    qwen = write_projector(tmp_path / "mmproj-qwen.gguf", "qwen2vl_merger")
    with pytest.raises(PreparationError, match="a 'qwen2vl_merger' projector goes with a qwen2vl or qwen2 language"):
        resolve_model(str(language), mmproj=str(qwen))
    gemma = write_projector(tmp_path / "mmproj-gemma.gguf", "gemma3")
    with pytest.raises(PreparationError, match="a 'gemma3' projector goes with a gemma3 language model"):
        resolve_model(str(language), mmproj=str(gemma))


def test_an_unserved_projector_beside_the_model_leaves_its_text_served(files, tmp_path, caplog):
    (language,) = copy(files[:1], tmp_path / "model")
    write_projector(tmp_path / "model" / "mmproj-gemma.gguf", "gemma3nv")
    folder = resolve_model(str(language)).path
    assert model_type(folder) == "llama" and not (folder / MMPROJ_LINK).exists()
    assert "'gemma3nv' is not one Kettle serves" in caplog.text and "serving text only" in caplog.text


def test_a_projector_passed_as_the_model_is_refused_in_one_line(files, tmp_path):
    (projector,) = copy(files[1:], tmp_path / "model")
    with pytest.raises(PreparationError, match="is a vision projector \\(mmproj\\) file, not a model"):
        resolve_model(str(projector))


def test_mmproj_with_a_model_that_is_no_gguf_is_refused(tiny_llama_path, files):
    with pytest.raises(PreparationError, match=r"--mmproj .* goes with a GGUF model.s images"):
        resolve_model(str(tiny_llama_path), mmproj=str(files[1]))


@pytest.fixture
def launched(monkeypatch):
    seen: list[LauncherConfig] = []
    monkeypatch.setattr("kettle.launcher.main.launch", lambda config: seen.append(config) or 0)
    monkeypatch.setattr("kettle.launcher.config.visible_gpus", lambda: 0)
    monkeypatch.setattr("kettle.launcher.config.cuda_available", lambda: False)
    return seen


def test_the_mmproj_flag_and_its_environment_variable_reach_the_configuration(launched):
    args = ["launch", "--model-id", "org/x-GGUF"]
    assert runner.invoke(app, [*args, "--mmproj", "/m/mmproj-x-f16.gguf"]).exit_code == 0
    assert runner.invoke(app, args, env={"MMPROJ": "/m/mmproj-x-f16.gguf"}).exit_code == 0
    assert launched[-1] == launched[-2] and launched[-1].mmproj == "/m/mmproj-x-f16.gguf"
    refused = runner.invoke(app, [*args, "--mmproj", "/m/projector.bin"])
    assert refused.exit_code == 2 and "--mmproj names a projector .gguf file" in refused.output
