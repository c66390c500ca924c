"""Hugging Face Hub downloads: the files a server needs from a model repository, and nothing else.

`huggingface_hub` handles the cache, `HF_TOKEN`, `HF_ENDPOINT` and `HF_HUB_OFFLINE`; an already cached
snapshot is used without the network. Every failure becomes a `ModelNotFound` with one readable line.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from kettle.hub.types import ModelNotFound

log = logging.getLogger(__name__)

# Config, tokenizer and chat template files, whatever the model family calls them.
METADATA_PATTERNS = ["*.json", "*.model", "*.jinja", "*.txt", "*.tiktoken"]
SAFETENSORS_PATTERNS = ["*.safetensors"]
# Only fetched when a repository has no safetensors weights (older checkpoints); converted afterwards.
PICKLE_PATTERNS = ["*.bin", "*.pt", "*.pth"]
CODE_PATTERNS = ["*.py"]


def hub_cache_dir(hub_cache: str | None) -> str | None:
    """`--huggingface-hub-cache`, else `$HUGGINGFACE_HUB_CACHE`, else huggingface_hub's own default."""
    return hub_cache or os.environ.get("HUGGINGFACE_HUB_CACHE") or None


def download_snapshot(
    model_id: str,
    revision: str | None,
    hub_cache: str | None,
    trust_remote_code: bool = False,
    gguf_quant: str | None = None,
) -> Path:
    """The local snapshot folder of `model_id` at `revision`, downloading what is missing; with `gguf_quant`
    (llama.cpp's `org/name-GGUF:Q4_K_M`), the small files and the GGUF files whose name carries that tag."""
    if gguf_quant:
        tags = {gguf_quant, gguf_quant.upper(), gguf_quant.lower()}
        return _snapshot(model_id, revision, hub_cache, METADATA_PATTERNS + [f"*{tag}*.gguf" for tag in tags])
    patterns = METADATA_PATTERNS + SAFETENSORS_PATTERNS + (CODE_PATTERNS if trust_remote_code else [])
    folder = _snapshot(model_id, revision, hub_cache, patterns)
    if not any(folder.glob("*.safetensors")):
        log.info("%s has no safetensors weights; fetching its PyTorch checkpoint to convert", model_id)
        folder = _snapshot(model_id, revision, hub_cache, patterns + PICKLE_PATTERNS)
    return folder


def _snapshot(model_id: str, revision: str | None, hub_cache: str | None, patterns: list[str]) -> Path:
    from huggingface_hub import snapshot_download

    try:
        path = snapshot_download(
            model_id, revision=revision, cache_dir=hub_cache_dir(hub_cache), allow_patterns=patterns
        )
    except Exception as error:
        raise explain(model_id, revision, error) from error
    return Path(path)


def explain(model_id: str, revision: str | None, error: Exception) -> ModelNotFound:
    """Turns a huggingface_hub error into one line that names the model and what is missing."""
    from huggingface_hub import errors

    name = f"{model_id!r}" + (f" at revision {revision!r}" if revision else "")
    if isinstance(error, errors.GatedRepoError):
        return ModelNotFound(f"Model {name} is gated: accept its license on the Hub and set HF_TOKEN")
    if isinstance(error, errors.RepositoryNotFoundError):
        return ModelNotFound(f"Model {name} was not found on the Hugging Face Hub (private? set HF_TOKEN)")
    if isinstance(error, errors.RevisionNotFoundError):
        return ModelNotFound(f"Model {name}: that revision does not exist on the Hugging Face Hub")
    if isinstance(error, errors.LocalEntryNotFoundError | errors.OfflineModeIsEnabled):
        why = "HF_HUB_OFFLINE is set" if _offline() else "the Hub cannot be reached"
        return ModelNotFound(
            f"Model {name} is not in the local Hugging Face cache and {why}; "
            "download it while online (`kettle download-weights`) or pass a local folder or .gguf file"
        )
    if isinstance(error, errors.HFValidationError):
        return ModelNotFound(f"Model {model_id!r} is neither an existing local path nor a valid Hub model id")
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return ModelNotFound(f"Model {name} could not be downloaded: {first_line}")


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}
