"""Start-up failures worded as one line: a GGUF file that is no GGUF, cut short or of an architecture nothing reads;
a cache or Hub cache folder that refuses the writes (the system's own errors: /dev/full, a file in the way), told
apart from errors that are not the folder's. The launcher's side (the line printed, no traceback) is in
tests/e2e/test_startup_failures_e2e.py."""

from __future__ import annotations

import socket
import struct

import numpy as np
import pytest
from gguf import GGUFWriter

from kettle.hub import PreparationError, resolve_model
from kettle.hub.download import explain
from kettle.hub.failures import cache_failure, unexpected_failure
from kettle.hub.gguf_header import read_header


@pytest.fixture(autouse=True)
def kettle_cache(tmp_path, monkeypatch):
    cache = tmp_path / "kettle-cache"
    monkeypatch.setenv("KETTLE_CACHE", str(cache))
    return cache


def small_gguf(path, arch: str = "llama"):
    """A well-formed GGUF file with a token list (an array in the header) and two tensors."""
    writer = GGUFWriter(path, arch)
    writer.add_block_count(1)
    writer.add_token_list(["a", "bb", "ccc"] * 20)
    writer.add_tensor("token_embd.weight", np.ones((6, 8), dtype=np.float32))
    writer.add_tensor("output_norm.weight", np.ones(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def no_space_error() -> OSError:
    """The error a write to a full device raises: /dev/full is one that is always full."""
    with open("/dev/full", "wb", buffering=0) as full, pytest.raises(OSError) as raised:
        full.write(b"x")
    return raised.value


@pytest.mark.parametrize("content", [b"", b"\x00" * 64, b"PK\x03\x04 a zip"], ids=["empty", "zeros", "zip"])
def test_a_file_that_does_not_begin_with_gguf_is_named_as_no_gguf_file(tmp_path, content):
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=rf"^{path} is not a GGUF file \(it does not begin with 'GGUF'\)$"):
        read_header(path)


def test_a_header_cut_short_is_named_truncated(tmp_path):
    path = small_gguf(tmp_path / "model.gguf")
    path.write_bytes(path.read_bytes()[:200])  # inside the token list
    with pytest.raises(ValueError, match=rf"^{path} is truncated: its header runs past the end of the file$"):
        read_header(path)


def test_a_value_of_unknown_type_is_named(tmp_path):
    path = tmp_path / "model.gguf"
    key = b"general.architecture"
    # version 3, no tensors, one field of type 99 (GGUF's types end at 12)
    path.write_bytes(b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, len(key)) + key + struct.pack("<I", 99) + b"\0" * 8)
    with pytest.raises(ValueError, match=rf"^{path} is not a readable GGUF file: .* unknown type 99"):
        read_header(path)


def test_a_gguf_whose_tensors_run_past_its_end_fails_before_the_cache_in_one_line(tmp_path, kettle_cache):
    path = small_gguf(tmp_path / "model.gguf")
    whole = path.read_bytes()
    path.write_bytes(whole[:-16])  # a download cut short inside the last tensor
    with pytest.raises(PreparationError) as raised:
        resolve_model(str(path))
    assert str(raised.value) == (
        f"Cannot prepare the model: {path} is truncated (its tensors end at byte {len(whole):,}, the file has "
        f"{len(whole) - 16:,}); download it again or pass another model"
    )
    assert not kettle_cache.exists()  # nothing started in the cache for a file that cannot be prepared


def test_a_gguf_of_an_architecture_nothing_reads_is_named_with_it(tmp_path):
    path = small_gguf(tmp_path / "odd.gguf", arch="nosucharch")
    with pytest.raises(PreparationError, match=rf"^Cannot prepare the model: {path} holds a 'nosucharch' model, "):
        resolve_model(str(path))


def test_a_cache_that_is_a_file_is_named_with_kettle_cache(tmp_path, kettle_cache, monkeypatch):
    kettle_cache.write_text("not a folder")
    with pytest.raises(PreparationError) as raised:
        resolve_model(str(small_gguf(tmp_path / "model.gguf")))
    assert str(raised.value) == (
        f"Cannot prepare model.gguf in the cache folder {kettle_cache} (KETTLE_CACHE): {kettle_cache} is a file "
        "where a folder is expected; move that file away or point KETTLE_CACHE at a folder"
    )


def test_pythons_no_space_error_is_the_caches(tmp_path):
    refused = cache_failure("model.gguf", tmp_path, no_space_error())
    assert str(refused) == (
        f"Cannot prepare model.gguf in the cache folder {tmp_path} (KETTLE_CACHE): no space left on the device; "
        "free space there or point KETTLE_CACHE at a larger folder"
    )


def test_a_rust_librarys_no_space_error_is_the_caches(tmp_path):
    """tokenizers (Rust) raises a plain Exception, its only trace of the cause "(os error 28)" in the message."""
    from tokenizers import Tokenizer, models

    with pytest.raises(Exception, match=r"\(os error 28\)") as raised:
        Tokenizer(models.BPE()).save("/dev/full")
    refused = cache_failure("model.gguf", tmp_path, raised.value)
    assert refused is not None and "(KETTLE_CACHE): no space left on the device; free space there" in str(refused)


def test_an_error_about_a_file_outside_the_cache_is_not_the_caches(tmp_path):
    source = tmp_path / "weights"
    source.write_text("a file")
    with pytest.raises(NotADirectoryError) as raised:
        (source / "model.bin").read_bytes()
    assert cache_failure("weights", tmp_path / "cache", raised.value) is None
    assert unexpected_failure(raised.value) == (
        f"Preparing the model failed on {source / 'model.bin'}: {source} is a file where a folder is expected "
        "(LOG_LEVEL=debug shows where)"
    )


def test_an_error_with_no_number_is_its_type_and_first_line():
    line = unexpected_failure(KeyError("general.architecture"))
    assert line == "Preparing the model failed: KeyError: 'general.architecture' (LOG_LEVEL=debug shows where)"


def test_a_download_the_hub_cache_refuses_names_that_folder(tmp_path):
    line = str(explain("org/model", None, no_space_error(), str(tmp_path / "hub")))
    assert line == (
        f"Model 'org/model' could not be downloaded into the Hugging Face cache folder {tmp_path / 'hub'} "
        "(HUGGINGFACE_HUB_CACHE): no space left on the device; free space there or point HUGGINGFACE_HUB_CACHE at "
        "a larger folder"
    )


def test_a_network_error_is_not_worded_as_the_hub_caches(tmp_path):
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # bound, never listening: a connection is refused
        with pytest.raises(ConnectionRefusedError) as raised, socket.create_connection(("127.0.0.1", port)):
            pass
    line = str(explain("org/model", None, raised.value, str(tmp_path / "hub")))
    assert line.startswith("Model 'org/model' could not be downloaded: ") and "cache" not in line
