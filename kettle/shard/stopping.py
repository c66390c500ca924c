"""When one request stops: max_new_tokens, then the model's EOS ids, then a stop string."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kettle.proto import generate_pb2


class StoppingCriteria:
    """Per-request stopping rules, fed one generated token (and its detokenized text) at a time.

    Stop strings are matched against a bounded tail of the decoded output, so a stop string split over
    several tokens matches. A match counts when the stop string *ends inside the newest piece of text*, not
    only at its very end: TGI's end-anchored check misses a stop string when the model emits it together with
    the next characters in one token (stop "\\n" and a token ".\\n\\n"), and generation then runs on. The
    matched stop string stays in the output (docs/api.md, Responses and streams).
    """

    def __init__(
        self,
        eos_token_ids: Iterable[int],
        stop_sequences: Sequence[str],
        max_new_tokens: int,
        ignore_eos_token: bool = False,
    ) -> None:
        self.eos_token_ids = frozenset(eos_token_ids)
        # An empty stop string would match every token; the router rejects it, ignore it here too.
        self.stop_sequences = tuple(s for s in stop_sequences if s)
        self.max_new_tokens = max_new_tokens
        self.ignore_eos_token = ignore_eos_token
        self.current_tokens = 0
        # A future match starts at most len(longest) - 1 characters before the text still to come.
        self._keep = max((len(s) for s in self.stop_sequences), default=1) - 1
        self._tail = ""

    def __call__(self, token_id: int, text: str) -> int | None:
        """Counts the token and returns the proto `FinishReason` that ends the request, or None to go on.

        `text` is the token's newly detokenized piece ("" while a UTF-8 character is incomplete). Note that
        FINISH_REASON_LENGTH is 0: test the result with `is not None`."""
        self.current_tokens += 1
        if self.current_tokens >= self.max_new_tokens:
            return generate_pb2.FINISH_REASON_LENGTH
        if not self.ignore_eos_token and token_id in self.eos_token_ids:
            return generate_pb2.FINISH_REASON_EOS_TOKEN
        if self._stop_string_ends_in(text):
            return generate_pb2.FINISH_REASON_STOP_SEQUENCE
        return None

    def _stop_string_ends_in(self, text: str) -> bool:
        """Whether a stop string ends inside `text`, looking back over the kept tail of earlier output."""
        if not text or not self.stop_sequences:
            return False
        window = self._tail + text
        new_from = len(self._tail)
        self._tail = window[-self._keep :] if self._keep else ""
        # An occurrence starting at i ends inside the new text when i + len(s) > new_from.
        return any(window.find(s, max(0, new_from - len(s) + 1)) >= 0 for s in self.stop_sequences)
