"""Hugging Face Hub downloads: the files a server needs from a model repository, and nothing else.

`huggingface_hub` handles the cache, `HF_TOKEN`, `HF_ENDPOINT`, `HF_HUB_OFFLINE` and the download progress
bars (shown on a terminal, left out of redirected logs); an already cached snapshot is used without the
network. Every failure becomes a `ModelNotFound` with one readable line.
"""

from __future__ import annotations

import glob
import logging
import os
from pathlib import Path

from kettle.hub.failures import advice, first_line, folder_failure
from kettle.hub.types import ModelNotFound
from kettle.progress import LoggedProgress, bars_shown

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
    model_id: str, revision: str | None, hub_cache: str | None, trust_remote_code: bool = False
) -> Path:
    """The local snapshot folder of `model_id` at `revision`, downloading what is missing: the small files and
    the safetensors weights (the PyTorch checkpoint when there are none)."""
    patterns = METADATA_PATTERNS + SAFETENSORS_PATTERNS + (CODE_PATTERNS if trust_remote_code else [])
    folder = _snapshot(model_id, revision, hub_cache, patterns)
    if not any(folder.glob("*.safetensors")):
        log.info("%s has no safetensors weights; fetching its PyTorch checkpoint to convert", model_id)
        folder = _snapshot(model_id, revision, hub_cache, patterns + PICKLE_PATTERNS)
    return folder


def download_files(model_id: str, revision: str | None, hub_cache: str | None, files: list[str]) -> Path:
    """The snapshot folder of `model_id` holding its small files and exactly `files` (paths in the repository),
    downloading what is missing."""
    # allow_patterns are fnmatch patterns: escape the names, so a `[` in one cannot widen the match.
    return _snapshot(model_id, revision, hub_cache, METADATA_PATTERNS + [glob.escape(name) for name in files])


def gguf_files(model_id: str, revision: str | None, hub_cache: str | None) -> tuple[list[str], str]:
    """The `.gguf` files of `model_id` at `revision` (paths in the repository) and where the list comes from:
    the Hub's file list, or offline (or when the Hub cannot be reached) the files already in the local cache."""
    from huggingface_hub import HfApi, constants, errors

    if not constants.HF_HUB_OFFLINE:
        try:
            names = HfApi().list_repo_files(model_id, revision=revision)
        except (errors.RepositoryNotFoundError, errors.RevisionNotFoundError, errors.HFValidationError) as error:
            raise explain(model_id, revision, error) from error
        except Exception as error:  # the network: what the cache holds may still serve
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            log.warning("Cannot list the files of %s on the Hub (%s); looking in the local cache", model_id, reason)
        else:
            return sorted(name for name in names if name.endswith(".gguf")), "on the Hub"
    snapshot = _snapshot(model_id, revision, hub_cache, METADATA_PATTERNS)
    return sorted(path.relative_to(snapshot).as_posix() for path in snapshot.rglob("*.gguf")), "in the local cache"


def _snapshot(model_id: str, revision: str | None, hub_cache: str | None, patterns: list[str]) -> Path:
    from huggingface_hub import snapshot_download

    # huggingface_hub's own bars on a terminal; log lines every tenth of the way in a redirected or JSON log,
    # where its bars would be hidden (or break the JSON lines).
    bars = None if bars_shown() else LoggedProgress
    try:
        path = snapshot_download(
            model_id, revision=revision, cache_dir=hub_cache_dir(hub_cache), allow_patterns=patterns, tqdm_class=bars
        )
    except Exception as error:
        raise explain(model_id, revision, error, hub_cache) from error
    return Path(path)


def explain(model_id: str, revision: str | None, error: Exception, hub_cache: str | None = None) -> ModelNotFound:
    """Turns a huggingface_hub error into one line that names the model and what is missing, or the Hub cache
    folder (`hub_cache`, as `hub_cache_dir` finds it) when that refused the download's writes."""
    from huggingface_hub import constants, errors

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
    folder = Path(hub_cache_dir(hub_cache) or constants.HF_HUB_CACHE)
    refused = folder_failure(error, folder)
    if refused is not None:
        number, why = refused
        return ModelNotFound(
            f"Model {name} could not be downloaded into the Hugging Face cache folder {folder} "
            f"(HUGGINGFACE_HUB_CACHE): {why}; {advice(number, 'HUGGINGFACE_HUB_CACHE')}"
        )
    return ModelNotFound(f"Model {name} could not be downloaded: {first_line(error)}")


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}
