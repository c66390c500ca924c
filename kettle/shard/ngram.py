"""N-gram (prompt-lookup) drafts for speculative decoding: the model is guessed to repeat its own context.

The last few tokens of a request (its prompt and what it generated) are looked up earlier in that same
context; the tokens that followed their latest earlier occurrence are the draft. It costs no model, and on
copy-heavy work (quoting, editing, code, extraction) long drafts are accepted whole.
"""

from __future__ import annotations

# Longest suffix looked up first: a longer match predicts the continuation better; a single token matches often.
MAX_NGRAM = 3


class NgramDrafter:
    """Proposes draft tokens for one request from an index of the n-grams of its context.

    The index maps each n-gram (n = 1..MAX_NGRAM) to the position just after its latest occurrence, and is
    extended with each new token (a few dict updates per token), so a proposal never rescans the context.
    """

    def __init__(self) -> None:
        self._after: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending before this position are in the index

    def propose(self, ids: list[int], limit: int) -> list[int]:
        """Up to `limit` tokens that followed the latest earlier occurrence of the longest matching suffix."""
        if limit <= 0 or len(ids) < 2:
            return []
        self._index(ids, len(ids) - 1)  # every n-gram but those ending at the last token: the suffix itself
        for n in range(min(MAX_NGRAM, len(ids) - 1), 0, -1):
            start = self._after.get(tuple(ids[-n:]))
            if start is not None:
                return ids[start : start + limit]
        return []

    def _index(self, ids: list[int], end: int) -> None:
        for position in range(self._indexed, end):
            for n in range(1, min(MAX_NGRAM, position + 1) + 1):
                self._after[tuple(ids[position + 1 - n : position + 1])] = position + 1
        self._indexed = max(self._indexed, end)
