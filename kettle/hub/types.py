"""What model resolution returns, and the one error it raises."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ResolvedModel:
    """A model ready to load: a local folder with config.json, safetensors weights and tokenizer files.

    `display_id` is the name clients see (`/info`, `/v1/models`); `sha` is the Hub commit when known.
    """

    path: Path
    display_id: str
    sha: str | None = None


class ModelNotFound(Exception):
    """The model cannot be found or fetched. The message is one line, fit to print without a traceback."""
