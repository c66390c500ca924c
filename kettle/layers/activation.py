"""Activation functions by the names transformers configs use (`activation_function`, `hidden_act`, ...)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

# The tanh approximation of GELU appears under several names: "gelu_new" (GPT-2), "gelu_fast",
# "gelu_pytorch_tanh" (Gemma, StarCoder) and BLOOM's own; they are the same function up to float rounding.
_TANH_GELU = partial(F.gelu, approximate="tanh")

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_new": _TANH_GELU,
    "gelu_fast": _TANH_GELU,
    "gelu_pytorch_tanh": _TANH_GELU,
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The function `name` stands for; a clear error for names Kettle does not implement."""
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported (supported: {', '.join(sorted(ACTIVATIONS))})")
    return ACTIVATIONS[name]
