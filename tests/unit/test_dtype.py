"""`--dtype` and the per-device default (kettle/shard/dtype.py)."""

from __future__ import annotations

import json

import pytest
import torch

from kettle.shard.dtype import checkpoint_dtype, choose_dtype

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # only the device type is read: no GPU needed


def _folder(tmp_path, **config):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize("name", ["float32", "bfloat16", "float16"])
def test_an_explicit_dtype_wins_on_cuda(name, tmp_path):
    assert choose_dtype(name, CUDA, _folder(tmp_path, torch_dtype="float16")) == getattr(torch, name)


def test_cpu_defaults_to_float32_whatever_the_checkpoint_says(tmp_path):
    assert choose_dtype(None, CPU, _folder(tmp_path, torch_dtype="bfloat16")) == torch.float32
    assert choose_dtype("bfloat16", CPU) == torch.bfloat16


def test_float16_on_the_cpu_is_refused_with_the_alternatives():
    with pytest.raises(ValueError, match="float16 is not supported on the CPU: use bfloat16 or float32"):
        choose_dtype("float16", CPU)


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"torch_dtype": "float16"}, torch.float16),
        ({"dtype": "bfloat16"}, torch.bfloat16),  # transformers 5 spelling
        ({"text_config": {"dtype": "float16"}}, torch.float16),  # multimodal configs nest it
        ({"torch_dtype": "float32"}, torch.bfloat16),  # fp32 checkpoints are served in bf16 on a GPU
        ({}, torch.bfloat16),
    ],
)
def test_cuda_follows_a_half_precision_checkpoint(config, expected, tmp_path):
    assert choose_dtype(None, CUDA, _folder(tmp_path, **config)) == expected


def test_checkpoint_dtype_without_config_is_unknown(tmp_path):
    assert checkpoint_dtype(tmp_path) is None
