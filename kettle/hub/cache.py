"""Kettle's conversion cache: folders built once, atomically, and reused by every later start.

A converted model lives in `$KETTLE_CACHE/models/<stem>-<key>/` (default `~/.cache/kettle`), where the key
hashes the source's path, size and modification time, so an edited source gets a fresh folder. The folder
is built under a temporary name beside its final place and renamed when complete: a crash or Ctrl-C never
leaves a half-written folder that a later start would mistake for a finished one.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from kettle import settings

log = logging.getLogger(__name__)

TEMP_PREFIX = ".tmp-"


def cache_root() -> Path:
    """`$KETTLE_CACHE`, else `~/.cache/kettle` (`kettle.settings`)."""
    return settings.current().cache_dir


def source_key(*sources: Path) -> str:
    """A short hash of the sources' absolute paths, sizes and modification times."""
    digest = hashlib.sha256()
    for source in sources:
        stat = source.stat()
        digest.update(f"{source.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
    return digest.hexdigest()[:12]


def converted_dir(stem: str, key: str) -> Path:
    """Where the converted copy of a source named `stem` with cache key `key` lives."""
    return cache_root() / "models" / f"{stem}-{key}"


def build_once(target: Path, build: Callable[[Path], None], what: str) -> Path:
    """Returns `target`, first running `build(temp_dir)` and renaming the result into place if it is missing.

    Two processes converting the same source at once both build; the first rename wins and the other's
    copy is discarded, so no lock file is needed.
    """
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned(target.parent)
    temp = target.parent / f"{TEMP_PREFIX}{target.name}-{os.getpid()}"
    shutil.rmtree(temp, ignore_errors=True)
    log.info("Converting %s into %s (one time; later starts reuse it)", what, target)
    started = time.monotonic()
    try:
        temp.mkdir()
        build(temp)
        _publish(temp, target)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    log.info("Converted %s in %.1f s", what, time.monotonic() - started)
    return target


def _remove_abandoned(folder: Path) -> None:
    """Deletes temporary folders whose builder process is gone (killed with SIGKILL, or the machine died)."""
    for temp in folder.glob(f"{TEMP_PREFIX}*"):
        pid = temp.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _process_exists(int(pid)):
            shutil.rmtree(temp, ignore_errors=True)


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, it is just someone else's
    return True


def _publish(temp: Path, target: Path) -> None:
    try:
        os.rename(temp, target)
    except OSError:
        # Another process finished the same conversion first; its folder is as good as ours.
        if not target.is_dir():
            raise
