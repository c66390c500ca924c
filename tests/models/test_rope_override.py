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
