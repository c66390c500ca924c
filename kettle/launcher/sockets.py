"""The shards' Unix sockets: clearing stale ones before a start, and knowing when a shard answers.

Readiness is a plain `connect()`: a gRPC server creates its socket only when it starts serving, so an
accepted connection means the shard is up. A raw socket keeps grpc (and its background threads) out of the
launcher, which forks children and must stay single-threaded for that to be safe.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat
from pathlib import Path

log = logging.getLogger(__name__)


class SocketInUse(RuntimeError):
    """A live server already listens on a socket path the launcher was told to use."""


def answers(path: str, timeout: float = 1.0) -> bool:
    """True if something accepts connections on the Unix socket at `path`."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(timeout)
        try:
            probe.connect(path)
        except OSError:
            return False
    return True


def clear_stale(path: str) -> None:
    """Removes a socket left by a crashed run; refuses to steal one a running server still answers on."""
    target = Path(path)
    if not target.exists() and not target.is_symlink():
        return
    if not stat.S_ISSOCK(target.lstat().st_mode):
        raise SocketInUse(f"{path} exists and is not a socket; choose another --shard-uds-path")
    if answers(path):
        raise SocketInUse(f"another server is listening on {path}; stop it or choose another --shard-uds-path")
    log.info("Removing stale socket %s", path)
    remove(path)


def remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
