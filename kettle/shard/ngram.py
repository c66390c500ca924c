"""N-gram (prompt-lookup) drafts for speculative decoding: the model is guessed to repeat its own context.

The longest suffix of a request's context (its prompt and what it generated), from MAX_NGRAM tokens down to the
minimum (`KETTLE_TUNING`'s `speculate-min-ngram`, 2 by default), is looked up earlier in that same context; the
tokens that followed its latest earlier occurrence are the draft. It costs no model, and on copy-heavy work (quoting,
editing, code, extraction) long drafts are accepted whole.

The drafter also keeps its request's track record: how often its drafts were accepted lately, which
`speculation.drafts_for` weighs against what a verified draft token costs.
"""

from __future__ import annotations

# Longest suffix looked up. Longest first because a longer match picks the right one of a short n-gram's many
# occurrences: replayed over the copy benchmark's answer (a passage repeated word for word), looking up 8 tokens
# instead of 3 drafted 111 tokens instead of 119 and had 93 accepted instead of 91. Past 8 nothing changed, and
# each n costs a dict entry per token.
MAX_NGRAM = 8
# The acceptance estimate (`NgramDrafter.acceptance`): the chance that a draft token is accepted, given the ones
# before it were. Before any evidence, PRIOR, worth PRIOR_WEIGHT draft tokens: high enough that a fresh request
# (or one whose bad record has faded) drafts a token or two as a probe. Evidence fades by DECAY per token the
# request generated since (half-life ~23 tokens), so a request whose answer turns from prose to a quotation
# starts drafting again, and one that stops copying stops paying for drafts.
PRIOR = 0.6
PRIOR_WEIGHT = 4.0
DECAY = 0.97


class NgramDrafter:
    """Proposes draft tokens for one request from an index of the n-grams of its context, and estimates how
    likely its drafts are to be accepted from how they fared.

    The index maps each n-gram (n = min_ngram..MAX_NGRAM) to the position just after its latest occurrence,
    and is extended with each new token (a few dict updates per token), so a proposal never rescans the context.
    """

    def __init__(self, min_ngram: int) -> None:
        if not 1 <= min_ngram <= MAX_NGRAM:
            raise ValueError(f"the minimum n-gram must be 1 to {MAX_NGRAM}, got {min_ngram}")
        self.min_ngram = min_ngram
        self._after: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending before this position are in the index
        # Decayed counts of accepted draft tokens and of draft tokens tried (an accepted one, or the first
        # rejected one: those after it were never compared), as of context length `_seen`.
        self._accepted = self._tried = 0.0
        self._seen = 0

    def propose(self, ids: list[int], limit: int) -> list[int]:
        """Up to `limit` tokens that followed the latest earlier occurrence of the longest matching suffix."""
        if limit <= 0 or len(ids) <= self.min_ngram:
            return []
        self._index(ids, len(ids) - 1)  # every n-gram but those ending at the last token: the suffix itself
        for n in range(min(MAX_NGRAM, len(ids) - 1), self.min_ngram - 1, -1):
            start = self._after.get(tuple(ids[-n:]))
            if start is not None:
                return ids[start : start + limit]
        return []

    def acceptance(self, position: int) -> float:
        """The estimated chance that a draft token proposed at context length `position` is accepted, given
        the draft tokens before it were."""
        fade = DECAY ** max(position - self._seen, 0)
        return (fade * self._accepted + PRIOR * PRIOR_WEIGHT) / (fade * self._tried + PRIOR_WEIGHT)

    def record(self, position: int, drafted: int, accepted: int) -> None:
        """How the draft proposed at context length `position` fared: `accepted` of its `drafted` tokens."""
        if drafted == 0:
            return
        fade = DECAY ** max(position - self._seen, 0)
        # Acceptance stops at the first rejected token, so the tokens after it say nothing: a draft is a run of
        # trials up to the first failure (the geometric model `speculation.drafts_for` assumes).
        self._accepted = fade * self._accepted + accepted
        self._tried = fade * self._tried + accepted + (accepted < drafted)
        self._seen = max(self._seen, position)

    def _index(self, ids: list[int], end: int) -> None:
        low = self.min_ngram
        for position in range(self._indexed, end):
            for n in range(low, min(MAX_NGRAM, position + 1) + 1):
                self._after[tuple(ids[position + 1 - n : position + 1])] = position + 1
        self._indexed = max(self._indexed, end)
