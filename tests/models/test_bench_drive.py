"""The benchmarks' loops over the offline driver run what the shard runs: a decode loop and a prefill loop choose
the greedy tokens of the tests' own greedy decoding, and the engine loop counts every generated token."""

from __future__ import annotations

import torch

from kettle.bench.drive import DecodeLoop, PrefillLoop, engine_run, greedy, shard_engine
from kettle.models.registry import load_model


def test_decode_loop_chooses_the_greedy_tokens(tiny_llama_path) -> None:
    model = load_model(str(tiny_llama_path), torch.float32, "cpu")
    loop = DecodeLoop(model, batch=2, context=7, steps=5, kv_dtype=torch.float32, seed=3)
    for _ in range(5):
        loop()
    prompts = torch.randint(0, model.spec.vocab_size, (2 * 7,), generator=torch.Generator().manual_seed(3))
    expected = greedy(model, [prompts[:7].tolist(), prompts[7:].tolist()], 6)
    assert loop.tokens().tolist() == expected


def test_prefill_loop_in_chunks_gives_the_first_greedy_token(tiny_llama_path) -> None:
    model = load_model(str(tiny_llama_path), torch.float32, "cpu")
    ids = torch.arange(5, 45)
    (first,) = greedy(model, [ids.tolist()], 1)
    assert PrefillLoop(model, ids)() == first[0]
    assert PrefillLoop(model, ids, chunk=16)() == first[0]


def test_engine_run_counts_the_tokens_after_each_first(tiny_llama_path) -> None:
    engine = shard_engine(str(tiny_llama_path), 256, dtype="float32")
    run = engine_run(engine, [[5, 6, 7], [8, 9, 10, 11, 12]], 9, max_steps=4, ignore_eos=True)
    assert run.first_tokens == 2 and run.tokens == 2 * 8
    assert run.decode_rate > 0
