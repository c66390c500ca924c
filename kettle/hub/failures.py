"""One line for a model preparation that fails: what failed, the file or folder, the cause and what to do.

A full, read-only or misplaced cache folder otherwise surfaces as whatever the failing library raised: an OSError
from Python's own writes, or from tokenizers and safetensors (Rust) a plain Exception whose message ends in
`(os error 28)` and names no folder. Both are read here as the system's error number and worded with the folder
and the setting that moves it (`KETTLE_CACHE`, `HUGGINGFACE_HUB_CACHE`). Anything else becomes a line with its
type and first line; the traceback is for `LOG_LEVEL=debug`.
"""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

from kettle.hub.types import PreparationError

_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")
# The numbers that say a folder cannot take what is written there: only these are worded as the folder's fault.
# (A reset connection, say, has a number too, and is no fault of the cache.)
NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)
FILE_IN_THE_WAY = (errno.ENOTDIR, errno.EEXIST)
FOLDER_FAULTS = (*NO_SPACE, *NOT_WRITABLE, *FILE_IN_THE_WAY, errno.EIO)
# The system's wording, where it is unclear to someone who did not write the program.
_CAUSES = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "the disk quota is used up",
    errno.EFBIG: "a file grew past the size this system allows",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.ENOENT: "no such file or folder",
}


def error_number(error: BaseException) -> int | None:
    """The system's error number behind `error`: an OSError's, or the one a Rust library wrote in its message."""
    if isinstance(error, OSError) and error.errno:
        return error.errno
    match = _RUST_OS_ERROR.search(str(error))
    return int(match.group(1)) if match else None


def cause(number: int, filename: str | None = None) -> str:
    """The cause, in words: for a file where a folder is expected, which file that is."""
    if number in FILE_IN_THE_WAY and filename:
        in_the_way = _file_in_the_way(Path(filename))
        if in_the_way is not None:
            return f"{in_the_way} is a file where a folder is expected"
    return _CAUSES.get(number) or os.strerror(number).lower()


def advice(number: int, setting: str) -> str:
    """What to do about a folder (named by `setting`) that failed with `number`."""
    if number in NO_SPACE:
        return f"free space there or point {setting} at a larger folder"
    if number == errno.EROFS:
        return f"point {setting} at a writable folder"
    if number in NOT_WRITABLE:
        return f"make it writable for this user or point {setting} at a writable folder"
    if number in FILE_IN_THE_WAY:
        return f"move that file away or point {setting} at a folder"
    return f"point {setting} at another folder"


def folder_failure(error: BaseException, folder: Path) -> tuple[int, str] | None:
    """`error`'s number and cause when the file system refused a write into `folder` (out of space, read-only, no
    permission, a file in the way); None for any other error, among them one about a file outside `folder` (a
    source being read)."""
    number = error_number(error)
    if number is None or number not in FOLDER_FAULTS:
        return None
    filename = getattr(error, "filename", None)
    if filename and not _inside(Path(filename), folder):
        return None
    return number, cause(number, filename)


def cache_failure(what: str, folder: Path, error: BaseException) -> PreparationError | None:
    """The one line for `error` raised while preparing `what` into the conversion cache `folder`
    (`$KETTLE_CACHE`), when the cache refused it; None for anything else (a corrupt source, a bug)."""
    refused = folder_failure(error, folder)
    if refused is None:
        return None
    number, why = refused
    return PreparationError(
        f"Cannot prepare {what} in the cache folder {folder} (KETTLE_CACHE): {why}; {advice(number, 'KETTLE_CACHE')}"
    )


def unexpected_failure(error: BaseException, model: str = "the model") -> str:
    """One line for an error nobody worded, raised while preparing `model` ("the model 'org/name'"): the file and
    cause when it has them, else its type and first line."""
    number, filename = error_number(error), getattr(error, "filename", None)
    if number is not None and filename:
        return f"Preparing {model} failed on {filename}: {cause(number, filename)} (LOG_LEVEL=debug shows where)"
    return f"Preparing {model} failed: {type(error).__name__}: {first_line(error)} (LOG_LEVEL=debug shows where)"


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _inside(path: Path, folder: Path) -> bool:
    return path.absolute().is_relative_to(folder.absolute())


def _file_in_the_way(path: Path) -> Path | None:
    """The nearest of `path` and its parents that exists and is no folder (what made a mkdir or open fail)."""
    for candidate in (path, *path.parents):
        if candidate.exists() or candidate.is_symlink():
            return None if candidate.is_dir() else candidate
    return None
