"""Model resolution: Hub downloads, local folders, GGUF and pickle conversion, the bundled model."""

from __future__ import annotations

from kettle.hub.resolve import BUNDLED_MODEL_ID, resolve_model
from kettle.hub.types import ModelNotFound, PreparationError, ResolvedModel

__all__ = ["BUNDLED_MODEL_ID", "ModelNotFound", "PreparationError", "ResolvedModel", "resolve_model"]
