"""Streamed tool calls (docs/api.md, Structured output and tools): the growing tool output turned into OpenAI deltas as
it is generated.

The output is `{"function": {"_name": NAME, ...}}` (tools.py). Nothing is sent until the name is complete; then
a call sends one delta with its id, type and name, followed by argument-text deltas whose concatenation is the
final `arguments` string; a `no_tool` answer sends its `content` string as ordinary content deltas, decoded
from JSON as far as it can be so far.
"""

from __future__ import annotations

import json
import re
import uuid

from kettle.router.openai_schemas import Delta, FunctionCall, ToolCall
from kettle.router.tools import NAME_HEAD, NO_TOOL, arguments_text

_CONTENT_KEY = ', "content": "'
# The longest prefix of a JSON string body without its closing quote (a trailing lone backslash left out).
_STRING_BODY = re.compile(r'(?:[^"\\]|\\.)*')
_PARTIAL_ESCAPE = re.compile(r"\\u[0-9a-fA-F]{0,3}$")


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolStream:
    """Feeds on the token texts of one tool output; `feed` returns the delta to send for the new text, if any."""

    def __init__(self) -> None:
        self.text = ""
        self.name: str | None = None
        self._after_name = 0
        self._sent = 0  # characters of arguments (or of decoded content) already sent

    @property
    def is_call(self) -> bool:
        """Whether the output is a function call (not known until the name is complete)."""
        return self.name is not None and self.name != NO_TOOL

    def called(self) -> bool:
        """Whether the whole output is a complete function call (its finish reason is then `tool_calls`)."""
        if not self.is_call:
            return False
        try:
            json.loads(self.text)
        except json.JSONDecodeError:
            return False
        return True

    def feed(self, piece: str) -> Delta | None:
        self.text += piece
        if self.name is None:
            head = NAME_HEAD.match(self.text)
            if head is None:
                return None
            self.name, self._after_name = json.loads(f'"{head.group(1)}"'), head.end()
            if self.is_call:
                call = ToolCall(id=call_id(), type="function", function=FunctionCall(name=self.name, arguments=""))
                return Delta(tool_calls=[call])
        return self._arguments() if self.is_call else self._content()

    def _arguments(self) -> Delta | None:
        arguments = arguments_text(self.text, self._after_name)
        new, self._sent = arguments[self._sent :], max(self._sent, len(arguments))
        return Delta(tool_calls=[ToolCall(function=FunctionCall(arguments=new))]) if new else None

    def _content(self) -> Delta | None:
        rest = self.text[self._after_name :]
        if not rest.startswith(_CONTENT_KEY):
            return None
        body = _STRING_BODY.match(rest, len(_CONTENT_KEY))
        assert body is not None  # the pattern matches the empty string
        safe = _PARTIAL_ESCAPE.sub("", body.group(0))
        try:
            decoded = json.loads(f'"{safe}"')
        except json.JSONDecodeError:
            return None  # an escape split across tokens; the next piece completes it
        new, self._sent = decoded[self._sent :], max(self._sent, len(decoded))
        return Delta(content=new) if new else None
