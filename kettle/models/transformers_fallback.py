"""Models Kettle has no native implementation for, run through transformers itself.

Any `AutoModelForCausalLM` is served by `TransformersCausalLM` (driven by `FallbackRunner`, padded batches over
transformers' own KV cache) and any encoder-decoder model by `TransformersSeq2SeqLM` (see `seq2seq.py`). Both
expose the `spec` the shard sizes its KV budget from, and `execution_path` for `/info`.

Before transformers sees a checkpoint, `kettle.catalog.check_loadable` turns its two unhelpful failures into
one clear line each (custom code without `--trust-remote-code`, a model type transformers does not know).
"""

from __future__ import annotations

import inspect
import logging

import torch

from kettle.models.spec import ModelSpec

logger = logging.getLogger(__name__)


def spec_from_config(config, dtype: torch.dtype, decoder_layers_factor: int = 1) -> ModelSpec:
    """A `ModelSpec` read from any transformers config (names differ per family: best effort, with defaults).

    `decoder_layers_factor` counts the K/V sets per layer the KV budget must hold (2 for self + cross).
    """
    text = config.get_text_config(decoder=True)
    hidden = _first(text, ("hidden_size", "d_model", "n_embd"), 0)
    heads = _first(text, ("num_attention_heads", "num_heads", "n_head", "decoder_attention_heads"), 1)
    kv_heads = _first(text, ("num_key_value_heads", "num_kv_heads"), heads) or heads
    layers = _first(text, ("num_hidden_layers", "num_decoder_layers", "decoder_layers", "n_layer", "num_layers"), 1)
    head_dim = getattr(text, "head_dim", None) or _first(text, ("d_kv",), 0) or max(1, hidden // max(1, heads))
    return ModelSpec(
        model_type=config.model_type,
        num_layers=layers * decoder_layers_factor,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        hidden_size=hidden,
        vocab_size=_first(text, ("vocab_size",), 0),
        max_position_embeddings=_first(text, ("max_position_embeddings", "n_positions", "max_length"), 0),
        sliding_window=None,
        dtype=dtype,
    )


def _first(config, names: tuple[str, ...], default: int) -> int:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return default


def accepts(module: torch.nn.Module, argument: str) -> bool:
    """Whether `module.forward` takes `argument` by name."""
    return argument in inspect.signature(module.forward).parameters


class TransformersCausalLM:
    """A transformers causal LM behind the shard's model interface (driven by `FallbackRunner`)."""

    execution_path = "transformers"
    position_offset = 0  # added to every position fed to the forward (`transformers_vision.py`: PaliGemma's 1)

    def __init__(self, model, dtype: torch.dtype) -> None:
        self.model = model
        self.config = model.config
        self.spec = spec_from_config(model.config, dtype)
        self.takes_positions = accepts(model, "position_ids")
        self.takes_logits_to_keep = accepts(model, "logits_to_keep")
        self.pad_token_id = pad_id(model.config)

    @classmethod
    def from_pretrained(cls, path: str, dtype: torch.dtype, device: torch.device, trust_remote_code: bool = False):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code)
        logger.info("No native implementation of %r: serving it through transformers", model.config.model_type)
        return cls(model.to(device).eval(), dtype)

    def compute_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The runner already holds logits (transformers computes them): identity, so shared code applies."""
        return logits.float()


def pad_id(config) -> int:
    """The id fed at padded positions (masked out, so any valid id works): pad, else EOS, else BOS, else 0.

    Only ids inside the embedding count: configs carry defaults of their family's full vocabulary."""
    text = config.get_text_config(decoder=True)
    vocab_size = getattr(text, "vocab_size", None) or 0
    for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
        value = getattr(text, name, None)
        value = value[0] if isinstance(value, list) and value else value
        if isinstance(value, int) and 0 <= value < vocab_size:
            return value
    return 0
