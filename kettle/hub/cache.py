"""Kettle's conversion cache: folders built once, atomically, and reused by every later start.

A converted model lives in `$KETTLE_CACHE/models/<stem>-<key>/` (default `~/.cache/kettle`), where the key
hashes the source's path, size and modification time, so an edited source gets a fresh folder. The folder
is built under a temporary name beside its final place and renamed when complete: a crash or Ctrl-C never
leaves a half-written folder that a later start would mistake for a finished one.

A second process building the same folder waits for the first and reuses its result (`build_once`).

A folder's key can never match again once its source is deleted, moved or rewritten (a new virtual environment
holds the bundled GGUF at a new path; a re-downloaded file has a new modification time), so such folders are
garbage, up to a float32 copy of the weights each. Every build records its sources (`kettle-source.json`) and
first removes the folders beside it whose sources are gone or changed, and those whose links all dangle (folders
from before the record: a GGUF folder links to its file).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from kettle import settings

log = logging.getLogger(__name__)

TEMP_PREFIX = ".tmp-"
SOURCES_FILE = "kettle-source.json"  # in a converted folder: the absolute paths of the files it was built from


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


def build_once(target: Path, build: Callable[[Path], None], what: str, sources: Sequence[Path] = ()) -> Path:
    """Returns `target`, first running `build(temp_dir)` and renaming the result into place if it is missing.
    `sources`: the files `target`'s key was computed from (`source_key`), recorded so that a later build can
    tell when they are gone.

    A process that finds another building the same target waits for it and reuses its folder (an advisory lock on
    a file beside the folder, which the system releases if the builder dies): the launcher starts the shards while
    it still compiles the CPU kernels, and the shards then wait for that build instead of compiling their own
    copies. Where the lock cannot be taken (a file system without it), both build, the first rename wins and the
    other copy is discarded.
    """
    if target.is_dir():
        if sources and not (target / SOURCES_FILE).exists():
            _record_sources(target, sources)  # built before folders kept the record
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _building(target, what):
        if target.is_dir():  # built by the process this one waited for
            return target
        return _build(target, build, what, sources)


@contextlib.contextmanager
def _building(target: Path, what: str) -> Iterator[None]:
    """Holds the lock on `target`'s build; the lock file goes with the build (a process still waiting on it then
    finds the folder built, or builds after a failure)."""
    lock = target.parent / f"{TEMP_PREFIX}{target.name}.lock"
    try:
        handle = open(lock, "a")  # noqa: SIM115 (held across the yield)
    except OSError:
        yield
        return
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("Waiting for another process converting %s", what)
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError:
            pass  # no locks here: build anyway
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                lock.unlink()


def _build(target: Path, build: Callable[[Path], None], what: str, sources: Sequence[Path]) -> Path:
    _remove_abandoned(target.parent)
    _remove_stale(target.parent)
    temp = target.parent / f"{TEMP_PREFIX}{target.name}-{os.getpid()}"
    shutil.rmtree(temp, ignore_errors=True)
    log.info("Converting %s into %s (one time; later starts reuse it)", what, target)
    started = time.monotonic()
    try:
        temp.mkdir()
        build(temp)
        if sources:
            _record_sources(temp, sources)
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


def _record_sources(folder: Path, sources: Sequence[Path]) -> None:
    # Written beside and renamed into place: a reader never sees half a record.
    partial = folder / f"{TEMP_PREFIX}{SOURCES_FILE}-{os.getpid()}"
    try:
        partial.write_text(json.dumps([str(source.resolve()) for source in sources]))
        os.replace(partial, folder / SOURCES_FILE)
    except OSError as error:  # a read-only cache still serves; its folders just stay
        log.debug("Could not record the sources of %s: %s", folder, error)
        with contextlib.suppress(OSError):
            partial.unlink()


def _remove_stale(folder: Path) -> None:
    """Deletes the converted folders in `folder` that no source can reach again (see the module docstring)."""
    for converted in folder.iterdir():
        if converted.name.startswith(TEMP_PREFIX) or not converted.is_dir() or not _stale(converted):
            continue
        log.info("Removing %s: the file it was converted from is gone or has changed", converted)
        shutil.rmtree(converted, ignore_errors=True)


def _stale(converted: Path) -> bool:
    record = converted / SOURCES_FILE
    if record.is_file():
        try:
            sources = [Path(path) for path in json.loads(record.read_text())]
        except (OSError, ValueError, TypeError):
            return False  # unreadable: leave it rather than guess
        if not all(source.is_file() for source in sources):
            return True
        return not converted.name.endswith(f"-{source_key(*sources)}")
    links = [path for path in converted.iterdir() if path.is_symlink()]
    return bool(links) and not any(link.exists() for link in links)


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
