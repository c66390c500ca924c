"""Stopping rules: length, EOS, stop strings (also split over tokens), their order, ignore_eos."""

from __future__ import annotations

from kettle.proto import generate_pb2
from kettle.shard.stopping import StoppingCriteria

LENGTH = generate_pb2.FINISH_REASON_LENGTH
EOS = generate_pb2.FINISH_REASON_EOS_TOKEN
STOP = generate_pb2.FINISH_REASON_STOP_SEQUENCE
EOS_IDS = frozenset({0, 2})


def feed(criteria: StoppingCriteria, tokens: list[tuple[int, str]]) -> list[int | None]:
    return [criteria(token_id, text) for token_id, text in tokens]


def test_length_on_the_last_allowed_token():
    criteria = StoppingCriteria(EOS_IDS, [], max_new_tokens=3)
    assert feed(criteria, [(5, "a"), (6, "b"), (7, "c")]) == [None, None, LENGTH]
    assert criteria.current_tokens == 3


def test_eos_token_any_of_the_listed_ids():
    assert feed(StoppingCriteria(EOS_IDS, [], 10), [(5, "a"), (2, "</s>")]) == [None, EOS]
    assert feed(StoppingCriteria(EOS_IDS, [], 10), [(0, "")]) == [EOS]


def test_length_beats_eos_on_the_same_token():
    assert feed(StoppingCriteria(EOS_IDS, ["b"], 2), [(5, "a"), (0, "b")]) == [None, LENGTH]


def test_eos_beats_stop_sequence_on_the_same_token():
    assert feed(StoppingCriteria(EOS_IDS, ["x"], 10), [(0, "x")]) == [EOS]


def test_ignore_eos_token():
    criteria = StoppingCriteria(EOS_IDS, [], 3, ignore_eos_token=True)
    assert feed(criteria, [(0, ""), (2, ""), (0, "")]) == [None, None, LENGTH]


def test_stop_sequence_in_one_token():
    criteria = StoppingCriteria(EOS_IDS, ["World"], 10)
    assert feed(criteria, [(5, "Hello"), (6, " World")]) == [None, STOP]


def test_stop_sequence_split_across_tokens():
    criteria = StoppingCriteria(EOS_IDS, ["never", "<|stop|>"], 20)
    pieces = ["Go", " <", "|", "st", "", "op", "|", ">"]
    assert feed(criteria, [(10 + i, p) for i, p in enumerate(pieces)]) == [None] * 7 + [STOP]


def test_stop_sequence_followed_by_more_text_in_the_same_token():
    criteria = StoppingCriteria(EOS_IDS, ["\n"], 10)
    assert feed(criteria, [(5, "Done."), (6, ".\n\nNext")]) == [None, STOP]


def test_stop_sequence_is_not_matched_again_in_old_text():
    criteria = StoppingCriteria(EOS_IDS, ["ab"], 10)
    # "a" + "b" only appear together across the boundary of the last two tokens.
    assert feed(criteria, [(1, "xa"), (1, "c"), (1, "a"), (1, "b")]) == [None, None, None, STOP]


def test_tail_stays_bounded():
    criteria = StoppingCriteria(EOS_IDS, ["abc", "zz"], 10_000)
    for i in range(1000):
        assert criteria(100 + i % 50, "xyxy") is None
    assert len(criteria._tail) <= 2
    assert criteria(7, "ab") is None
    assert criteria(8, "c") == STOP


def test_empty_stop_sequence_is_ignored():
    assert feed(StoppingCriteria(EOS_IDS, [""], 3), [(5, "a"), (6, "b")]) == [None, None]
