"""The project is self-contained: no doc, comment or docstring cites a document outside this repository.

The HTTP API is described in docs/api.md and the design in docs/architecture.md; a reference to a file a reader of
the project cannot open (a specification or design note kept elsewhere) fails here, naming the file and line.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHECKED = ("kettle", "tests", "docs", "bench", "deploy", "README.md")
# Spelled in pieces, so that this file does not match itself even if it stopped being excluded.
FORBIDDEN = ("SPEC" + ".md", "DESIGN" + ".md", "SPEC" + " §")
SKIPPED_DIRS = {"__pycache__", ".pytest_cache", ".ruff_cache"}
SKIPPED_SUFFIXES = {".pyc", ".so", ".o", ".gguf", ".safetensors", ".bin", ".pt"}
MAX_BYTES = 2_000_000  # large files here are build outputs or weights, not prose


def checked_files() -> list[Path]:
    files = []
    for name in CHECKED:
        path = ROOT / name
        candidates = [path] if path.is_file() else sorted(path.rglob("*")) if path.is_dir() else []
        for file in candidates:
            if not file.is_file() or file.resolve() == Path(__file__).resolve():
                continue
            if SKIPPED_DIRS & set(file.relative_to(ROOT).parts) or file.suffix in SKIPPED_SUFFIXES:
                continue
            if file.stat().st_size <= MAX_BYTES:
                files.append(file)
    return files


def test_the_checked_tree_is_there() -> None:
    files = {f.relative_to(ROOT).as_posix() for f in checked_files()}
    assert "README.md" in files
    assert "docs/api.md" in files
    assert "kettle/proto/generate.proto" in files


def test_no_reference_to_documents_outside_the_repository() -> None:
    found = []
    for file in checked_files():
        text = file.read_bytes().decode("utf-8", errors="replace")
        for number, line in enumerate(text.splitlines(), start=1):
            for pattern in FORBIDDEN:
                if pattern in line:
                    found.append(f"{file.relative_to(ROOT)}:{number}: {pattern!r}: {line.strip()[:100]}")
    assert not found, "cite docs/api.md or docs/architecture.md instead:\n" + "\n".join(found)
