"""Token choice: greedy argmax, seeded sampling independent of the batch, logprobs, top tokens."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from transformers import TemperatureLogitsWarper, TopKLogitsWarper

from kettle.proto import generate_pb2
from kettle.shard.sampling import BatchSampler, SamplingParams, top_tokens

VOCAB = 80
GREEDY = SamplingParams()
RICH = SamplingParams(do_sample=True, temperature=0.8, top_k=30, top_p=0.9, repetition_penalty=1.3, seed=42)


def generators(seeds: list[int]) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(s) for s in seeds]


def random_logits(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_from_proto_maps_zero_values_to_neutral():
    unset = SamplingParams.from_proto(generate_pb2.NextTokenChooserParameters())
    assert unset == SamplingParams()
    assert not unset.sampling
    proto = generate_pb2.NextTokenChooserParameters(temperature=0.5, top_k=3, seed=7, frequency_penalty=0.25)
    assert SamplingParams.from_proto(proto) == SamplingParams(temperature=0.5, top_k=3, seed=7, frequency_penalty=0.25)


def test_warpers_imply_sampling():
    assert SamplingParams(temperature=0.7).sampling
    assert SamplingParams(top_k=5).sampling
    assert SamplingParams(top_p=0.9).sampling
    assert SamplingParams(typical_p=0.9).sampling
    assert not SamplingParams(repetition_penalty=1.2, frequency_penalty=0.5, watermark=True).sampling


def test_needs_history_only_with_penalties():
    assert not BatchSampler([GREEDY, SamplingParams(top_k=4)], generators([0, 0]), VOCAB, "cpu").needs_history
    assert BatchSampler([GREEDY, SamplingParams(frequency_penalty=0.1)], generators([0, 0]), VOCAB, "cpu").needs_history


def test_greedy_is_argmax_and_logprobs_are_log_softmax():
    logits = random_logits(4, 0)
    out = BatchSampler([GREEDY] * 4, generators([0] * 4), VOCAB, "cpu")(logits.clone(), None, None, torch.zeros(4))
    assert torch.equal(out.next_ids, logits.argmax(dim=-1))
    torch.testing.assert_close(out.logprobs, torch.log_softmax(logits, dim=-1))
    torch.testing.assert_close(out.chosen_logprobs, out.logprobs.max(dim=-1).values)


def test_logprobs_are_of_the_processed_scores():
    logits = random_logits(2, 1)
    params = [SamplingParams(temperature=0.5, top_k=3), GREEDY]
    out = BatchSampler(params, generators([1, 2]), VOCAB, "cpu")(logits.clone(), None, None, torch.zeros(2))
    warped = TopKLogitsWarper(3)(None, TemperatureLogitsWarper(0.5)(None, logits[:1]))
    torch.testing.assert_close(out.logprobs[0], torch.log_softmax(warped[0], dim=-1))
    assert (out.logprobs[0] > -math.inf).sum() == 3
    assert out.logprobs[0, out.next_ids[0]] > -math.inf
    torch.testing.assert_close(out.logprobs[1], torch.log_softmax(logits[1], dim=-1))


def test_padded_vocabulary_columns_are_never_chosen():
    logits = random_logits(1, 2)
    logits[0, VOCAB - 8 :] = 100.0
    out = BatchSampler([GREEDY], generators([0]), VOCAB - 8, "cpu")(logits, None, None, torch.zeros(1))
    assert out.next_ids.item() < VOCAB - 8
    assert out.logprobs.shape == (1, VOCAB - 8)


def generate(params: list[SamplingParams], row: int, steps: int = 20) -> list[int]:
    """`steps` tokens for `row`, whose logits at step t are the same whatever the batch around it."""
    prompt = [5, 6, 7]
    histories = [list(prompt) for _ in params]
    sampler = BatchSampler(params, generators([p.seed for p in params]), VOCAB, "cpu")
    for t in range(steps):
        logits = random_logits(len(params), 1000 + t)
        logits[row] = random_logits(1, t)[0]
        width = max(len(h) for h in histories)
        history = torch.tensor([h + [-1] * (width - len(h)) for h in histories])
        lengths = torch.tensor([len(h) for h in histories])
        last = torch.tensor([h[-1] for h in histories])
        chosen = sampler(logits, history, lengths, last).next_ids.tolist()
        for h, token in zip(histories, chosen, strict=True):
            h.append(token)
    return histories[row][len(prompt) :]


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch():
    alone = generate([RICH], row=0)
    others = [GREEDY, SamplingParams(do_sample=True, seed=7, watermark=True), SamplingParams(frequency_penalty=1.0)]
    in_batch = generate([others[0], others[1], RICH, others[2]], row=2)
    assert alone == generate([RICH], row=0)
    assert alone == in_batch
    assert len(set(alone)) > 3  # it really sampled
    assert alone != generate([replace(RICH, seed=43)], row=0)


def test_sampling_follows_the_distribution_and_skips_filtered_tokens():
    logits = torch.full((1, VOCAB), -math.inf)
    logits[0, [3, 10, 40]] = torch.tensor([0.2, 0.3, 0.5]).log()
    sampler = BatchSampler([SamplingParams(do_sample=True)], generators([0]), VOCAB, "cpu")
    draws = [sampler(logits.clone(), None, None, torch.zeros(1)).next_ids.item() for _ in range(3000)]
    assert set(draws) == {3, 10, 40}
    for token, share in ((3, 0.2), (10, 0.3), (40, 0.5)):
        assert abs(draws.count(token) / len(draws) - share) < 0.03


def test_grammar_mask_applies_before_warpers():
    logits = random_logits(1, 3)
    mask = torch.zeros(1, VOCAB, dtype=torch.bool)
    mask[0, [4, 9]] = True
    out = BatchSampler([GREEDY], generators([0]), VOCAB, "cpu")(logits, None, None, torch.zeros(1), token_mask=mask)
    assert out.next_ids.item() in (4, 9)
    assert (out.logprobs > -math.inf).sum() == 2


def test_top_tokens_include_ties_at_the_nth_value():
    logprobs = torch.full((3, 10), -5.0)
    logprobs[0, [2, 4, 6, 8]] = torch.tensor([-1.0, -2.0, -2.0, -2.0])
    logprobs[1, :3] = torch.tensor([-0.5, -math.inf, -0.7])
    logprobs[1, 3:] = -math.inf
    result = top_tokens(logprobs, [2, 4, 0])
    ids, values = result[0]
    assert ids[0] == 2 and sorted(ids[1:]) == [4, 6, 8]
    assert values == [-1.0, -2.0, -2.0, -2.0]
    assert result[1] == ([0, 2], [-0.5, as_float32(-0.7)])
    assert result[2] == ([], [])


def test_top_tokens_nothing_asked():
    assert top_tokens(torch.zeros(2, 5), [0, 0]) == [([], []), ([], [])]


def as_float32(value: float) -> float:
    """The float32 value as it comes back from the tensor."""
    return torch.tensor(value, dtype=torch.float32).item()


def test_greedy_batches_take_the_kernel_and_match_the_pytorch_path(monkeypatch):
    """An all-greedy batch on the CPU chooses through `ops.greedy` (no [B, V] log-softmax until top tokens ask
    for it); ids and chosen logprobs are the PyTorch path's."""
    from kettle.kernels import ops

    if not ops.available():
        pytest.skip("the CPU kernels do not build here")
    logits = random_logits(3, 5)
    sampler = BatchSampler([GREEDY] * 3, generators([0] * 3), VOCAB, "cpu")
    fast = sampler(logits.clone(), None, None, torch.zeros(3))
    assert fast._logprobs is None
    monkeypatch.setattr(ops, "greedy_fits", lambda scores: False)
    slow = sampler(logits.clone(), None, None, torch.zeros(3))
    assert torch.equal(fast.next_ids, slow.next_ids)
    torch.testing.assert_close(fast.chosen_logprobs, slow.chosen_logprobs)
    torch.testing.assert_close(fast.logprobs, slow.logprobs)
