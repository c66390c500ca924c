"""Memory for the packed weights reserved and faulted in while a shard imports (kettle/tensors/weight_arena.py): the
pages come in on their own thread, the load's large tensors are cut from them zeroed and apart, and what the load did
not take goes back; the launcher asks for it only where it knows the size (a GGUF file here, served as stored)."""

from __future__ import annotations

import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from kettle import process_memory
from kettle.cli import app
from kettle.launcher.config import LauncherConfig
from kettle.launcher.specs import shard_spec, weight_bytes
from kettle.tensors import huge_pages, weight_arena
from tests.fixtures import tune, vma_of

MIB = 2**20
linux = pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads /proc/self/smaps")


def resident_kib(address: int) -> int:
    return int(vma_of(address)["Rss"].split()[0])


def wait_faulted(arena: weight_arena.WeightArena, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while arena.faulted < arena.size and time.monotonic() < deadline:
        time.sleep(0.01)


@linux
def test_the_pages_fault_in_before_anything_writes_them_and_the_unused_part_goes_back():
    arena = weight_arena.WeightArena(16 * MIB)
    address = weight_arena._address(arena.mapping)
    wait_faulted(arena)
    assert resident_kib(address) * 1024 >= arena.size  # all in, with nothing written
    assert arena.take(5 * MIB) == (arena.mapping, 0)
    arena.close()
    assert resident_kib(address) * 1024 <= 6 * MIB  # the 5 MiB taken, rounded up to whole huge pages, stay
    assert arena.take(MIB) is None


def test_pieces_are_zero_aligned_and_apart_until_it_is_full():
    arena = weight_arena.WeightArena(8 * MIB)
    first = arena.take(3 * MIB + 5)
    second = arena.take(MIB)
    assert first == (arena.mapping, 0)
    assert second == (arena.mapping, 3 * MIB + 64)  # the next cache line after the first piece
    assert arena.take(arena.size) is None  # too large for what is left: the caller maps its own
    assert not any(arena.mapping[: 4 * MIB + 64])
    arena.close()


@pytest.mark.parametrize("round_", range(3))
def test_a_piece_written_before_the_thread_reaches_it_keeps_what_was_written(round_):
    """The load writes its pieces at once, while the faulting thread may still be behind them: the thread never writes
    over a piece taken (its zeros wiped packed weights when it did: this test's piece, cut far ahead of the thread, came
    back zero)."""
    arena = weight_arena.WeightArena(64 * MIB)
    ahead = arena.take(48 * MIB)
    piece = arena.take(8 * MIB)
    assert ahead is not None and piece is not None
    view = memoryview(arena.mapping)[piece[1] : piece[1] + 8 * MIB]
    view[:] = b"\x07" * (8 * MIB)
    del view
    wait_faulted(arena)  # the thread has passed the end
    assert arena.mapping[piece[1] : piece[1] + 8 * MIB] == b"\x07" * (8 * MIB)
    arena.close()


def test_the_load_s_large_tensors_come_from_the_reservation_until_it_closes(monkeypatch):
    monkeypatch.setattr(weight_arena, "_current", None)
    weight_arena.reserve(8 * MIB)
    arena = weight_arena._current
    start = weight_arena._address(arena.mapping)
    packed = huge_pages.empty(1024, 2048, dtype=torch.int16)  # 4 MiB
    zeros = huge_pages.zeros(2 * MIB, dtype=torch.uint8)
    assert packed.data_ptr() == start and zeros.data_ptr() == start + 4 * MIB
    assert not zeros.any()
    packed.fill_(7)
    assert not zeros.any()  # apart
    small = huge_pages.empty(16, dtype=torch.float32)  # below a huge page: PyTorch's, not the reservation's
    assert not start <= small.data_ptr() < start + arena.size
    weight_arena.close()
    later = huge_pages.empty(2 * MIB, dtype=torch.uint8)
    assert not start <= later.data_ptr() < start + arena.size
    assert packed.eq(7).all()  # the tensors cut from it keep their memory after the close


def test_nothing_is_reserved_below_a_huge_page_or_with_huge_pages_off(monkeypatch):
    monkeypatch.setattr(weight_arena, "_current", None)
    weight_arena.reserve(MIB)
    assert weight_arena._current is None
    tune(monkeypatch, "huge-pages=off")
    weight_arena.reserve(64 * MIB)
    assert weight_arena._current is None and weight_arena.take(MIB) is None


def test_the_launcher_asks_for_a_local_gguf_s_size_when_it_is_served_as_stored(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"\0" * 3000)
    assert weight_bytes(LauncherConfig(model_id=str(gguf))) == 3000
    assert weight_bytes(LauncherConfig(model_id=str(tmp_path), gguf_file="model.gguf")) == 3000
    spec = shard_spec(LauncherConfig(model_id=str(gguf)), "/models/m", rank=0)
    assert spec.argv[spec.argv.index("--weight-bytes") + 1] == "3000"
    # Converted to another scheme, dequantized, or not on this machine: the size is not known ahead.
    assert weight_bytes(LauncherConfig(model_id=str(gguf), quantize="int8")) is None
    assert weight_bytes(LauncherConfig(model_id=str(gguf), dtype="float32")) is None
    assert weight_bytes(LauncherConfig(model_id="org/model")) is None
    assert "--weight-bytes" not in shard_spec(LauncherConfig(model_id="org/model"), "/m", rank=0).argv


def test_a_folder_s_one_gguf_or_a_prepared_folder_s_link_is_sized_too(tmp_path):
    """A folder served from its one GGUF file, and a prepared folder (config.json beside the link to its GGUF, as
    `bench peers --shape` serves its files) reserve the file's size; a folder of safetensors or of several GGUF
    files does not (its weights are not known ahead)."""
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "model-Q4_K_M.gguf").write_bytes(b"\0" * 3000)
    (alone / "mmproj-model-f16.gguf").write_bytes(b"\0" * 500)  # a projector beside it is not the model
    assert weight_bytes(LauncherConfig(model_id=str(alone))) == 3000
    prepared = tmp_path / "prepared"
    prepared.mkdir()
    (prepared / "config.json").write_text("{}")
    (prepared / "model.gguf").symlink_to(alone / "model-Q4_K_M.gguf")
    assert weight_bytes(LauncherConfig(model_id=str(prepared))) == 3000
    (alone / "model-Q8_0.gguf").write_bytes(b"\0" * 6000)
    assert weight_bytes(LauncherConfig(model_id=str(alone))) is None  # several: --gguf-file picks one
    safetensors = tmp_path / "safetensors"
    safetensors.mkdir()
    (safetensors / "config.json").write_text("{}")
    (safetensors / "model.safetensors").write_bytes(b"\0" * 100)
    assert weight_bytes(LauncherConfig(model_id=str(safetensors))) is None


def test_a_hub_gguf_pick_is_sized_once_the_hub_cache_holds_it(tmp_path):
    """`org/name:TAG` (or --gguf-file) in huggingface_hub's cache layout: the file the cached snapshot of the revision
    holds for that pick; nothing for a pick or revision the cache lacks, nor for a Hub id without a pick."""
    repo = tmp_path / "models--org--name"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "name-Q4_K_M.gguf").write_bytes(b"\0" * 3000)
    (snapshot / "name-Q8_0.gguf").write_bytes(b"\0" * 6000)
    (snapshot / "mmproj-name-Q8_0.gguf").write_bytes(b"\0" * 500)
    cache = {"huggingface_hub_cache": str(tmp_path)}
    assert weight_bytes(LauncherConfig(model_id="org/name:Q4_K_M", **cache)) == 3000
    assert weight_bytes(LauncherConfig(model_id="org/name:q8_0", **cache)) == 6000  # the projector is not the model
    assert weight_bytes(LauncherConfig(model_id="org/name", gguf_file="name-Q8_0.gguf", **cache)) == 6000
    assert weight_bytes(LauncherConfig(model_id="org/name:Q4_K_M", num_shard=2, **cache)) == 1500
    assert weight_bytes(LauncherConfig(model_id="org/name:Q5_K_M", **cache)) is None  # not downloaded
    assert weight_bytes(LauncherConfig(model_id="org/name:Q4_K_M", revision="v2", **cache)) is None
    assert weight_bytes(LauncherConfig(model_id="org/name", **cache)) is None  # safetensors, or a choice to make
    assert weight_bytes(LauncherConfig(model_id="org/other:Q4_K_M", **cache)) is None
    assert weight_bytes(LauncherConfig(model_id="org/name:Q4_K_M", quantize="int8", **cache)) is None


def test_each_rank_asks_for_its_share(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"\0" * 3000)
    assert weight_bytes(LauncherConfig(model_id=str(gguf), num_shard=2)) == 1500


def test_the_shard_command_reserves_first(monkeypatch):
    """`kettle serve --weight-bytes N` keeps freed memory for reuse and reserves N bytes before it imports the shard's
    server (and torch)."""
    order = []
    monkeypatch.setattr(process_memory, "reuse_freed_memory", lambda: order.append(("reuse", None)))
    monkeypatch.setattr(weight_arena, "reserve", lambda nbytes: order.append(("reserve", nbytes)))
    server = types.SimpleNamespace(serve=lambda config: order.append(("serve", config.weight_bytes)))
    monkeypatch.setitem(sys.modules, "kettle.shard.server", server)
    result = CliRunner().invoke(app, ["serve", "/m", "--weight-bytes", "5000000"], env={"RANK": "", "WORLD_SIZE": ""})
    assert result.exit_code == 0, result.output
    assert order == [("reuse", None), ("reserve", 5000000), ("serve", 5000000)]


def test_the_reservation_imports_no_torch():
    code = (
        "import sys\n"
        "from kettle.tensors import weight_arena\n"
        "weight_arena.reserve(4 * 2**20)\n"
        "assert weight_arena._current is not None and 'torch' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
