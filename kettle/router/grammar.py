"""Grammar checks on the router (docs/api.md, Structured output and tools): an invalid schema or regex is refused before
the request is queued.

The grammar is compiled with the same function the shard uses (kettle/grammar.py, LRU-cached by type and
text), in a worker thread so a large schema never stalls the event loop.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from kettle.grammar import GRAMMAR_TYPE_JSON, GRAMMAR_TYPE_REGEX, grammar_text
from kettle.router.errors import ValidationError
from kettle.router.schemas import Grammar

# OpenAI's `json_object` (any JSON object), spelled with the `properties` field every JSON grammar needs.
ANY_OBJECT: dict[str, Any] = {"type": "object", "properties": {}}

__all__ = ["GRAMMAR_TYPE_JSON", "GRAMMAR_TYPE_REGEX", "check_grammar", "response_format_grammar"]


async def check_grammar(text: str, grammar_type: int) -> None:
    """422 `grammar is not valid: {reason}` (TGI's message) when the engine cannot build the grammar."""
    if not text and grammar_type == 0:
        return
    try:
        await asyncio.to_thread(grammar_text, grammar_type, text)
    except ValueError as exc:
        raise ValidationError(f"grammar is not valid: {exc}") from None
    if grammar_type == GRAMMAR_TYPE_JSON:
        _check_properties(text)


def _check_properties(text: str) -> None:
    """TGI refuses a JSON Schema without a top-level `properties` field, valid as it may be; so does Kettle, so
    a grammar that works here works on TGI too."""
    schema = json.loads(text)
    if not isinstance(schema, dict) or "properties" not in schema:
        raise ValidationError("grammar is not valid: Grammar must have a 'properties' field")


def response_format_grammar(response_format: dict[str, Any] | None) -> Grammar | None:
    """The grammar of a chat `response_format`, in TGI's or OpenAI's spelling; None for plain text.

    TGI: `{"type": "json"|"json_object"|"regex"|"json_schema", "value": ...}`. OpenAI: `{"type": "json_object"}`
    (any JSON object) and `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`.
    """
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind not in ("json", "json_object", "regex", "json_schema"):
        raise ValidationError(
            f"`response_format` type must be one of text, json, json_object, json_schema, regex. Given: {kind!r}"
        )
    if "value" in response_format:
        return Grammar(type=kind, value=response_format["value"])
    if kind == "json_schema" and isinstance(response_format.get("json_schema"), dict):
        return Grammar(type=kind, value=response_format["json_schema"])
    if kind == "json_object":
        return Grammar(type="json", value=ANY_OBJECT)
    raise ValidationError(f"`response_format` of type `{kind}` needs a `value`")
