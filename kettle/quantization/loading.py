"""Weight-only quantization applied while a model loads, so model files need no change.

`load_model` resolves the scheme (`resolve_scheme`: the `--quantize` flag and the checkpoint's own
`quantization_config`), then reads the checkpoint with `Weights(..., quantize=scheme)`:
`Linear.load` asks the scheme first, so each projection is quantized as it is read (int8/int4), or built
from the checkpoint's packed tensors (GPTQ/AWQ), and the float32 weights of the whole model never sit in
memory at once. `finish` then quantizes the LM head, which the models build directly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from kettle.catalog import check_scheme
from kettle.kernels import ops
from kettle.process_memory import release_free_memory
from kettle.quantization.awq import AwqFormat
from kettle.quantization.config import int4_group_size, lm_head_scheme
from kettle.quantization.gptq import GptqFormat
from kettle.quantization.int4 import Int4Linear
from kettle.quantization.int8 import Int8Linear
from kettle.quantization.q4 import CHUNK, Q4Linear
from kettle.quantization.q8 import Q8Linear
from kettle.quantization.qparams import QParams
from kettle.tensors.weights import Weights

PREQUANTIZED = {"gptq": GptqFormat, "awq": AwqFormat}
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Scheme:
    """What load-time quantization does: `method` int8/int4/gptq/awq, the int4 group size, the checkpoint
    format for gptq/awq, and the LM head's scheme (`KETTLE_QUANT_LM_HEAD`; None keeps it dense)."""

    method: str
    group_size: int | None = None
    checkpoint: GptqFormat | AwqFormat | None = None
    head: str | None = None

    def load_linear(self, weights: Weights, prefixes: list[str]) -> nn.Module | None:
        """The fused projections `prefixes` quantized under this scheme; None when the checkpoint left them
        unquantized, for `Linear.load` to load them dense."""
        biases = [weights.get_optional(f"{prefix}.bias") for prefix in prefixes]
        if self.checkpoint is not None:
            if not all(self.checkpoint.is_quantized(weights, prefix) for prefix in prefixes):
                return None
            qparams = QParams.concat([self.checkpoint.load(weights, prefix) for prefix in prefixes])
            return int4_class(qparams.q).from_qparams(
                qparams.q, qparams.scale, qparams.zero, qparams.group_size, _fused_bias(biases, qparams.q)
            )
        weight = torch.cat([weights.get(f"{prefix}.weight") for prefix in prefixes])
        return quantize_weight(self, weight, _fused_bias(biases, weight))

    def quantize_tensor(self, weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module | None:
        """A reshaped dense projection under int8/int4; a GPTQ/AWQ checkpoint's own packs cannot be reshaped,
        so there it stays dense."""
        return None if self.checkpoint is not None else quantize_weight(self, weight, bias)


def resolve_scheme(quantize: str | None, config, device_type: str) -> Scheme | None:
    """The scheme for `--quantize` and the checkpoint's `quantization_config`, or None for plain loading;
    raises a ValueError naming the alternatives for a value that cannot run here."""
    qconfig = getattr(config, "quantization_config", None)
    qconfig = qconfig.to_dict() if hasattr(qconfig, "to_dict") else qconfig
    method = (qconfig or {}).get("quant_method")
    if method is not None and method not in PREQUANTIZED:
        raise ValueError(f"checkpoint quantization {method!r} is not supported (supported: gptq, awq)")
    if method is not None and quantize not in (None, method):
        raise ValueError(f"the checkpoint is already {method}-quantized: use --quantize {method} or no --quantize")
    if quantize in PREQUANTIZED and method is None:
        raise ValueError(f"--quantize {quantize} needs a {quantize} checkpoint (quantization_config in config.json)")
    quantize = quantize or method
    check_scheme(quantize, device_type)
    if quantize in (None, "fp8"):
        return None
    from kettle.tensors import distributed

    if quantize in PREQUANTIZED and distributed.current().world_size > 1:
        # int8/int4 quantize each rank's slice as it is read; packed GPTQ/AWQ tensors are not sliced.
        raise ValueError(f"--quantize {quantize} runs on one shard (packed tensors are not split): use --num-shard 1")
    if quantize in PREQUANTIZED:  # the head stays as the checkpoint has it (these formats leave it dense)
        return Scheme(quantize, checkpoint=PREQUANTIZED[quantize].from_config(qconfig))
    return Scheme(quantize, int4_group_size(), head=lm_head_scheme(quantize))


def default_gguf_scheme(path: str, device_type: str):
    """The file's own quantization for a GGUF model folder on the CPU (`gguf_scheme`); None elsewhere: other
    checkpoints load as stored, and on CUDA GGUF weights are dequantized to the model dtype."""
    from pathlib import Path

    from kettle.quantization.gguf_scheme import gguf_scheme
    from kettle.tensors import distributed
    from kettle.tensors.gguf_file import GgufTensors, folder_gguf

    gguf = folder_gguf(Path(path))
    if gguf is None or device_type != "cpu" or distributed.current().world_size > 1:
        return None
    return gguf_scheme(GgufTensors(gguf))


def quantize_weight(scheme: Scheme, weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
    """A dense [out, in] weight as an `Int8Linear` or `Int4Linear`; int8 for a shape the int4 kernel cannot
    take (out_features not a multiple of 16, e.g. GPT-2's 50257-row head, or in_features not of 32)."""
    out_features, in_features = weight.shape
    if scheme.method == "int8" or out_features % 16 or in_features % 32:
        return Int8Linear.from_weight(weight, bias)
    return int4_class(weight).from_weight(weight, bias, scheme.group_size)


def int4_class(weight: torch.Tensor) -> type[Int4Linear] | type[Q4Linear]:
    """Kettle's own CPU kernel layout for a CPU weight when the kernels built here, else PyTorch's packed
    kernels (`Int4Linear`, also the CUDA path)."""
    fits = weight.device.type == "cpu" and weight.shape[1] % CHUNK == 0
    return Q4Linear if fits and ops.available() else Int4Linear


def _fused_bias(biases: list[torch.Tensor | None], stacked: torch.Tensor) -> torch.Tensor | None:
    if all(bias is None for bias in biases):
        return None
    if any(bias is None for bias in biases):
        raise ValueError("quantized fused projections with a bias on only some of them are not supported")
    bias = torch.cat(biases)
    if bias.shape[0] != stacked.shape[0]:
        raise ValueError(f"fused bias has {bias.shape[0]} entries for {stacked.shape[0]} output channels")
    return bias


def finish(model: nn.Module, scheme: Scheme | None) -> nn.Module:
    """Quantizes the model's dense LM head under `scheme` (its tied embedding keeps its own float table)."""
    from kettle.layers.linear import Linear
    from kettle.layers.parallel import VocabParallelHead

    head = getattr(model, "lm_head", None)
    if scheme is None:
        return model
    load_head = getattr(scheme, "load_head", None)  # a GGUF file's own head tensor (gguf_scheme.py)
    if load_head is not None and isinstance(head, Linear):
        model.lm_head = load_head(head)
        if scheme.tied_head and isinstance(model.lm_head, Q8Linear) and not model.tp.sharded:
            # The embedding reads its rows from the head's Q8_0 table: the float32 copy goes (exact: the same
            # dequantized values).
            model.embed_rows, model.embed_tokens = model.lm_head.embed, None
    if scheme.head is not None and isinstance(head, Linear):
        model.lm_head = _quantized_head(scheme, head)
    elif scheme.head is not None and isinstance(head, VocabParallelHead):  # this rank's block of the vocabulary
        head.lm_head = _quantized_head(scheme, head.lm_head)
    # glibc keeps the freed float32 weights mapped for reuse (~300 MiB of a quantized SmolLM2): hand them back.
    release_free_memory()
    if torch.cuda.is_available():  # the dense weights freed on the GPU, back for the KV cache to claim
        torch.cuda.empty_cache()
    groups = sorted({m.group_size for m in model.modules() if isinstance(m, Int4Linear | Q4Linear)})
    model.quantization = getattr(scheme, "description", scheme.method)  # for /info and the start-up log
    head_kind = type(model.lm_head).__name__ if hasattr(model, "lm_head") else None
    logger.info("Weights served as %s (int4 group sizes %s, LM head %s)", model.quantization, groups, head_kind)
    return model


def _quantized_head(scheme: Scheme, head) -> nn.Module:
    weight = head.weight.to_dense() if head.layout == "onednn" else head.dense_weight
    bias = None if head.bias is None else head.bias.data
    return quantize_weight(Scheme(scheme.head, scheme.group_size), weight.float(), bias)


def in_lanes(model) -> bool:
    """Whether every int4/int8 projection of `model` is held in lanes (kettle/quantization/q4.py, q8.py) on the
    AVX-512 tiles, so that `ops.LANES_TILE_ROWS` decode rows go through its kernels in one pass (else `ops.TILE_ROWS`,
    as many as the AVX2 tiles take a pass): a speculative step verifies within one pass. False for a model that is no
    module (a runner's wrapper of transformers)."""
    if not isinstance(model, nn.Module) or not ops.vnni():
        return False
    quantized = [m for m in model.modules() if isinstance(m, Q4Linear | Q8Linear | Int8Linear | Int4Linear)]
    return bool(quantized) and all(getattr(m, "lanes", False) for m in quantized)
