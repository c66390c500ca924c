"""Encoder-decoder models (T5 / FLAN-T5, BART, M2M100, any `AutoModelForSeq2SeqLM`) through transformers.

The prompt goes through the encoder once; the decoder then generates from `decoder_start_token_id`, one token
per step, over transformers' self- and cross-attention caches (driven by `Seq2SeqRunner`). The generated text
is the decoder's output alone: there is no prompt continuation to prepend.
"""

from __future__ import annotations

import logging

import torch

from kettle.models.transformers_fallback import pad_id, spec_from_config

logger = logging.getLogger(__name__)


class TransformersSeq2SeqLM:
    """A transformers encoder-decoder model behind the shard's model interface."""

    execution_path = "seq2seq"

    def __init__(self, model, dtype: torch.dtype) -> None:
        self.model = model
        self.config = model.config
        # Self- and cross-attention K/V per decoder layer: twice the layers for the KV budget.
        self.spec = spec_from_config(model.config, dtype, decoder_layers_factor=2)
        self.decoder_start_token_id = decoder_start_id(model)
        self.pad_token_id = pad_id(model.config)

    @classmethod
    def from_pretrained(cls, path: str, dtype: torch.dtype, device: torch.device, trust_remote_code: bool = False):
        from transformers import AutoModelForSeq2SeqLM

        model = AutoModelForSeq2SeqLM.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code)
        logger.info("Encoder-decoder model %r: serving it through transformers (seq2seq)", model.config.model_type)
        return cls(model.to(device).eval(), dtype)

    def compute_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Identity: transformers already computed logits (lets the shared runner code apply)."""
        return logits.float()

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The encoder's last hidden states [B, S, d] of (right-padded) prompts."""
        return self.model.get_encoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


def decoder_start_id(model) -> int:
    """The generation config's decoder start token, else the model config's, else pad (T5's convention)."""
    for config in (getattr(model, "generation_config", None), model.config):
        value = getattr(config, "decoder_start_token_id", None) if config is not None else None
        if isinstance(value, int):
            return value
    return pad_id(model.config)
