"""Multi-LoRA against transformers + peft: logits with an adapter, mixed batches, quantized bases, and the
one-line errors for adapters that do not fit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kettle.bench.drive import decode_logits, new_cache, scattered_tables, step
from kettle.models.lora_adapters import AdapterError, AdapterSource, load_adapters, read_adapter
from kettle.models.registry import load_model
from tests.fixtures import kernels_buildable, make_tiny_llama
from tests.models.engine_driver import make_batch, run_to_end

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [[5, 17, 99, 3, 42, 7, 250, 11], [9, 8, 7], [300, 301, 302, 303, 304, 305]]


def make_adapter(base: Path, out: Path, rank: int, modules: list[str], seed: int) -> Path:
    """A random PEFT LoRA adapter (B not zero, so it changes the output) saved as a checkpoint folder."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=modules, init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.05)
    peft_model.save_pretrained(out)
    return out


def peft_logits(base: Path, adapter: Path | None, ids: list[int]) -> torch.Tensor:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("lora-base"))


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "r4": make_adapter(base, root / "r4", 4, ALL_MODULES, seed=1),
        "r8": make_adapter(base, root / "r8", 8, ["q_proj", "v_proj", "down_proj"], seed=2),
    }


def kettle_model(base: Path, adapters: dict[str, Path], quantize: str | None = None):
    model = load_model(str(base), torch.float32, "cpu", quantize=quantize)
    value = ",".join(f"{name}={path}" for name, path in adapters.items())
    return model, load_adapters(value, model, world_size=1)


def kettle_logits(model, rows_adapter: list[int], prompts: list[list[int]]) -> list[torch.Tensor]:
    """One prefill of all prompts in one batch, each prompt's rows on its adapter (-1: base)."""
    tables, num_blocks = scattered_tables([len(p) for p in prompts])
    model.lora_rows.set([a for p, a in zip(prompts, rows_adapter, strict=True) for _ in p], torch.device("cpu"))
    logits, _ = step(model, new_cache(model, num_blocks), prompts, [0] * len(prompts), tables)
    return list(logits.split([len(p) for p in prompts]))


def test_logits_with_each_adapter_equal_peft(base, adapters):
    model, names = kettle_model(base, adapters)
    assert names == ("r4", "r8")
    for index, name in enumerate(names):
        got = kettle_logits(model, [index], PROMPTS[:1])[0]
        torch.testing.assert_close(got, peft_logits(base, adapters[name], PROMPTS[0]), atol=1e-4, rtol=0)
    base_logits = kettle_logits(model, [-1], PROMPTS[:1])[0]
    torch.testing.assert_close(base_logits, peft_logits(base, None, PROMPTS[0]), atol=1e-4, rtol=0)
    assert (base_logits - kettle_logits(model, [0], PROMPTS[:1])[0]).abs().max() > 1e-2  # the adapter matters


def test_a_batch_mixing_two_adapters_and_the_base_gives_each_row_its_own_logits(base, adapters):
    model, _ = kettle_model(base, adapters)
    mixed = kettle_logits(model, [0, -1, 1], PROMPTS)
    for prompt, adapter, got in zip(PROMPTS, [0, -1, 1], mixed, strict=True):
        alone = kettle_logits(model, [adapter], [prompt])[0]
        torch.testing.assert_close(got, alone, atol=1e-5, rtol=0)


def test_a_mixed_batch_generates_the_same_tokens_as_each_request_alone(base, adapters):
    from kettle.proto import generate_pb2 as pb
    from kettle.shard.config import ShardConfig
    from kettle.shard.server import build_engine

    value = ",".join(f"{name}={path}" for name, path in adapters.items())
    engine, _ = build_engine(ShardConfig(model_path=str(base), dtype="float32", lora_adapters=value))
    warm = pb.WarmupRequest(max_input_tokens=64, max_prefill_tokens=128, max_total_tokens=128)
    warm.batch.requests.add(id=0, input_ids=[1, 2, 3]).stopping_parameters.max_new_tokens = 1
    engine.warmup(warm)
    batch = make_batch(1, PROMPTS, 10, 10)
    for request, adapter in zip(batch.requests, ["r4", "", "r8"], strict=True):
        request.adapter_id = adapter
    together = run_to_end(engine, batch)
    for i, adapter in enumerate(["r4", "", "r8"]):
        alone = make_batch(2 + i, [PROMPTS[i]], 100 + 10 * i, 10)
        alone.requests[0].adapter_id = adapter
        assert run_to_end(engine, alone)[100 + 10 * i] == together[10 + i]
    assert together[10] != together[11] or together[12] != together[11]  # adapters change the generation


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_adapters_over_quantized_base_weights(base, adapters, quantize):
    """On an int8/int4 base, each projection adds exactly the adapter's delta (from the checkpoint's own A and
    B) to the quantized output, and a mixed batch still gives each row what it gets alone."""
    model, _ = kettle_model(base, adapters, quantize)
    adapter = read_adapter("r4", adapters["r4"])
    qkv = model.layers[1].attn.qkv
    x = torch.randn(5, model.spec.hidden_size)
    model.lora_rows.set([-1] * 5, torch.device("cpu"))
    plain = qkv(x)
    model.lora_rows.set([0] * 5, torch.device("cpu"))
    with_adapter = qkv(x)
    for (column, width), module in zip(qkv.slices, ["q_proj", "k_proj", "v_proj"], strict=True):
        a, b = adapter.a[(1, module)], adapter.b[(1, module)]
        expected = adapter.scale * (x @ a.t()) @ b.t()
        got = (with_adapter - plain)[:, column : column + width]
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    # The quantized kernels pick their path by row count (int16 rows below 8, float32 tiles from 8, int16 rows on
    # the integer panels from 16 with AVX-512 VNNI), so a 17-row batch and a 9-row one round differently in the
    # base model itself, and a last-bit change in a delta can move an activation's rounding: far below what an
    # adapter changes (~1).
    atol = 5e-3
    mixed = kettle_logits(model, [0, -1, 1], PROMPTS)
    for prompt, index, got in zip(PROMPTS, [0, -1, 1], mixed, strict=True):
        torch.testing.assert_close(got, kettle_logits(model, [index], [prompt])[0], atol=atol, rtol=0)


def test_adapters_that_do_not_fit_get_one_line_errors(base, adapters, tmp_path):
    model = load_model(str(base), torch.float32, "cpu")
    with pytest.raises(AdapterError, match=r"adapter `x`: no adapter_config\.json"):
        read_adapter("x", tmp_path)
    bad = tmp_path / "bad"
    bad.mkdir()
    config = json.loads((adapters["r4"] / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps(config | {"r": 16}))
    (bad / "adapter_model.safetensors").write_bytes((adapters["r4"] / "adapter_model.safetensors").read_bytes())
    with pytest.raises(AdapterError, match=r"adapter `bad`, layers\.0\.\w+_proj: lora_A \(4, 64\)") as error:
        load_adapters(f"bad={bad}", model, world_size=1)
    assert "\n" not in str(error.value)
    with pytest.raises(AdapterError, match="tensor parallelism"):
        load_adapters(f"a={adapters['r4']}", model, world_size=2)
    with pytest.raises(AdapterError, match="names an adapter twice"):
        AdapterSource.parse_list("a=/x,a=/y")
    assert AdapterSource.parse_list("a=/x, org/b") == [AdapterSource("a", "/x"), AdapterSource("org/b", "org/b")]


def lora_decode(model, rows_adapter: list[int], fused: bool, steps: int = 6) -> torch.Tensor:
    """PROMPTS prefilled (each on its row's adapter), then `steps` greedy decode steps of all three together,
    through the fused CPU decode step or layer by layer; the logits of every decode step [steps, 3, V]."""
    return decode_logits(model, PROMPTS, fused, steps, adapters=rows_adapter)


@pytest.mark.skipif(not kernels_buildable(), reason="the one-call step is Kettle's CPU kernels'")
@pytest.mark.parametrize("quantize, atol", [(None, 1e-4), ("int4", 3e-3)])
def test_the_fused_cpu_step_adds_each_rows_adapter(base, adapters, monkeypatch, quantize, atol):
    """Decode steps mixing two adapters and the base model run in the one-call CPU step (float32 weights stored
    dense, or int4) and give the layer-by-layer forward's logits (which equal peft's, above): the step's LoRA
    stage masks every row to its own adapter and writes each B row only into its slice of q|k|v or gate|up."""
    monkeypatch.setenv("KETTLE_TUNING", "cpu-linear=dense")
    model, _ = kettle_model(base, adapters, quantize)
    assert model.cpu_decoder_step is not None
    fused, reference = lora_decode(model, [0, -1, 1], fused=True), lora_decode(model, [0, -1, 1], fused=False)
    torch.testing.assert_close(fused, reference, atol=atol, rtol=0)
    assert torch.equal(fused.argmax(-1), reference.argmax(-1))
    plain = lora_decode(model, [-1, -1, -1], fused=True)
    assert (plain[:, 0] - fused[:, 0]).abs().max() > 1e-2  # the adapters change the fused step's output
