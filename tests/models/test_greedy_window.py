"""Greedy windows (kettle/shard/greedy_window.py): several greedy decode steps in one C call give the tokens,
logprobs and K/V of the same steps run one at a time.

On the model: tiny GGUF Llamas (Q4_0 layers with the tied Q8_0 embedding as head, as the bundled model has; Q8_0
layers and head with a float32, a Q4_0 or a Q5_0 (int8) embedding) and a tiny Llama under `--quantize int4` (an
int8 head), three sequences over scattered blocks of 4 tokens, windows crossing block boundaries, against single
forward + LM head + greedy choice steps; an EOS id ends the window after the step that chose it; and the first of
them with its layers on two RoPE tables (Gemma 3's layout), each step's cos/sin of both. On the bundled
model's engine: Decode calls of up to 8 steps against the same steps called one at a time, through a stop string
and EOS inside a window, a length that is no multiple of the window and a sampled request joining (which takes
single steps), with and without `--speculate`.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T

from kettle.bench.drive import BLOCK_SIZE, new_cache, scattered_tables, step
from kettle.kernels import ops
from kettle.layers.attention import AttentionMetadata
from kettle.layers.rotary import RotaryEmbedding
from kettle.models.registry import load_model
from kettle.proto import generate_pb2 as pb
from kettle.quantization.int8 import Int8Linear
from kettle.shard.batch import RequestState
from kettle.shard.greedy_window import window_steps
from kettle.shard.sampling import SamplingParams, greedy_choice
from kettle.shard.stopping import StoppingCriteria
from tests.fixtures import make_tiny_llama
from tests.gguf_files import tiny_model, write_gguf
from tests.models.engine_driver import make_batch

pytestmark = pytest.mark.skipif(not ops.available(), reason="the greedy window runs on Kettle's CPU kernels")

PROMPTS = [[1, 5, 9, 33, 2, 70, 41], [3, 4, 88, 12], [60, 61, 62, 7, 7, 30, 11, 95, 20]]
STEPS = 9


def two_tables(model):
    """`model` with its second layer on a RoPE table of its own (another base, linearly scaled), as Gemma 3's full
    layers are (`CausalLM.layer_rotary`)."""
    rotary, spec = model.rotary, model.spec
    params = {"rope_type": "linear", "factor": 4.0, "rope_theta": 100.0}
    options = {"rotary_dim": rotary.rotary_dim, "interleaved": rotary.interleaved}
    other = RotaryEmbedding(spec.head_dim, params, spec.max_position_embeddings, torch.float32, "cpu", **options)
    model.layer_rotary = [rotary, other]
    model.__dict__.pop("cpu_decoder_step", None)  # described again, with both tables
    return model


@pytest.fixture(
    scope="module",
    params=["tied Q8_0 head", "float32 embedding", "4-bit embedding", "int8 embedding", "int8 head", "two RoPE tables"],
)
def gguf_model(request, tmp_path_factory):
    """The model each window runs on: its fused step, embedding and head kind as named."""
    folder = tmp_path_factory.mktemp("model")
    if request.param == "two RoPE tables":
        reference = tiny_model("llama", 64, tie_word_embeddings=True)
        return two_tables(
            load_model(write_gguf(reference, folder, "llama", T.Q4_0, embedding=T.Q8_0), torch.float32, "cpu")
        )
    if request.param == "int8 head":  # `--quantize int4` of a safetensors checkpoint: an int8 head
        model = load_model(make_tiny_llama(folder), torch.float32, "cpu", quantize="int4")
        assert isinstance(model.lm_head, Int8Linear)
        return model
    layers, embedding, tied = {
        "tied Q8_0 head": (T.Q4_0, T.Q8_0, True),
        "float32 embedding": (T.Q8_0, T.F32, False),
        "4-bit embedding": (T.Q8_0, T.Q4_0, False),  # an untied table kept in its Q4_0 blocks
        "int8 embedding": (T.Q8_0, T.Q5_0, False),  # an untied Q5_0 table held in int8 per row
    }[request.param]
    reference = tiny_model("llama", 64, tie_word_embeddings=tied)
    return load_model(write_gguf(reference, folder, "llama", layers, embedding=embedding), torch.float32, "cpu")


def prefilled(model):
    """A cache with PROMPTS prefilled over scattered tables; the tables and each prompt's first choice."""
    tables, num_blocks = scattered_tables([len(p) + STEPS + 1 for p in PROMPTS])
    cache = new_cache(model, num_blocks, torch.float16)
    logits, meta = step(model, cache, PROMPTS, [0] * len(PROMPTS), tables)
    return cache, tables, greedy_choice(logits[meta.last_token_indices])[0]


def single_steps(model, steps: int):
    """`steps` decode steps one forward each: ids and logprobs [steps, S], and the cache."""
    cache, tables, tokens = prefilled(model)
    ids, logprobs = [], []
    for s in range(steps):
        lens = [len(p) + s for p in PROMPTS]
        meta = AttentionMetadata.build([1] * len(PROMPTS), lens, tables, BLOCK_SIZE, "cpu")
        hidden = model.forward(tokens, meta.positions, cache, meta)
        tokens, chosen = greedy_choice(model.compute_logits(hidden))
        ids.append(tokens)
        logprobs.append(chosen)
    return torch.stack(ids), torch.stack(logprobs), cache


def window(model, steps: int, stop_ids: list[int]):
    cache, tables, tokens = prefilled(model)
    last = [len(p) + steps - 1 for p in PROMPTS]
    meta = AttentionMetadata.build([1] * len(PROMPTS), last, tables, BLOCK_SIZE, "cpu")
    ids, logprobs = model.greedy_steps(tokens, cache, meta, steps, torch.tensor(stop_ids, dtype=torch.long))
    return ids, logprobs, cache


def test_a_window_gives_the_tokens_logprobs_and_cache_of_single_steps(gguf_model):
    ids, logprobs, cache = single_steps(gguf_model, STEPS)
    window_ids, window_logprobs, window_cache = window(gguf_model, STEPS, [])
    assert torch.equal(window_ids, ids)
    assert torch.equal(window_logprobs, logprobs)
    for ours, theirs in zip(window_cache.k + window_cache.v, cache.k + cache.v, strict=True):
        assert torch.equal(ours, theirs)


def test_a_window_ends_after_the_step_that_chose_a_stop_id(gguf_model):
    ids, logprobs, _ = single_steps(gguf_model, STEPS)
    stop = ids[4, 1].item()  # chosen by the second sequence at the fifth step (maybe earlier too)
    first = min(s for s in range(STEPS) if stop in ids[s].tolist())
    window_ids, window_logprobs, _ = window(gguf_model, STEPS, [stop, 10**6])
    assert torch.equal(window_ids, ids[: first + 1])
    assert torch.equal(window_logprobs, logprobs[: first + 1])


def test_a_window_rotates_each_layer_with_its_own_table(tmp_path):
    """Both tables reach the C loop (which the "two RoPE tables" cases above hold to single steps): the window over
    the model with two tables gives other logprobs than over the same model on one table."""
    reference = tiny_model("llama", 64, tie_word_embeddings=True)
    path = write_gguf(reference, tmp_path, "llama", T.Q4_0, embedding=T.Q8_0)
    model = two_tables(load_model(path, torch.float32, "cpu"))
    assert model.cpu_decoder_step.decoder.rope_tables == 2
    _, logprobs, _ = window(model, STEPS, [])
    _, one_table, _ = window(load_model(path, torch.float32, "cpu"), STEPS, [])
    assert not torch.allclose(logprobs, one_table, atol=1e-3)


def test_a_head_wider_than_the_embedding_table_takes_no_window(tmp_path):
    """The loop embeds the ids it chose: a padded head's extra columns have no row to read."""
    from kettle.models.decoder_step import _embedding_and_head

    reference = tiny_model("llama", 64, tie_word_embeddings=False)
    model = load_model(write_gguf(reference, tmp_path, "llama", T.Q8_0, embedding=T.F32), torch.float32, "cpu")
    assert _embedding_and_head(model) is not None
    model.embed_tokens = model.embed_tokens[:-8].clone()
    assert _embedding_and_head(model) is None


def request_state(**params) -> RequestState:
    stopping = StoppingCriteria([0], [], max_new_tokens=20)
    stopping.current_tokens = 5
    return RequestState(
        id=1,
        all_ids=list(range(12)),
        prompt_len=7,
        cache_len=11,
        chunk_len=0,
        blocks=[1, 2, 3, 4],  # 64 tokens of room at blocks of 16
        params=SamplingParams(**params),
        generator=torch.Generator(),
        stopping=stopping,
        detokenizer=None,
        top_n_tokens=0,
        prefill_logprobs=False,
    )


def test_window_steps_take_greedy_requests_within_their_length_and_blocks():
    plain = request_state()
    assert window_steps([plain], 8, 16) == 8
    assert window_steps([plain], 30, 16) == 15  # max_new_tokens 20, 5 generated
    assert window_steps([plain], 30, 4) == 5  # 16 slots, 11 in the cache
    for needs_host in (
        request_state(do_sample=True, seed=1),
        request_state(temperature=0.5),
        request_state(repetition_penalty=1.2),
        request_state(watermark=True),
    ):
        assert window_steps([plain, needs_host], 8, 16) == 0
    for field, value in (("grammar", object()), ("top_n_tokens", 2), ("adapter", 0)):
        other = request_state()
        setattr(other, field, value)
        assert window_steps([plain, other], 8, 16) == 0
    prefilling = request_state()
    prefilling.cache_len = 5  # of a 7-token prompt
    assert window_steps([prefilling], 8, 16) == 0


@pytest.fixture(scope="module")
def bundled_engine():
    from kettle.hub.resolve import resolve_model
    from kettle.shard.config import ShardConfig
    from kettle.shard.server import build_engine

    path = resolve_model(None).path
    engine, _ = build_engine(ShardConfig(model_path=str(path)))  # served as `make serve` serves it: int4
    warm = pb.WarmupRequest(max_input_tokens=200, max_prefill_tokens=256, max_total_tokens=256)
    warm.batch.requests.add(id=0, input_ids=[1, 2, 3]).stopping_parameters.max_new_tokens = 1
    engine.warmup(warm)
    from transformers import AutoTokenizer

    return engine, AutoTokenizer.from_pretrained(path)


def run_script(engine, tokenizer, steps: list[int], stop: str, then: int = 8) -> tuple[dict, list[int]]:
    """Three greedy requests (EOS on, a stop string, a length of 13), decode calls of `steps` steps (a negative
    count: that many calls of one step; `then` once the list is used up), a sampled request joining after the
    first call; every request's tokens, logprobs, texts and end, and each decode call's step count."""
    prompts = [tokenizer(p).input_ids for p in ("Write a poem about tea.", "List three colours:", "Hi")]
    batch = make_batch(1, prompts, first_id=1, max_new_tokens=40)
    batch.requests[0].stopping_parameters.ignore_eos_token = False
    batch.requests[1].stopping_parameters.stop_sequences.append(stop)
    batch.requests[2].stopping_parameters.max_new_tokens = 13
    outputs: dict[int, dict] = {}
    counts: list[int] = []

    def call(method: str, request):
        answer = getattr(engine, method)(request)
        for g in answer.generations:
            out = outputs.setdefault(g.request_id, {"ids": [], "logprobs": [], "texts": []})
            out["ids"] += g.tokens.ids
            out["logprobs"] += g.tokens.logprobs
            out["texts"] += g.tokens.texts
            if g.HasField("generated_text"):
                out["end"] = (g.generated_text.text, g.generated_text.finish_reason)
        if method == "decode":
            counts.append(answer.steps)
        return answer

    def decode(cached, n):
        if n > 0:
            return call("decode", pb.DecodeRequest(batches=[cached], max_steps=n))
        for _ in range(-n):
            answer = call("decode", pb.DecodeRequest(batches=[cached]))
            if not answer.HasField("batch"):
                break
            cached = answer.batch
        return answer

    schedule = iter(steps)
    answer = decode(call("prefill", pb.PrefillRequest(batch=batch)).batch, next(schedule, then))
    joining = make_batch(2, [tokenizer("Tea is").input_ids], first_id=9, max_new_tokens=6)
    joining.requests[0].parameters.do_sample, joining.requests[0].parameters.seed = True, 5
    answer = call("prefill", pb.PrefillRequest(batch=joining, cached_batch=answer.batch))
    while answer.HasField("batch"):
        answer = decode(answer.batch, next(schedule, then))
    return outputs, counts


@pytest.mark.parametrize("speculate", [0, 4])
def test_windowed_decode_calls_give_the_outputs_of_single_steps(bundled_engine, monkeypatch, speculate):
    """With `--speculate`, steps with a draft worth verifying are speculative steps and the others windows."""
    engine, tokenizer = bundled_engine
    monkeypatch.setattr(engine.runner, "speculate", speculate)
    windows: list[int] = []
    greedy_steps = engine.runner.model.greedy_steps

    def spy(tokens, cache, meta, steps, stop_ids):
        chosen = greedy_steps(tokens, cache, meta, steps, stop_ids)
        windows.append(chosen[0].shape[0])
        return chosen

    monkeypatch.setattr(engine.runner.model, "greedy_steps", spy)
    # A stop string the second request meets mid-way: a piece of its own output.
    probe, _ = run_script(engine, tokenizer, [], stop="\u0000", then=-1)
    stop = next(t for t in probe[2]["texts"][9:] if t.strip())
    assert not windows  # one step per call: no window
    windowed, counts = run_script(engine, tokenizer, [], stop=stop)
    replayed, _ = run_script(engine, tokenizer, [-n for n in counts], stop=stop, then=-1)
    assert windowed == replayed
    assert windowed[2]["end"][1] == pb.FINISH_REASON_STOP_SEQUENCE
    assert {out["end"][1] for out in windowed.values()} >= {pb.FINISH_REASON_LENGTH}
    assert max(windows) > 1 and max(counts) > 1
    assert not engine.batches
