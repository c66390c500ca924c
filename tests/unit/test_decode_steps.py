"""How many decode steps one shard call may run: as many as fit in the window, one when the batch is not settled."""

from __future__ import annotations

from kettle.router.decode_steps import MAX_STEPS, DecodeSteps


def test_one_step_until_a_step_was_measured():
    assert DecodeSteps(window_s=0.05).steps(settled=True) == 1


def test_as_many_steps_as_fit_in_the_window():
    steps = DecodeSteps(window_s=0.05)
    steps.observe(0.004, 1)  # 4 ms per step
    assert steps.steps(settled=True) == 12
    steps.observe(0.120, 4)  # a call of 4 steps at 30 ms: the average moves towards it
    assert steps.steps(settled=True) == int(0.05 / (0.75 * 0.004 + 0.25 * 0.030))


def test_one_step_when_not_settled_or_off_and_never_more_than_the_cap():
    steps = DecodeSteps(window_s=0.05)
    steps.observe(1e-6, 1)
    assert steps.steps(settled=True) == MAX_STEPS
    assert steps.steps(settled=False) == 1
    off = DecodeSteps(window_s=0.0)
    off.observe(1e-6, 1)
    assert off.steps(settled=True) == 1
    slow = DecodeSteps(window_s=0.05)
    slow.observe(0.2, 1)  # a step longer than the window
    assert slow.steps(settled=True) == 1
