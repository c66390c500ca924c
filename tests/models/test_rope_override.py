"""`--rope-scaling` / `--rope-factor` reach the model: the config rewrite, and a loaded model's RoPE frequencies."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from kettle.models.llama import rope_parameters
from kettle.models.registry import load_model
from kettle.models.rope_override import apply_rope_override


def test_no_variables_leave_the_config_alone():
    config = LlamaConfig(rope_theta=50000.0)
    before = rope_parameters(config)
    assert apply_rope_override(config, {}) is False
    assert rope_parameters(config) == before


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({"ROPE_SCALING": "linear", "ROPE_FACTOR": "2.0"}, ("linear", 2.0)),
        ({"ROPE_FACTOR": "4"}, ("linear", 4.0)),
        ({"ROPE_SCALING": "dynamic"}, ("dynamic", 1.0)),
    ],
)
def test_the_override_replaces_the_scaling_and_keeps_the_base_frequency(environ, expected):
    config = LlamaConfig(rope_theta=50000.0, rope_scaling={"rope_type": "linear", "factor": 8.0})
    assert apply_rope_override(config, environ) is True
    params = rope_parameters(config)
    assert (params["rope_type"], params["factor"]) == expected
    assert params["rope_theta"] == 50000.0


def test_a_loaded_model_uses_the_scaled_frequencies(tiny_llama_path, monkeypatch):
    plain = load_model(str(tiny_llama_path), torch.float32, "cpu")
    monkeypatch.setenv("ROPE_SCALING", "linear")
    monkeypatch.setenv("ROPE_FACTOR", "2.0")
    scaled = load_model(str(tiny_llama_path), torch.float32, "cpu")
    assert (plain.rotary.rope_type, scaled.rotary.rope_type) == ("default", "linear")
    torch.testing.assert_close(scaled.rotary.inv_freq, plain.rotary.inv_freq / 2)


def test_per_layer_type_settings_scale_the_global_layers():
    """Gemma 3's settings per layer type: the override scales the full-attention layers, as transformers applies a
    config's `rope_scaling`, and the local layers keep theirs."""
    from transformers import Gemma3TextConfig

    from kettle.models.hf_config import layer_rope_parameters

    config = Gemma3TextConfig(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"])
    assert apply_rope_override(config, {"ROPE_SCALING": "dynamic", "ROPE_FACTOR": "2"})
    local, full = layer_rope_parameters(config)
    assert local == {"rope_type": "default", "rope_theta": 10000.0}
    assert full == {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1000000.0}
