"""The model's chat template (docs/api.md, OpenAI routes): found in the model folder, rendered in a Jinja sandbox.

Templates are code shipped with a model download, so they run in `ImmutableSandboxedEnvironment`: no attribute
access to Python internals, no mutation of the objects they are given. The helpers HF templates expect
(`raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text) are provided, as transformers does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import TemplateError as JinjaTemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kettle.router.errors import TemplateError

# Appended to the content of an assistant message being continued, to find where that content ends.
_CONTINUE_MARK = "\x00kettle-continue\x00"


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled chat template with the special tokens it may reference."""

    source: str
    bos_token: str = ""
    eos_token: str = ""

    def __post_init__(self) -> None:
        # Compiled once. A template that does not parse fails each chat request (422), not the server start:
        # the plain generate routes still work with such a model.
        try:
            compiled: Any = _environment().from_string(self.source)
        except JinjaTemplateError as exc:
            compiled = TemplateError(str(exc))
        object.__setattr__(self, "_compiled", compiled)

    @classmethod
    def load(cls, folder: Path, tokenizer_config_path: str | None = None) -> ChatTemplate | None:
        """The template of the model in `folder`, or None when it has none.

        Order: `chat_template.jinja`, `chat_template.json`, then the tokenizer config's `chat_template`
        (`--tokenizer-config-path` replaces the folder's `tokenizer_config.json`).
        """
        config_path = Path(tokenizer_config_path) if tokenizer_config_path else folder / "tokenizer_config.json"
        config = _read_json(config_path)
        source = _read_text(folder / "chat_template.jinja")
        source = source or _pick(_read_json(folder / "chat_template.json").get("chat_template"))
        source = source or _pick(config.get("chat_template"))
        if not source:
            return None
        special = {**_read_json(folder / "special_tokens_map.json"), **config}
        return cls(source, _token_text(special.get("bos_token")), _token_text(special.get("eos_token")))

    def render(self, messages: Sequence[Mapping[str, Any]], **extra: Any) -> str:
        """The prompt for `messages`; a trailing assistant message is continued rather than answered."""
        continuing = bool(messages) and messages[-1].get("role") == "assistant"
        if continuing:
            last = dict(messages[-1])
            last["content"] = (last.get("content") or "") + _CONTINUE_MARK
            messages = [*messages[:-1], last]
        text = self._render(messages, add_generation_prompt=not continuing, **extra)
        if not continuing:
            return text
        end = text.find(_CONTINUE_MARK)
        if end < 0:
            raise TemplateError("the template dropped the content of the assistant message to continue")
        # Everything after the content is the template's end-of-turn: the model must keep writing instead.
        return text[:end]

    def _render(self, messages: Sequence[Mapping[str, Any]], **variables: Any) -> str:
        compiled = self._compiled  # type: ignore[attr-defined]
        if isinstance(compiled, TemplateError):
            raise compiled
        try:
            return compiled.render(messages=messages, bos_token=self.bos_token, eos_token=self.eos_token, **variables)
        except JinjaTemplateError as exc:
            raise TemplateError(str(exc)) from exc


class _RaisedByTemplate(JinjaTemplateError):
    """A template's own `raise_exception(...)`, e.g. "Conversation roles must alternate"."""


def _raise_exception(message: str) -> None:
    raise _RaisedByTemplate(message)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _tojson(value: Any, indent: int | None = None) -> str:
    # Jinja's own tojson escapes <, > and & for HTML, which would change the prompt the model sees.
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _environment() -> ImmutableSandboxedEnvironment:
    # trim_blocks/lstrip_blocks: HF templates are written for these settings (transformers uses them).
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.filters["tojson"] = _tojson
    return env


def _pick(value: Any) -> str | None:
    """A template setting is a string, or a list of named templates of which `default` is the chat one."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        chosen = named.get("default")
        return chosen if isinstance(chosen, str) else None
    return None


def _token_text(token: Any) -> str:
    """Special tokens are saved as a string or as an AddedToken dict with `content`."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else ""


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
