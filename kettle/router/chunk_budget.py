"""How many prompt tokens one chunked-prefill step may compute while running streams decode in it.

A decode step costs about the same for one stream or many: it reads every weight once. A prompt chunk is
compute bound: its cost grows with its tokens. So one fixed `max_batch_prefill_tokens` is either too big while
streams decode (on a CPU, a 512-token chunk costs many decode steps: every running stream stalls for it) or too
small when nothing decodes (a lone long prompt pays the weight reads once per small step). `ChunkBudget` keeps a
step that carries decodes at about `ratio` times a decode-only step: it keeps moving averages of the decode
step's time and of one prompt token's cost, measured on the steps the scheduler runs, and allows
(ratio - 1) x decode time / token cost prompt tokens, within [min_tokens, max_tokens]. A step with no running
decode gets the whole `max_tokens`. Off (`KETTLE_TUNING=adaptive-chunks=off`), every step gets `max_tokens`.
"""

from __future__ import annotations

from dataclasses import dataclass

_SMOOTHING = 0.25  # weight of the newest measurement in the moving averages


@dataclass
class ChunkBudget:
    """The prefill token budget of the next step, learned from the time of the previous ones."""

    max_tokens: int
    adaptive: bool = True
    ratio: float = 2.0  # a step with decodes and a chunk vs a decode-only step; the target is p99 ITL <= 3x p50
    min_tokens: int = 16  # never slower than this: a long prompt must still progress under heavy decode load
    decode_s: float | None = None  # moving average of a decode-only step
    token_s: float | None = None  # moving average of one prompt token's share of a step

    def __post_init__(self) -> None:
        if self.max_tokens < 1 or self.min_tokens < 1 or self.ratio <= 1:
            raise ValueError(f"invalid chunk budget: {self}")

    def tokens(self, decoding: bool) -> int:
        """The budget of a step; `decoding`: running streams decode in it."""
        if not (self.adaptive and decoding):
            return self.max_tokens
        if self.decode_s is None or self.token_s is None:
            return min(self.min_tokens, self.max_tokens)  # not measured yet: the cautious size
        allowed = int((self.ratio - 1) * self.decode_s / self.token_s)
        return max(min(self.min_tokens, self.max_tokens), min(self.max_tokens, allowed))

    def observe(self, seconds: float, prompt_tokens: int) -> None:
        """Learns from one finished step: its wall time and the prompt tokens it computed (0: decode only)."""
        if prompt_tokens == 0:
            self.decode_s = _average(self.decode_s, seconds)
        elif self.decode_s is not None:
            # What the step cost beyond a decode step (the weight reads every step pays) is the prompt's share.
            per_token = max(seconds - self.decode_s, 0.0) / prompt_tokens
            self.token_s = _average(self.token_s, max(per_token, 1e-9))


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1 - _SMOOTHING) * old + _SMOOTHING * new
