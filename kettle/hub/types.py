"""What model resolution returns, and the errors it raises."""

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


class PreparationError(Exception):
    """The model cannot be found, fetched or prepared. The message is one line, fit to print without a traceback:
    what failed, the file or folder involved, the cause and what to do."""


class ModelNotFound(PreparationError):
    """The model cannot be found or fetched (a missing path, an unknown Hub id, offline without a cached copy)."""
