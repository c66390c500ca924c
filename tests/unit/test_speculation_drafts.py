"""Who drafts how much under `--speculate`: the n-gram lookup (longest match first, from the minimum n-gram), the
acceptance estimate and the step's choice of draft lengths (drafts that pay for their rows)."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

from kettle.kernels import ops
from kettle.shard.ngram import NgramDrafter
from kettle.shard.speculation import CPU_LANES_STEP_ROWS, CPU_STEP_ROWS, GPU_STEP_ROWS, drafts_for, step_rows

# A context that repeats itself: every suffix of COPY has a match, and what follows it is the copy.
PASSAGE = list(range(100, 140))
COPY = PASSAGE + PASSAGE[:10]


@dataclass
class Request:
    """The fields of `RequestState` that drafting reads."""

    all_ids: list[int]
    drafter: NgramDrafter | None = field(default_factory=lambda: NgramDrafter(2))
    in_prefill: bool = False
    max_new_tokens: int = 1000

    def next_query(self) -> list[int]:
        return self.all_ids[-1:]

    @property
    def stopping(self) -> SimpleNamespace:
        return SimpleNamespace(max_new_tokens=self.max_new_tokens, current_tokens=0)


def copying(request: Request) -> Request:
    """`request` with a record of drafts accepted whole over its last 40 tokens."""
    end = len(request.all_ids)
    for position in range(end - 40, end, 4):
        request.drafter.record(position, 4, 4)
    return request


def failing(request: Request) -> Request:
    """`request` with a record of drafts rejected at once over its last 10 tokens."""
    end = len(request.all_ids)
    for position in range(end - 10, end):
        request.drafter.record(position, 1, 0)
    return request


def test_the_longest_match_wins_over_a_later_shorter_one():
    ids = [4, 1, 2, 3, 9, 5, 1, 2, 3, 7, 4, 1, 2, 3]  # [1, 2, 3] last followed by 7, [4, 1, 2, 3] by 9
    assert NgramDrafter(2).propose(ids, 2) == [9, 5]
    assert NgramDrafter(2).propose([4, 1, 2, 3, 9, 5, 1, 2, 3, 7, 8, 1, 2, 3], 2) == [7, 8]


def test_no_draft_from_a_match_shorter_than_the_minimum():
    ids = [1, 2, 3, 4, 1, 2, 9, 2]  # only the last token, 2, occurs before
    assert NgramDrafter(2).propose(ids, 2) == []
    assert NgramDrafter(1).propose(ids, 2) == [9, 2]
    with pytest.raises(ValueError, match="minimum n-gram"):
        NgramDrafter(0)


def test_acceptance_follows_the_record_and_fades_back_to_the_prior():
    drafter = NgramDrafter(2)
    fresh = drafter.acceptance(10)
    for position in range(10, 50, 5):
        drafter.record(position, 4, 4)
    good = drafter.acceptance(50)
    assert good > 0.9 > fresh
    for position in range(50, 80):  # it stops copying: every draft is rejected at once
        drafter.record(position, 2, 0)
    assert drafter.acceptance(80) < 0.35 < fresh
    assert drafter.acceptance(80) < drafter.acceptance(120) < drafter.acceptance(500) == pytest.approx(fresh, abs=1e-3)


def test_a_copying_request_drafts_in_full_and_a_failing_one_stops_then_probes_again():
    assert drafts_for([copying(Request(list(COPY)))], 4, GPU_STEP_ROWS) == [PASSAGE[10:14]]
    request = failing(Request(list(COPY)))
    assert drafts_for([request], 4, GPU_STEP_ROWS) == [[]]
    request.all_ids += PASSAGE[10:40] + PASSAGE[:10]  # 40 tokens later, its record has faded: it tries again
    probe = drafts_for([request], 4, GPU_STEP_ROWS)[0]
    assert 1 <= len(probe) < 4 and probe == PASSAGE[10 : 10 + len(probe)]


def test_a_batch_drafts_the_best_bets_within_the_step_rows():
    good, fresh = copying(Request(list(COPY))), Request(list(COPY))
    drafts = drafts_for([fresh, good], 4, GPU_STEP_ROWS)
    assert drafts[1] == PASSAGE[10:14] and len(drafts[0]) < 4
    many = [copying(Request(list(COPY))) for _ in range(5)]
    drafted = drafts_for(many, 4, GPU_STEP_ROWS)
    assert 0 < sum(len(d) for d in drafted) <= GPU_STEP_ROWS - 5
    assert drafts_for([good] * GPU_STEP_ROWS, 4, GPU_STEP_ROWS) == [[]] * GPU_STEP_ROWS


def test_a_cpu_step_drafts_within_one_pass_of_the_integer_kernels(monkeypatch):
    assert step_rows(torch.device("cpu")) == CPU_STEP_ROWS == ops.TILE_ROWS == 4
    assert step_rows(torch.device("cuda", 0)) == GPU_STEP_ROWS
    monkeypatch.setenv("KETTLE_TUNING", "speculate-step-rows=7")
    assert step_rows(torch.device("cpu")) == 7
    # A copying stream's last token and 3 drafts fill the tile: the fourth draft token would start a second pass.
    assert drafts_for([copying(Request(list(COPY)))], 4, CPU_STEP_ROWS) == [PASSAGE[10:13]]
    pair = drafts_for([copying(Request(list(COPY))), copying(Request(list(COPY)))], 4, CPU_STEP_ROWS)
    assert sum(len(d) for d in pair) == 2
    assert drafts_for([copying(Request(list(COPY))) for _ in range(4)], 4, CPU_STEP_ROWS) == [[]] * 4
    # Weights in lanes take 8 rows a pass: a copying stream verifies all of --speculate 4, two streams 3 each.
    monkeypatch.delenv("KETTLE_TUNING")
    lanes = step_rows(torch.device("cpu"), lanes=True)
    assert lanes == CPU_LANES_STEP_ROWS == ops.LANES_TILE_ROWS == 8
    assert drafts_for([copying(Request(list(COPY)))], 4, lanes) == [PASSAGE[10:14]]
    pair = drafts_for([copying(Request(list(COPY))), copying(Request(list(COPY)))], 4, lanes)
    assert sum(len(d) for d in pair) == 6


def test_drafts_stop_short_of_max_new_tokens_and_skip_prompts():
    assert drafts_for([copying(Request(list(COPY), max_new_tokens=3))], 4, GPU_STEP_ROWS) == [PASSAGE[10:12]]
    assert drafts_for([Request(list(COPY), in_prefill=True)], 4, GPU_STEP_ROWS) == [[]]
    assert drafts_for([Request(list(COPY), drafter=None)], 4, GPU_STEP_ROWS) == [[]]


def test_no_row_cost_drafts_in_full_whatever_the_record(monkeypatch):
    request = failing(Request(list(COPY)))
    assert drafts_for([request], 4, GPU_STEP_ROWS) == [[]]
    monkeypatch.setenv("KETTLE_TUNING", "speculate-row-cost=0")
    assert drafts_for([request], 4, GPU_STEP_ROWS) == [PASSAGE[10:14]]
