"""The shard's config without transformers (`JsonConfig`): for the native types it covers, a config.json written
by transformers 5 reads back, for every attribute Kettle's model code reads, exactly as transformers' class."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from transformers import CONFIG_MAPPING, AutoConfig

import kettle
from kettle.models.hf_config import JSON_CONFIGS, JsonConfig, load_config, read_json_config
from kettle.models.rope_override import apply_rope_override

ROOT = Path(kettle.__file__).parent
MISSING = object()
# Configs beyond the defaults: RoPE scaling, sliding windows, layer types, tied or not, GQA.
VARIANTS: dict[str, list[dict]] = {
    "llama": [
        {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
        {"num_key_value_heads": 2, "head_dim": 32, "tie_word_embeddings": True, "attention_bias": True},
    ],
    "mistral": [{"sliding_window": 128}],
    "qwen2": [{"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 2, "num_hidden_layers": 4}],
    "gpt2": [{"n_embd": 64, "n_head": 4, "add_cross_attention": False, "scale_attn_by_inverse_layer_idx": True}],
    "phi3": [{"sliding_window": 128, "num_key_value_heads": 8, "partial_rotary_factor": 0.5}],
    "gemma3_text": [{"num_hidden_layers": 12, "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}}}],
}  # fmt: skip


def attributes_read() -> set[str]:
    """Every attribute Kettle's code reads from an object named `config` (the model config, and also the shard's
    own config: its names are simply absent on both sides)."""
    names: set[str] = set()
    for path in ROOT.rglob("*.py"):
        source = path.read_text()
        names |= set(re.findall(r"\bconfig\.([a-z_][a-z_0-9]*)\b", source))
        names |= set(re.findall(r"getattr\(config, \"([a-z_0-9]+)\"", source))
    return names - {"get", "json", "py", "items"}


def saved(tmp_path: Path, model_type: str, **values) -> Path:
    CONFIG_MAPPING[model_type](**values).save_pretrained(tmp_path)
    return tmp_path


def assert_reads_like_transformers(path: Path) -> None:
    ours, theirs = read_json_config(path), AutoConfig.from_pretrained(path)
    assert isinstance(ours, JsonConfig)
    for name in sorted(attributes_read()):
        expected = getattr(theirs, name, MISSING)
        if not callable(expected):  # methods (get_text_config...) serve the transformers fallback only
            assert getattr(ours, name, MISSING) == expected, name


@pytest.mark.parametrize("model_type", JSON_CONFIGS)
def test_default_configs_read_like_transformers(tmp_path, model_type):
    assert_reads_like_transformers(saved(tmp_path, model_type))


@pytest.mark.parametrize(("model_type", "values"), [(t, v) for t, vs in VARIANTS.items() for v in vs])
def test_configured_variants_read_like_transformers(tmp_path, model_type, values):
    assert_reads_like_transformers(saved(tmp_path, model_type, **values))


@pytest.mark.parametrize("model_type", JSON_CONFIGS)
def test_aliases_are_transformers_own(model_type):
    assert JSON_CONFIGS[model_type] == dict(CONFIG_MAPPING[model_type].attribute_map)


def test_an_alias_reads_and_writes_the_stored_name(tmp_path):
    config = read_json_config(saved(tmp_path, "gpt2", n_embd=64, n_head=4))
    assert (config.hidden_size, config.num_attention_heads) == (64, 4)
    config.hidden_size = 128
    assert config.n_embd == 128


def test_the_rope_override_rewrites_it_as_transformers_config(tmp_path):
    path = saved(tmp_path, "llama", rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    ours, theirs = read_json_config(path), AutoConfig.from_pretrained(path)
    environ = {"ROPE_SCALING": "dynamic", "ROPE_FACTOR": "2.0"}
    assert apply_rope_override(ours, environ) and apply_rope_override(theirs, environ)
    assert (
        ours.rope_parameters
        == theirs.rope_parameters
        == {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 500000.0}
    )


@pytest.mark.parametrize(
    "edit",
    [
        {"transformers_version": "4.46.0"},  # older files are normalized on load (RoPE settings first)
        {"auto_map": {"AutoConfig": "custom.Config"}},
        {"model_type": "mpt"},  # a nested attention config object
        {"model_type": "t5"},  # not native
    ],
)
def test_other_configs_go_through_transformers(tmp_path, edit):
    path = saved(tmp_path, "llama")
    values = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(values | edit))
    assert read_json_config(path) is None


def test_load_config_falls_back_to_transformers(tmp_path):
    path = saved(tmp_path, "t5")
    assert type(load_config(str(path))).__name__ == "T5Config"
