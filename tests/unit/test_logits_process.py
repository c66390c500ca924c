"""Batched logits processors against transformers' own processors, row by row, with neutral rows in the batch."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from kettle.shard.logits_process import (
    WATERMARK_HASH_KEY,
    FrequencyPenalty,
    RepetitionPenalty,
    StepInputs,
    Temperature,
    TopK,
    TopP,
    TypicalP,
    Watermark,
)

VOCAB = 96
HISTORIES = [[3, 3, 5, 90], [], [0, 1, 2, 2, 2, 7, 7], [95, 4], [10, 11, 12, 11, 10, 3]]


@pytest.fixture
def logits() -> torch.Tensor:
    return torch.randn(len(HISTORIES), VOCAB, generator=torch.Generator().manual_seed(0)) * 4


def history_inputs() -> StepInputs:
    """HISTORIES as the sampler passes them: a [B, L] tensor padded with -1, and the real lengths."""
    width = max(len(h) for h in HISTORIES)
    padded = torch.tensor([h + [-1] * (width - len(h)) for h in HISTORIES])
    lengths = torch.tensor([len(h) for h in HISTORIES])
    return StepInputs(torch.zeros(len(HISTORIES), dtype=torch.long), padded, lengths)


def expected_rows(logits: torch.Tensor, values: list, neutral, make_reference) -> torch.Tensor:
    """Each non-neutral row through its own transformers processor; neutral rows unchanged."""
    rows = []
    for i, (value, row) in enumerate(zip(values, logits, strict=True)):
        ids = torch.tensor([HISTORIES[i]], dtype=torch.long)
        rows.append(row if value == neutral else make_reference(value)(ids, row[None].clone())[0])
    return torch.stack(rows)


def run(processor, logits: torch.Tensor, step: StepInputs | None = None) -> torch.Tensor:
    step = step or StepInputs(torch.zeros(logits.shape[0], dtype=torch.long))
    return processor(logits.clone(), step)


def test_repetition_penalty_matches_transformers(logits):
    values = [1.0, 1.3, 0.8, 1.0, 2.0]
    out = run(RepetitionPenalty.build(values, "cpu"), logits, history_inputs())
    expected = expected_rows(logits, values, 1.0, RepetitionPenaltyLogitsProcessor)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_temperature_matches_transformers(logits):
    values = [1.0, 0.5, 2.0, 1.0, 0.7]
    out = run(Temperature.build(values, "cpu"), logits)
    torch.testing.assert_close(out, expected_rows(logits, values, 1.0, TemperatureLogitsWarper), rtol=0, atol=0)


def test_top_k_matches_transformers(logits):
    values = [0, 1, 5, 0, VOCAB + 10]
    out = run(TopK.build(values, "cpu"), logits)
    torch.testing.assert_close(out, expected_rows(logits, values, 0, TopKLogitsWarper), rtol=0, atol=0)
    assert (out[2] > float("-inf")).sum() == 5


def test_top_p_matches_transformers(logits):
    values = [1.0, 0.9, 0.5, 1.0, 0.1]
    out = run(TopP.build(values, "cpu"), logits)
    torch.testing.assert_close(out, expected_rows(logits, values, 1.0, TopPLogitsWarper), rtol=0, atol=0)


def test_typical_p_matches_transformers(logits):
    values = [1.0, 0.9, 0.5, 1.0, 0.2]
    out = run(TypicalP.build(values, "cpu"), logits)
    torch.testing.assert_close(out, expected_rows(logits, values, 1.0, TypicalLogitsWarper), rtol=0, atol=0)


def test_every_row_active_takes_the_unindexed_path(logits):
    values = [0.5, 0.9, 0.95, 0.3, 0.7]
    processor = TopP.build(values, "cpu")
    assert processor.rows.index is None
    torch.testing.assert_close(run(processor, logits), expected_rows(logits, values, 1.0, TopPLogitsWarper))


def test_frequency_penalty_is_count_over_length_times_penalty(logits):
    values = [0.0, 0.5, 1.5, -1.0, 2.0]
    out = run(FrequencyPenalty.build(values, "cpu"), logits, history_inputs())
    for i, (penalty, history) in enumerate(zip(values, HISTORIES, strict=True)):
        expected = logits[i].clone()
        for token, count in Counter(history).items():
            expected[token] -= count / len(history) * penalty
        torch.testing.assert_close(out[i], expected)
    assert torch.equal(out[0], logits[0])


def test_all_neutral_builds_nothing():
    for cls in (RepetitionPenalty, Temperature, TopP, TypicalP):
        assert cls.build([1.0, 1.0], "cpu") is None
    assert FrequencyPenalty.build([0.0], "cpu") is None
    assert TopK.build([0, 0], "cpu") is None
    assert Watermark.build([False], VOCAB, "cpu", 0.5, 2.0) is None


def watermark_step(previous: list[int]) -> StepInputs:
    return StepInputs(torch.tensor(previous, dtype=torch.long))


def test_watermark_raises_green_list_by_delta():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1))
    watermark = Watermark.build([True, False, True], VOCAB, "cpu", gamma=0.25, delta=2.0)
    out = run(watermark, logits, watermark_step([7, 7, 9]))
    assert torch.equal(out[1], logits[1])
    for row in (0, 2):
        green = out[row] != logits[row]
        assert green.sum() == VOCAB // 4
        assert torch.equal(out[row][green], logits[row][green] + 2.0)


def test_watermark_green_list_follows_the_previous_token():
    logits = torch.zeros(3, VOCAB)
    watermark = Watermark.build([True, True, True], VOCAB, "cpu", gamma=0.5, delta=2.0)
    out = run(watermark, logits, watermark_step([7, 7, 9]))
    assert torch.equal(out[0], out[1])
    assert not torch.equal(out[0], out[2])
    assert torch.equal(out, run(watermark, logits, watermark_step([7, 7, 9])))
    # The definition: the first gamma × V ids of a permutation seeded with hash key × previous token.
    generator = torch.Generator().manual_seed(WATERMARK_HASH_KEY * 9)
    green = torch.randperm(VOCAB, generator=generator)[: VOCAB // 2]
    assert set(out[2].nonzero().squeeze(1).tolist()) == set(green.tolist())


def test_penalties_ignore_ids_beyond_the_scores():
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(2))
    history = torch.tensor([[VOCAB + 5, 4, -1], [VOCAB + 1, -1, -1]])
    step = StepInputs(torch.zeros(2, dtype=torch.long), history, torch.tensor([2, 1]))
    penalized = run(RepetitionPenalty.build([2.0, 2.0], "cpu"), logits, step)
    changed = (penalized != logits).nonzero().tolist()
    assert changed == [[0, 4]]
    counted = run(FrequencyPenalty.build([1.0, 1.0], "cpu"), logits, step)
    assert (counted != logits).nonzero().tolist() == [[0, 4]]
    torch.testing.assert_close(counted[0, 4], logits[0, 4] - 0.5)
