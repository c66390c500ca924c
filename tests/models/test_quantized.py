"""Quantized models end to end at the model level: int8/int4 logits near float32, GPTQ and AWQ checkpoints
(packed here from known integer weights, following each format's spec) against transformers running their
dequantized weights, and the bundled SmolLM2 still answering sensibly under int4."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kettle.bench.drive import PROMPTS, greedy, new_cache, scattered_tables, step
from kettle.models.registry import load_model
from kettle.quantization.awq import ORDER
from kettle.quantization.int4 import Int4Linear
from kettle.quantization.int8 import Int8Linear
from tests.fixtures import add_tuning, make_tiny_llama

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Logit error relative to the largest reference logit. The packed kernels take bfloat16 activations and keep
# scales in bfloat16 (~0.4% each), compounded over 2 layers of this tiny model's large random weights: ≤ 3%
# measured against the exact dequantized weights (GPTQ, AWQ, int4), ~4% for int8 against float32.
EXACT_RTOL = 0.05
INT8_RTOL = 0.08
# On the bundled model, mean KL divergence of the quantized next-token distributions from float32's
# (measured: int8 0.010, int4 0.002 — its weights come from a Q4_1 GGUF, whose grid int4 keeps exactly).
BUNDLED_MEAN_KL = 0.05


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny"), intermediate_size=256)


def prompt_ids(path: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    return [tokenizer(p).input_ids for p in PROMPTS]


def kettle_logits(model, prompts: list[list[int]]) -> torch.Tensor:
    """Logits of every prompt token, all prompts in one forward over the paged cache."""
    tables, num_blocks = scattered_tables([len(p) for p in prompts])
    logits, _ = step(model, new_cache(model, num_blocks), prompts, [0] * len(prompts), tables)
    return logits


def relative_error(logits: torch.Tensor, reference: torch.Tensor) -> float:
    return float((logits - reference).abs().max() / reference.abs().max())


def test_int8_logits_stay_near_float32(tiny):
    prompts = prompt_ids(tiny)
    reference = kettle_logits(load_model(str(tiny), torch.float32, torch.device("cpu")), prompts)
    quantized = load_model(str(tiny), torch.float32, torch.device("cpu"), quantize="int8")
    assert relative_error(kettle_logits(quantized, prompts), reference) < INT8_RTOL


def test_int4_model_matches_its_dequantized_weights(tiny, monkeypatch):
    """Kettle's int4 model against transformers running the weights int4 quantization rounds to (4 bits
    of random weights move this tiny model's logits by up to 70%, so float32 is no reference here). Float32
    activations: the mapping is what this checks (the kernels' int8 rows: tests/unit/test_weight_types.py)."""
    from transformers import AutoModelForCausalLM

    add_tuning(monkeypatch, quantized_activations=False)
    reference = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    rounded = {}
    for name, weight in reference.state_dict().items():
        if name.rsplit(".", 2)[-2] in PROJECTIONS:
            rounded[name] = Int4Linear.from_weight(weight, act_dtype=torch.float32).dequantized()
    rounded["lm_head.weight"] = Int8Linear.from_weight(reference.lm_head.weight).dequantized()  # the default head
    reference.load_state_dict(rounded, strict=False)
    prompts = prompt_ids(tiny)
    model = load_model(str(tiny), torch.float32, torch.device("cpu"), quantize="int4")
    assert_matches(reference, prompts, kettle_logits(model, prompts))


def assert_matches(reference, prompts: list[list[int]], logits: torch.Tensor) -> None:
    for ids, rows in zip(prompts, logits.split([len(p) for p in prompts]), strict=True):
        with torch.no_grad():
            expected = reference(torch.tensor([ids])).logits[0]
        assert relative_error(rows, expected) < EXACT_RTOL


def words(nibbles: torch.Tensor) -> torch.Tensor:
    """[..., 8] values 0..15 → int32 words, nibble i at bits 4i."""
    value = (nibbles.long() << (4 * torch.arange(8))).sum(-1)
    return torch.where(value >= 2**31, value - 2**32, value).to(torch.int32)


def pack_gptq(q: torch.Tensor, zeros: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    """GPTQ v1: qweight [K/8, N] along the input dim, qzeros [K/g, N/8] stored minus one, trivial g_idx."""
    n, k = q.shape
    return {
        "qweight": words(q.t().reshape(k // 8, 8, n).permute(0, 2, 1)),
        "qzeros": words((zeros - 1).reshape(zeros.shape[0], n // 8, 8)),
        "g_idx": torch.arange(k, dtype=torch.int32) // group,
    }


def pack_awq(q: torch.Tensor, zeros: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    """AWQ GEMM: qweight [K, N/8] along the output dim, nibble i holding channel ORDER[i]; qzeros alike."""
    n, k = q.shape
    return {
        "qweight": words(q.t().reshape(k, n // 8, 8)[..., list(ORDER)]),
        "qzeros": words(zeros.reshape(zeros.shape[0], n // 8, 8)[..., list(ORDER)]),
    }


def make_prequantized(source: Path, target: Path, method: str, group: int = 32) -> dict[str, torch.Tensor]:
    """Copies `source` to `target` with every projection replaced by known random 4-bit weights in `method`'s
    format; returns the dequantized float32 weights (the reference's)."""
    generator = torch.Generator().manual_seed(1)
    tensors, dequantized = load_file(source / "model.safetensors"), {}
    for name in [n for n in list(tensors) if n.rsplit(".", 2)[-2] in PROJECTIONS]:
        n, k = tensors.pop(name).shape
        q = torch.randint(0, 16, (n, k), generator=generator, dtype=torch.int32)
        zeros = torch.randint(1, 16, (k // group, n), generator=generator, dtype=torch.int32)
        scales = (torch.rand(k // group, n, generator=generator) * 0.04 + 0.01).half()
        pack = pack_gptq if method == "gptq" else pack_awq
        prefix = name.removesuffix(".weight")
        tensors |= {f"{prefix}.{key}": value for key, value in pack(q, zeros, group).items()}
        tensors[f"{prefix}.scales"] = scales
        steps = q.view(n, k // group, group) - zeros.t()[..., None]
        dequantized[name] = (steps * scales.float().t()[..., None]).view(n, k)
    target.mkdir()
    for file in source.iterdir():
        if file.name not in ("model.safetensors", "config.json"):
            (target / file.name).write_bytes(file.read_bytes())
    config = json.loads((source / "config.json").read_text())
    qconfig = {"quant_method": method, "bits": 4, "group_size": group}
    qconfig |= {"desc_act": False, "sym": False} if method == "gptq" else {"version": "gemm", "zero_point": True}
    (target / "config.json").write_text(json.dumps(config | {"quantization_config": qconfig}))
    save_file(tensors, target / "model.safetensors")
    return dequantized


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_prequantized_checkpoint_matches_its_dequantized_reference(tiny, tmp_path, monkeypatch, method):
    from transformers import AutoModelForCausalLM

    add_tuning(monkeypatch, quantized_activations=False)  # the mapping, as above
    dequantized = make_prequantized(tiny, tmp_path / method, method)
    reference = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    reference.load_state_dict(dequantized, strict=False)
    prompts = prompt_ids(tiny)
    model = load_model(str(tmp_path / method), torch.float32, torch.device("cpu"))  # found from config.json
    assert_matches(reference, prompts, kettle_logits(model, prompts))


def test_prequantized_checkpoint_refuses_another_scheme(tiny, tmp_path):
    make_prequantized(tiny, tmp_path / "gptq", "gptq")
    with pytest.raises(ValueError, match="already gptq-quantized"):
        load_model(str(tmp_path / "gptq"), torch.float32, torch.device("cpu"), quantize="int4")
    with pytest.raises(ValueError, match="needs a awq checkpoint"):
        load_model(str(tiny), torch.float32, torch.device("cpu"), quantize="awq")


def test_unsupported_value_is_refused_by_load_model(tiny):
    with pytest.raises(ValueError, match="int4"):
        load_model(str(tiny), torch.float32, torch.device("cpu"), quantize="bitsandbytes-nf4")


def test_bundled_model_stays_near_float32_and_answers_paris_with_int4():
    from transformers import AutoTokenizer

    from kettle.hub.resolve import resolve_model

    path = str(resolve_model(None).path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = [tokenizer(p).input_ids for p in ("The capital of France is", "def fibonacci(n):\n    ")]
    reference = kettle_logits(load_model(path, torch.float32, torch.device("cpu"), dequantize=True), prompts)
    model = load_model(path, torch.float32, torch.device("cpu"), quantize="int4")
    logits = kettle_logits(model, prompts)
    kl = (reference.softmax(-1) * (reference.log_softmax(-1) - logits.log_softmax(-1))).sum(-1)
    assert float(kl.mean()) < BUNDLED_MEAN_KL
    tokens = greedy(model, prompts[:1], 6)[0]
    assert "Paris" in tokenizer.decode(tokens)
