"""The transformers fallback (a causal model with no native implementation: GPT-Neo) against transformers."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kettle.models.registry import ARCHITECTURES, load_model
from kettle.proto import generate_pb2 as pb
from kettle.shard.fallback_runner import FallbackRunner
from tests.models.engine_driver import join_mid_batch, make_batch, run_to_end, warm_engine
from tests.models.fallback_helpers import PROMPTS, make_tiny_gpt_neo

NEW_TOKENS = 10


@pytest.fixture(scope="module")
def neo_path(tmp_path_factory):
    return make_tiny_gpt_neo(tmp_path_factory.mktemp("gpt_neo"))


@pytest.fixture(scope="module")
def served(neo_path):
    return warm_engine(neo_path)


@pytest.fixture(scope="module")
def hf(neo_path):
    tokenizer = AutoTokenizer.from_pretrained(neo_path)
    model = AutoModelForCausalLM.from_pretrained(neo_path, dtype=torch.float32).eval()
    return tokenizer, model


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
        )
    return out[0, len(ids) :].tolist()


def test_gpt_neo_has_no_native_implementation_and_is_served_by_transformers(served):
    engine, info = served
    assert "gpt_neo" not in ARCHITECTURES  # if a native GPT-Neo lands, pick another type for these tests
    assert info.execution_path == "transformers"
    assert info.requires_padding
    assert isinstance(engine.runner, FallbackRunner) and engine.runner.padding


def test_batched_greedy_equals_transformers(served, hf):
    engine, _ = served
    tokenizer, model = hf
    prompts = [tokenizer(p).input_ids for p in PROMPTS]
    tokens = run_to_end(engine, make_batch(1, prompts, first_id=1, max_new_tokens=NEW_TOKENS))
    for i, ids in enumerate(prompts):
        assert tokens[1 + i] == hf_greedy(model, ids, NEW_TOKENS), PROMPTS[i]
    assert not engine.runner._own and engine.runner._padded is None  # finished requests dropped their K/V


def test_prompt_logprobs_of_a_padded_batch_match_transformers(served, hf):
    """Every prompt position's logits (as logprobs), three lengths padded into one forward."""
    engine, _ = served
    tokenizer, model = hf
    prompts = [tokenizer(p).input_ids for p in PROMPTS]
    batch = make_batch(2, prompts, first_id=10, max_new_tokens=1, prefill_logprobs=True)
    generations = engine.prefill(pb.PrefillRequest(batch=batch)).generations
    for generation, ids in zip(generations, prompts, strict=True):
        values = list(generation.prefill_tokens.logprobs)
        assert list(generation.prefill_tokens.ids) == ids and math.isnan(values[0])
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0]
        expected = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
        torch.testing.assert_close(torch.tensor(values[1:]), expected, atol=1e-4, rtol=0)


def test_request_joining_a_running_batch(served, hf):
    engine, _ = served
    tokenizer, model = hf
    a, b = (tokenizer(p).input_ids for p in PROMPTS[1:])
    tokens = join_mid_batch(engine, a, b, NEW_TOKENS, base_id=20)
    assert tokens[20] == hf_greedy(model, a, NEW_TOKENS)
    assert tokens[21] == hf_greedy(model, b, NEW_TOKENS)


def test_filtered_requests_drop_their_state(served, hf):
    engine, _ = served
    tokenizer, _model = hf
    prompts = [tokenizer(p).input_ids for p in PROMPTS]
    engine.prefill(pb.PrefillRequest(batch=make_batch(3, prompts, first_id=30, max_new_tokens=6)))
    kept = engine.filter_batch(pb.FilterBatchRequest(batch_id=3, request_ids=[31])).batch
    assert set(engine.runner._own) | set(engine.runner._padded.ids if engine.runner._padded else ()) == {31}
    decoded = engine.decode(pb.DecodeRequest(batches=[kept]))
    assert [g.request_id for g in decoded.generations] == [31]
    engine.clear_cache(pb.ClearCacheRequest())
    assert not engine.runner._own and engine.runner._padded is None


@pytest.mark.parametrize("padding", ["on", "off"])
def test_local_attention_in_padded_and_per_request_modes(tmp_path, monkeypatch, padding):
    """A local-window layer (position-indexed mask) stays exact under left padding; KETTLE_TUNING=fallback-padding=off
    (one request per forward) gives the same tokens."""
    monkeypatch.setenv("KETTLE_TUNING", f"fallback-padding={padding}")
    path = make_tiny_gpt_neo(tmp_path, local_window=4)
    engine, _ = warm_engine(path)
    assert engine.runner.padding == (padding == "on")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [tokenizer(p).input_ids for p in PROMPTS[1:]]
    tokens = join_mid_batch(engine, prompts[0], prompts[1], 8, base_id=40)
    assert tokens[40] == hf_greedy(model, prompts[0], 8)
    assert tokens[41] == hf_greedy(model, prompts[1], 8)


def test_model_type_unknown_to_transformers_is_refused_by_name(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "not-a-real-family", "hidden_size": 8}')
    with pytest.raises(ValueError, match=r"'not-a-real-family'.*unknown to transformers"):
        load_model(str(tmp_path), torch.float32, "cpu")


def test_custom_code_needs_trust_remote_code(tmp_path):
    config = '{"model_type": "my-custom", "auto_map": {"AutoConfig": "configuration_my.MyConfig"}}'
    (tmp_path / "config.json").write_text(config)
    with pytest.raises(ValueError, match="pass --trust-remote-code"):
        load_model(str(tmp_path), torch.float32, "cpu")


CUSTOM_CONFIG = """from transformers import GPTNeoConfig


class MyNeoConfig(GPTNeoConfig):
    model_type = "my-neo"
"""
CUSTOM_MODEL = """from transformers import GPTNeoForCausalLM

from .configuration_my import MyNeoConfig


class MyNeoForCausalLM(GPTNeoForCausalLM):
    config_class = MyNeoConfig
"""


def test_custom_code_runs_with_trust_remote_code(neo_path, tmp_path, monkeypatch):
    """A model whose type only its own code knows (auto_map) loads through the fallback once trusted."""
    import json
    import shutil

    from transformers import dynamic_module_utils

    # transformers copies the model's code into its modules cache: keep that inside the test's folder.
    monkeypatch.setattr(dynamic_module_utils, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    folder = tmp_path / "custom"
    shutil.copytree(neo_path, folder)
    (folder / "configuration_my.py").write_text(CUSTOM_CONFIG)
    (folder / "modeling_my.py").write_text(CUSTOM_MODEL)
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "my-neo"
    config["auto_map"] = {
        "AutoConfig": "configuration_my.MyNeoConfig",
        "AutoModelForCausalLM": "modeling_my.MyNeoForCausalLM",
    }
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="pass --trust-remote-code"):
        load_model(str(folder), torch.float32, "cpu")
    model = load_model(str(folder), torch.float32, "cpu", trust_remote_code=True)
    assert model.execution_path == "transformers" and type(model.model).__name__ == "MyNeoForCausalLM"


def test_a_prefix_found_in_the_routers_cache_is_recomputed(served, hf):
    """The router may report a cached prefix (cache_len > 0): its paged blocks mean nothing to transformers'
    cache, so the fallback computes the whole prompt and still matches transformers."""
    engine, _ = served
    tokenizer, model = hf
    ids = tokenizer(PROMPTS[2]).input_ids
    batch = make_batch(5, [ids], first_id=50, max_new_tokens=6)
    batch.requests[0].cache_len = 16
    assert run_to_end(engine, batch)[50] == hf_greedy(model, ids, 6)
