"""Grammar texts as the grammar engine, llguidance, reads them (docs/api.md, Structured output and tools): shared by
the router, which validates a request's grammar before queueing it, and the shard, which builds its matchers from
the same text.

Both sides go through `grammar_text`, so a grammar the router accepts is one the shard can run. Results are
cached (LRU by grammar type and text): a schema sent again costs nothing.
"""

from __future__ import annotations

import json
from functools import lru_cache

import llguidance

# proto GrammarType values (kept here so the router need not import the stubs for them).
GRAMMAR_TYPE_JSON = 1
GRAMMAR_TYPE_REGEX = 2

# Compact, fixed JSON layout: a free whitespace rule lets small models loop on spaces and newlines forever.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_text(grammar_type: int, text: str) -> str:
    """The llguidance grammar of a (proto GrammarType, text) pair; ValueError with a one-line reason if invalid."""
    return _compiled(grammar_type, text)


@lru_cache(maxsize=256)
def _compiled(grammar_type: int, text: str) -> str:
    if grammar_type == GRAMMAR_TYPE_REGEX:
        grammar = llguidance.LLMatcher.grammar_from_regex(text)
    elif grammar_type == GRAMMAR_TYPE_JSON:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(_schema(text), defaults=JSON_LAYOUT)
    else:
        raise ValueError(f"unknown grammar type {grammar_type}")
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(_one_line(error))
    return grammar


def _schema(text: str) -> dict:
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"the JSON Schema is not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise ValueError("a JSON Schema must be an object")
    return schema


def _one_line(error: str) -> str:
    """llguidance's message without its source excerpt and caret lines: the first line and the `error:` ones."""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    return " ".join([lines[0], *(line for line in lines[1:] if line.startswith("error:"))])
