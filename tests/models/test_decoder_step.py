"""The fused CPU decode step (kettle/models/decoder_step.py over kettle/kernels/decoder_step.c) against the
same model run layer by layer.

Both paths run the same kernels in the same order on each output channel, row and attention item, so their
logits are not just close but equal, whatever the threads' split of the work.
"""

from __future__ import annotations

import logging

import pytest
import torch

from kettle.bench import drive
from kettle.bench.drive import BLOCK_SIZE, new_cache
from kettle.kernels import ops
from kettle.kernels.structs import LINEAR_Q4L
from kettle.layers.attention import AttentionMetadata
from kettle.models import decoder_step
from kettle.models.registry import load_model
from tests.fixtures import kernel_switch, make_variant, torch_threads, tune
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
    """PROMPTS prefilled, then decoded together greedily (fused or layer by layer): [steps, S, V] logits."""
    return drive.decode_logits(model, PROMPTS, fused, steps)


FAMILIES = ["llama", "qwen2", "mistral_sliding", "phi3", "qwen3", "gemma"]
# The float32 tiles are the same code whatever the family: three variants cover their shapes (biases, windows).
# Without batch invariance (`fast`) the thresholds pick the paths: the int16 rows below them, the tiles from 2 rows.
CASES = [(v, q, None, False) for v in FAMILIES for q in ("int4", "int8")]
CASES += [(v, q, None, True) for v in ("llama", "qwen2") for q in ("int4", "int8")]
CASES += [(v, q, 2, True) for v in ("llama", "qwen2", "mistral_sliding") for q in ("int4", "int8")]


@pytest.mark.parametrize("variant, quantize, float_rows, fast", CASES)
def test_fused_step_equals_the_layer_by_layer_forward(tmp_path, monkeypatch, variant, quantize, float_rows, fast):
    """Llama (grouped-query heads), Qwen2 (q/k/v biases, tied head), Mistral (a sliding window of 8,
    shorter than the contexts), Phi-3 (checkpoint-fused projections), Qwen3 (per-head q/k norms) and Gemma
    (tanh-GELU gate, scaled embeddings), over scattered block tables; projections with each row as alone (batch
    invariance, the default), and with it off over int16 rows (4 sequences are below the float32 tiles'
    thresholds) and over the float32 tiles (`float_rows` 2)."""
    tune(monkeypatch, "batch-invariant=off" if fast else "", f"float-rows={float_rows}" if float_rows else "")
    model = load_model(str(family_path(tmp_path, variant)), torch.float32, torch.device("cpu"), quantize=quantize)
    assert model.cpu_decoder_step is not None
    fused, reference = decode_logits(model, fused=True), decode_logits(model, fused=False)
    assert torch.equal(fused, reference)


@pytest.mark.parametrize("panels", ["float32", "integer"])
@pytest.mark.parametrize("quantize", ["int4", "int8"])
@pytest.mark.parametrize("variant", ["llama", "qwen2", "mistral_sliding"])
def test_fused_step_over_the_gemm_panels_equals_the_layer_by_layer_forward(
    tmp_path, monkeypatch, variant, quantize, panels
):
    """From `gemm-rows` rows (2 here, 16 by default) the step's projections run gemm.c's panels (float32, or
    integer on AVX-512 VNNI) inside its parallel region, as the layer-by-layer forward runs them per call: the same
    numbers. (Batch invariance off: with it on, the thresholds pick between kernels of the same bits, below.)"""
    tune(monkeypatch, "batch-invariant=off", "gemm-rows=2", "" if panels == "integer" else "integer-gemm=off")
    if panels == "integer" and not ops.integer_gemm():
        pytest.skip("no AVX-512 VNNI here")
    model = load_model(str(family_path(tmp_path, variant)), torch.float32, torch.device("cpu"), quantize=quantize)
    fused, reference = decode_logits(model, fused=True), decode_logits(model, fused=False)
    down = model.layers[0].mlp.down.describe()  # (a weight in lanes keeps its kernel below 128 rows)
    assert ops.path(down, 2) == "quantized" if ops.in_lanes(down) else ("int_gemm" if panels == "integer" else "gemm")
    assert torch.equal(fused, reference)
    if panels == "integer" or ops.in_lanes(down):
        # A weight in lanes runs int8 rows below its panels' threshold (128 rows with AVX-512 VNNI, 64 on AVX2):
        # the 68-row prefill reaches the float32 panels at gemm-rows=2 on AVX2 only, and int8 rows are not exact.
        return
    # Both exact to the dequantized weights, as the float32 tiles are: float32 rounding apart.
    tune(monkeypatch, "batch-invariant=off", "gemm-rows=0", "float-rows=2", "integer-gemm=off")
    torch.testing.assert_close(fused, decode_logits(model, fused=False), atol=1e-4, rtol=0)


@pytest.mark.parametrize("quantize", ["int4", "int8"])
@pytest.mark.parametrize("variant", ["llama", "qwen2"])
def test_integer_panels_stay_within_the_int8_rounding_of_the_float32_panels(tmp_path, monkeypatch, variant, quantize):
    """On AVX-512 VNNI the prompt's panels multiply int8 rows (their kernel is checked against the dense product of
    int8-rounded rows in tests/unit/test_prefill_kernels.py): the prompts' logits move by the activations' int8
    rounding only, ~0.6% of a projection's largest output on these random models, compounded over the layers and
    the head (measured: 0.04 with int4 weights, 0.32 with int8, logits up to ~8). The prefill's logits, not greedy
    steps after it: a token the rounding flips would take two runs apart."""
    if not ops.integer_gemm():
        pytest.skip("no AVX-512 VNNI here")

    def prefill_logits() -> torch.Tensor:
        tables, num_blocks = drive.scattered_tables([len(p) for p in PROMPTS])
        return drive.step(model, new_cache(model, num_blocks), PROMPTS, [0] * len(PROMPTS), tables)[0]

    tune(monkeypatch, "batch-invariant=off", "gemm-rows=2")  # the panels as the thresholds pick them
    model = load_model(str(family_path(tmp_path, variant)), torch.float32, torch.device("cpu"), quantize=quantize)
    integer = prefill_logits()
    down = model.layers[0].mlp.down.describe()
    assert ops.path(down, 2) == "quantized" if ops.in_lanes(down) else "int_gemm"
    tune(monkeypatch, "batch-invariant=off", "gemm-rows=2", "integer-gemm=off")
    float_panels = prefill_logits()
    assert not torch.equal(integer, float_panels)
    torch.testing.assert_close(integer, float_panels, atol=0.5, rtol=0)


@pytest.mark.parametrize("row_panels", [1, 1 << 30], ids=["row panels", "row channels"])
@pytest.mark.parametrize("layout", ["rows", "lanes"])
@pytest.mark.parametrize("quantize", ["int4", "int8"])
def test_fused_step_under_batch_invariance_equals_the_layer_by_layer_forward(
    tmp_path, monkeypatch, quantize, layout, row_panels
):
    """With each row computed as alone (the default), the fused step runs the rows layouts' row kernels
    (weight_types.c's `invariant_rows`, or gemm.c's row panels from `kettle_row_gemm_rows` rows: forced at every
    count here, and never) and lanes' tiles inside its parallel region, as the layer-by-layer forward runs them per
    call: the same numbers, and the same whichever kernel the row count picks."""
    if layout == "lanes" and not ops.lanes(LINEAR_Q4L):
        pytest.skip("the lanes layout needs the kernels (AVX-512 VNNI or AVX2)")
    tune(monkeypatch, "" if layout == "lanes" else "lanes=off")
    model = load_model(str(family_path(tmp_path, "qwen2")), torch.float32, torch.device("cpu"), quantize=quantize)
    with kernel_switch("kettle_row_gemm_rows", row_panels):
        fused, reference = decode_logits(model, fused=True), decode_logits(model, fused=False)
    assert torch.equal(fused, reference)
    with kernel_switch("kettle_row_gemm_rows", 1 << 30 if row_panels == 1 else 1):
        assert torch.equal(decode_logits(model, fused=True), fused)


def test_fused_step_on_an_avx2_cpus_lanes_kernels_equals_the_layer_by_layer_forward(tmp_path):
    """On an AVX2 CPU's kernels (AVX-512 VNNI off here) `--quantize int4` sits in lanes too: the fused step runs its
    AVX2 tiles and, for a step of 64 sequences or more, its AVX2 integer panels (the int8 rows laid out in the step's
    own buffers) inside its parallel region, as the layer-by-layer forward runs them per call: the same numbers."""
    with kernel_switch("kettle_cpu_vnni512", 0), kernel_switch("kettle_lanes_avx512", 0):
        model = load_model(str(family_path(tmp_path, "qwen2")), torch.float32, torch.device("cpu"), quantize="int4")
        assert model.cpu_decoder_step is not None
        down = model.layers[0].mlp.down.describe()
        assert ops.in_lanes(down)
        assert [ops.path(down, rows) for rows in (4, 70)] == ["quantized", "int_gemm"]
        prompts = [[3 + i % 40, 5 + i % 7, 11] for i in range(70)]
        fused, reference = (drive.decode_logits(model, prompts, fused, steps=3) for fused in (True, False))
        assert torch.equal(fused, reference)


@pytest.mark.parametrize("variant", ["llama", "qwen2", "mistral_sliding", "qwen3", "gemma"])
def test_float32_weights_stored_dense_decode_fused(tmp_path, monkeypatch, variant):
    """Float32 projections in the dense layout: the C step's tiles read them in place, while the layer-by-layer
    forward multiplies them with PyTorch's GEMM (another summation order), so the two agree to float32
    rounding rather than bit for bit."""
    tune(monkeypatch, "cpu-linear=dense")
    model = load_model(str(family_path(tmp_path, variant)), torch.float32, torch.device("cpu"))
    assert model.cpu_decoder_step is not None
    fused, reference = decode_logits(model, fused=True), decode_logits(model, fused=False)
    torch.testing.assert_close(fused, reference, atol=1e-4, rtol=0)


def test_the_step_applies_only_where_its_kernels_would_run(tmp_path, monkeypatch):
    path = str(make_variant(tmp_path, "llama"))
    assert load_model(path, torch.float32, torch.device("cpu")).cpu_decoder_step is None  # oneDNN-packed float32
    model = load_model(path, torch.float32, torch.device("cpu"), quantize="int4")
    tune(monkeypatch, "decoder-step=off")
    assert model.cpu_decoder_step is None
    tune(monkeypatch, "quantized-activations=off")  # the exact float32-activation kernels instead
    assert decoder_step.DecoderStep.build(model) is None
    tune(monkeypatch)
    fused = decoder_step.DecoderStep.build(model)
    cache = new_cache(model, 8)
    decode = AttentionMetadata.build([1, 1], [3, 5], [[1, 2], [3, 4]], BLOCK_SIZE, "cpu")
    prefill = AttentionMetadata.build([1, 4], [3, 0], [[1, 2], [3, 4]], BLOCK_SIZE, "cpu")
    assert fused.fits(cache, decode)
    assert not fused.fits(cache, prefill)  # a prompt in the step: the layer-by-layer forward runs it
    fused.max_rows = 1
    assert not fused.fits(cache, decode)  # more rows than the packed kernels take (`dense_rows`)


def other_family(tmp_path, name: str):
    """A tiny checkpoint of a family whose blocks differ from Llama's, built as the family parity tests do."""
    import transformers

    from tests.models import test_gpt_families as gpt
    from tests.models.test_llama_like_families import PHI3_VARIANTS

    settings = tiny_settings(tmp_path)
    builders = {
        "gpt2": lambda: gpt.gpt2(tmp_path, settings),
        "gpt_bigcode": lambda: gpt.gpt2(tmp_path, settings, multi_query=True),
        "falcon": lambda: gpt.falcon(tmp_path, settings),  # 7B layout: multi-query, parallel, one norm
        "falcon_40b": lambda: gpt.falcon(tmp_path, settings, new_decoder_architecture=True, num_kv_heads=2),
        "gemma2": lambda: gpt.gemma2(tmp_path, settings),
    }
    if name in builders:
        builders[name]()
        return tmp_path
    mha = {k: v for k, v in settings.items() if k != "num_key_value_heads"}
    configs = {
        "starcoder2": ("Starcoder2", dict(settings, sliding_window=8, pad_token_id=0)),
        "phi": ("Phi", dict(mha, qk_layernorm=True)),
        "phi3_partial": ("Phi3", dict(settings, pad_token_id=0, **PHI3_VARIANTS["phi3_longrope"])),
        "gpt_neox": ("GPTNeoX", dict(mha, use_parallel_residual=True, bos_token_id=settings["eos_token_id"])),
        "gptj": ("GPTJ", dict(gpt.gpt2_names(settings), rotary_dim=8)),
        "mixtral": ("Mixtral", dict(settings, num_local_experts=4, num_experts_per_tok=2)),
    }
    prefix, config = configs[name]
    model_cls = getattr(transformers, f"{prefix}ForCausalLM")
    return save_tiny(tmp_path, getattr(transformers, f"{prefix}Config")(**config), model_cls)


OTHER_FAMILIES = [
    "starcoder2", "gemma2", "phi", "phi3_partial", "gpt_neox", "gptj", "falcon", "falcon_40b", "mixtral", "gpt2",
    "gpt_bigcode",
]  # fmt: skip
# Largest logits difference (logits up to ~8) measured over these families: 2.4e-5 with float32 weights; with int4
# weights 6.6e-2 (falcon), because a norm's or activation's float rounding, which differs between the step's C and
# PyTorch's, can move an input across an int8 step of the lanes kernels' rows.
TOLERANCE = {None: 1e-4, "int4": 0.1}


@pytest.mark.parametrize("quantize", [None, "int4"])
@pytest.mark.parametrize("family", OTHER_FAMILIES)
def test_every_family_decodes_through_the_fused_step(tmp_path, monkeypatch, family, quantize):
    """The step's LayerNorm, activations (erf-GELU by polynomial, tanh by exp), partial and interleaved RoPE,
    soft-capped scores, parallel residuals, branch norms and routed experts against the layer-by-layer forward
    (PyTorch's LayerNorm, GELU and rotation), with float32 weights (stored dense) and int4 ones: float32
    rounding apart, and the same greedy tokens."""
    tune(monkeypatch, "cpu-linear=dense")
    model = load_model(str(other_family(tmp_path, family)), torch.float32, torch.device("cpu"), quantize=quantize)
    assert model.cpu_decoder_step is not None, decoder_step.DecoderStep.why_not
    fused, reference = decode_logits(model, fused=True), decode_logits(model, fused=False)
    torch.testing.assert_close(fused, reference, atol=TOLERANCE[quantize], rtol=0)
    assert torch.equal(fused.argmax(-1), reference.argmax(-1))


@pytest.mark.parametrize("family, why", [("mpt", "ALiBi"), ("bloom", "a BloomBlock block")])
def test_blocks_the_step_lacks_run_layer_by_layer_and_say_why(tmp_path, family, why):
    """MPT's ALiBi and BLOOM's own block are not in the C step: no fused step, and the reason kept for the log."""
    from tests.models import test_gpt_families as gpt

    getattr(gpt, family)(tmp_path, tiny_settings(tmp_path))
    model = load_model(str(tmp_path), torch.float32, torch.device("cpu"), quantize="int4")
    assert model.cpu_decoder_step is None
    assert decoder_step.DecoderStep.why_not == why


@pytest.mark.parametrize("quantize, path", [(None, "layer by layer"), ("int4", "as one fused CPU call")])
def test_the_shard_logs_which_decode_path_serves(tiny_llama_path, caplog, quantize, path):
    from kettle.shard.config import ShardConfig
    from kettle.shard.server import build_engine

    with caplog.at_level(logging.INFO, logger="kettle.shard.server"):
        build_engine(ShardConfig(model_path=str(tiny_llama_path), dtype="float32", quantize=quantize))
    assert f"Decode steps run {path}" in caplog.text


@pytest.mark.parametrize("invariant", ["on", "off"], ids=["invariant", "fast"])
def test_fused_step_over_a_long_context_cut_into_pieces_equals_the_layer_by_layer_forward(
    tmp_path, monkeypatch, invariant
):
    """One sequence of 600 tokens on 4 threads is one attention item (a sequence, every head), fewer than the threads
    want, so each layer's context is cut into pieces attended apart and combined (kernels.h `context_parts`; under batch
    invariance as many as the sequence alone takes, `sequence_parts`), in the fused step as in the layer-by-layer
    forward's kernel: the same numbers."""
    from tests.fixtures import make_tiny_llama

    tune(monkeypatch, f"batch-invariant={invariant}")
    path = str(make_tiny_llama(tmp_path, max_position_embeddings=1024))
    model = load_model(path, torch.float32, torch.device("cpu"), quantize="int4")
    assert model.cpu_decoder_step is not None
    prompt = [3 + (7 * i) % (model.spec.vocab_size - 3) for i in range(600)]
    with torch_threads(4):
        fused = drive.decode_logits(model, [prompt], True, steps=4)
        reference = drive.decode_logits(model, [prompt], False, steps=4)
    assert torch.equal(fused, reference)
