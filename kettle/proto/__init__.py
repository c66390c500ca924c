"""The shard protocol: `generate.proto` and its Python stubs.

The stubs are generated from the proto file (never edited by hand). `make install` generates them; importing
this package generates them too when they are missing or were made from another version of the proto (a hash
stamp records which), so a fresh checkout works. Where grpcio-tools is absent, existing stubs are used as is.
"""

from __future__ import annotations

import hashlib
import importlib
from pathlib import Path

_HERE = Path(__file__).parent
_PROTO = _HERE / "generate.proto"
_STUBS = (_HERE / "generate_pb2.py", _HERE / "generate_pb2_grpc.py")
_STAMP = _HERE / "generate.sha256"


def generate_stubs() -> None:
    """Runs protoc (from grpcio-tools) on generate.proto, writing the stubs beside it."""
    from grpc_tools import protoc

    args = ["protoc", f"-I{_HERE}", f"--python_out={_HERE}", f"--grpc_python_out={_HERE}", str(_PROTO)]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {_PROTO}")
    # The generated grpc module imports `generate_pb2` as a top-level module; make it package-relative.
    grpc_stub = _STUBS[1]
    text = grpc_stub.read_text()
    grpc_stub.write_text(text.replace("import generate_pb2 as", "from . import generate_pb2 as"))
    _STAMP.write_text(_proto_hash())


def _proto_hash() -> str:
    return hashlib.sha256(_PROTO.read_bytes()).hexdigest()


def _ensure_stubs() -> None:
    missing = not all(s.exists() for s in _STUBS)
    stale = not _STAMP.exists() or _STAMP.read_text() != _proto_hash()
    if missing or stale:
        try:
            generate_stubs()
        except ImportError:
            if missing:
                raise


_ensure_stubs()

generate_pb2 = importlib.import_module(".generate_pb2", __name__)
generate_pb2_grpc = importlib.import_module(".generate_pb2_grpc", __name__)

__all__ = ["generate_pb2", "generate_pb2_grpc", "generate_stubs"]
