"""The fused CPU decode step (kettle/models/decoder_step.py over kettle/kernels/decoder_step.c) against the
same model run layer by layer.

Both paths run the same kernels in the same order on each output channel, row and attention item, so their
logits are not just close but equal, whatever the threads' split of the work.
"""

from __future__ import annotations

import logging

import pytest
import torch

from kettle.kernels import ops
from kettle.layers.attention import AttentionMetadata
from kettle.models import decoder_step
from kettle.models.registry import load_model
from tests.fixtures import torch_threads
from tests.models.drive import BLOCK_SIZE, make_variant, new_cache, scattered_tables, step
from tests.models.family_parity import save_tiny, tiny_settings
from tests.unit.test_cpu_kernels import CAN_BUILD

pytestmark = pytest.mark.skipif(not CAN_BUILD, reason="needs gcc and an AVX2/FMA/F16C CPU")
PROMPTS = [[3, 17, 5, 9, 11], [8] * 23, [40, 41, 42], list(range(10, 47))]


@pytest.fixture(autouse=True)
def two_threads():
    # Two threads, so the step's barriers and the split of channels between threads are exercised.
    with torch_threads(2):
        yield


def family_path(tmp_path, variant: str):
    """A tiny checkpoint: a Llama variant (`make_variant`), or another family through its transformers class."""
    import transformers

    classes = {"phi3": "Phi3", "qwen3": "Qwen3", "gemma": "Gemma", "starcoder2": "Starcoder2"}
    if variant not in classes:
        return make_variant(tmp_path, variant)
    config_cls = getattr(transformers, f"{classes[variant]}Config")
    model_cls = getattr(transformers, f"{classes[variant]}ForCausalLM")
    return save_tiny(tmp_path, config_cls(**tiny_settings(tmp_path), pad_token_id=0), model_cls)


def decode_logits(model, fused: bool, steps: int = 12) -> torch.Tensor:
    """Prefills PROMPTS, then decodes them together greedily; the logits of every decode step [steps, S, V]."""
    model.__dict__.pop("cpu_decoder_step", None)
    if not fused:
        model.__dict__["cpu_decoder_step"] = None  # the cached property, overridden: layer by layer
    tables, num_blocks = scattered_tables([len(p) + steps for p in PROMPTS])
    cache = new_cache(model, num_blocks)
    logits, meta = step(model, cache, PROMPTS, [0] * len(PROMPTS), tables)
    tokens, out = logits[meta.last_token_indices].argmax(-1), []
    for i in range(steps):
        logits, _ = step(model, cache, [[t] for t in tokens.tolist()], [len(p) + i for p in PROMPTS], tables)
        out.append(logits)
        tokens = logits.argmax(-1)
    model.__dict__.pop("cpu_decoder_step", None)
    return torch.stack(out)


FAMILIES = ["llama", "qwen2", "mistral_sliding", "phi3", "qwen3", "gemma"]
# The float32 tiles are the same code whatever the family: three variants cover their shapes (biases, windows).
CASES = [(v, q, None) for v in FAMILIES for q in ("int4", "int8")]
CASES += [(v, q, 2) for v in ("llama", "qwen2", "mistral_sliding") for q in ("int4", "int8")]


@pytest.mark.parametrize("variant, quantize, float_rows", CASES)
def test_fused_step_equals_the_layer_by_layer_forward(tmp_path, monkeypatch, variant, quantize, float_rows):
    """Llama (grouped-query heads), Qwen2 (q/k/v biases, tied head), Mistral (a sliding window of 8,
    shorter than the contexts), Phi-3 (checkpoint-fused projections), Qwen3 (per-head q/k norms) and Gemma
    (tanh-GELU gate, scaled embeddings), over scattered block tables; projections over int16 rows (4
    sequences are below the float32 tiles' thresholds) and over the float32 tiles (`float_rows` 2)."""
    if float_rows is not None:
        monkeypatch.setattr(ops, "Q4_FLOAT_ROWS", float_rows)
        monkeypatch.setattr(ops, "Q8_FLOAT_ROWS", float_rows)
    model = load_model(str(family_path(tmp_path, variant)), torch.float32, torch.device("cpu"), quantize=quantize)
    assert model.cpu_decoder_step is not None
    fused, reference = decode_logits(model, fused=True), decode_logits(model, fused=False)
    assert torch.equal(fused, reference)


@pytest.mark.parametrize("variant", ["llama", "qwen2", "mistral_sliding", "qwen3", "gemma"])
def test_float32_weights_stored_dense_decode_fused(tmp_path, monkeypatch, variant):
    """Float32 projections in the dense layout: the C step's tiles read them in place, while the layer-by-layer
    forward multiplies them with PyTorch's GEMM (another summation order), so the two agree to float32
    rounding rather than bit for bit."""
    monkeypatch.setenv("KETTLE_CPU_LINEAR", "dense")
    model = load_model(str(family_path(tmp_path, variant)), torch.float32, torch.device("cpu"))
    assert model.cpu_decoder_step is not None
    fused, reference = decode_logits(model, fused=True), decode_logits(model, fused=False)
    torch.testing.assert_close(fused, reference, atol=1e-4, rtol=0)


def test_the_step_applies_only_where_its_kernels_would_run(tmp_path, monkeypatch):
    path = str(make_variant(tmp_path, "llama"))
    assert load_model(path, torch.float32, torch.device("cpu")).cpu_decoder_step is None  # oneDNN-packed float32
    model = load_model(path, torch.float32, torch.device("cpu"), quantize="int4")
    monkeypatch.setenv("KETTLE_CPU_DECODER_STEP", "0")
    assert model.cpu_decoder_step is None
    monkeypatch.delenv("KETTLE_CPU_DECODER_STEP")
    monkeypatch.setattr(ops, "QUANTIZED_ACTIVATIONS", False)  # the exact float32-activation kernels instead
    assert decoder_step.DecoderStep.build(model) is None
    monkeypatch.setattr(ops, "QUANTIZED_ACTIVATIONS", True)
    fused = decoder_step.DecoderStep.build(model)
    cache = new_cache(model, 8)
    decode = AttentionMetadata.build([1, 1], [3, 5], [[1, 2], [3, 4]], BLOCK_SIZE, "cpu")
    prefill = AttentionMetadata.build([1, 4], [3, 0], [[1, 2], [3, 4]], BLOCK_SIZE, "cpu")
    assert fused.fits(cache, decode)
    assert not fused.fits(cache, prefill)  # a prompt in the step: the layer-by-layer forward runs it
    fused.max_rows = 1
    assert not fused.fits(cache, decode)  # more rows than the packed kernels take (`dense_rows`)


def test_a_family_with_blocks_the_step_lacks_runs_layer_by_layer(tmp_path):
    """StarCoder2's LayerNorms and plain MLP are not in the C step: no fused step for it."""
    model = load_model(str(family_path(tmp_path, "starcoder2")), torch.float32, torch.device("cpu"), quantize="int4")
    assert model.cpu_decoder_step is None


@pytest.mark.parametrize("quantize, path", [(None, "layer by layer"), ("int4", "as one fused CPU call")])
def test_the_shard_logs_which_decode_path_serves(tiny_llama_path, caplog, quantize, path):
    from kettle.shard.config import ShardConfig
    from kettle.shard.server import build_engine

    with caplog.at_level(logging.INFO, logger="kettle.shard.server"):
        build_engine(ShardConfig(model_path=str(tiny_llama_path), dtype="float32", quantize=quantize))
    assert f"Decode steps run {path}" in caplog.text
