"""`kettle launch` failing before any shard loads a model: exit code 1, no traceback, and the output ends with
one ERROR line naming the file or folder, the cause and what to do (the traceback only at LOG_LEVEL=debug).

The cache cases run on a real small or read-only tmpfs, mounted in a mount namespace of their own (`unshare`,
as root or in a user namespace): the writes fail as they would on a full disk or a read-only volume."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from kettle.bench.process import KETTLE, free_port
from tests.unit.test_startup_failures import small_gguf

pytestmark = pytest.mark.e2e

# Mounts a tmpfs with the options $1 on $2, then runs the rest of the command line in that mount namespace.
MOUNTED = 'mount -t tmpfs -o "$1" tmpfs "$2" || exit 90; shift 2; exec "$@"'
UNSHARE = ("unshare", "--mount", "--map-root-user")


@pytest.fixture(scope="module")
def mount_namespace(tmp_path_factory) -> tuple[str, ...]:
    """The command prefix that runs a command in a new mount namespace where it may mount a tmpfs."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare (util-linux) to mount a small tmpfs")
    point = tmp_path_factory.mktemp("mount-probe")
    probe = subprocess.run([*UNSHARE, "mount", "-t", "tmpfs", "tmpfs", str(point)], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a mount namespace here: {probe.stderr.strip()}")
    return UNSHARE


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = os.environ | {"KETTLE_CACHE": str(tmp_path / "cache")}
    env.pop("LOG_LEVEL", None)  # the default level: a test that wants the traceback asks for it
    return env | extra


def _launch_argv(tmp_path: Path, *flags: str) -> list[str]:
    # Its own shard socket: a first start starts the shards beside the preparation, and clears their socket paths.
    return [KETTLE, "launch", "--port", str(free_port()), "--shard-uds-path", str(tmp_path / "shard"), *flags]


def _launch(tmp_path: Path, *flags: str, prefix: tuple[str, ...] = (), **env: str) -> subprocess.CompletedProcess:
    argv = [*prefix, *_launch_argv(tmp_path, *flags)]
    return subprocess.run(argv, env=_env(tmp_path, **env), capture_output=True, text=True, timeout=120)


def _the_error_line(result: subprocess.CompletedProcess) -> str:
    """The one ERROR line of a launch that failed as it should: exit code 1, no traceback, the line last."""
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "Traceback" not in output
    errors = [line for line in result.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1, output
    assert result.stderr.strip().splitlines()[-1] == errors[0], output
    return errors[0].split(" ERROR kettle.launcher: ", 1)[1]


def test_a_full_cache_fails_in_one_line_and_the_next_start_prepares_the_model(tmp_path, mount_namespace):
    """A 1 MiB cache fills while the bundled model's tokenizer is written (tokenizers' Rust error names no folder):
    the line names the folder and KETTLE_CACHE. Given space, the next preparation builds the folder whole: the
    failed one left nothing a later start could take for a finished folder."""
    cache, logs = tmp_path / "cache", tmp_path / "logs"
    cache.mkdir()
    logs.mkdir()
    # In one mount namespace: the launch on the full tmpfs, what it left in the cache, the tmpfs grown, then
    # `kettle download-weights` (the same preparation, in process) and the files of the folder it printed.
    script = (
        'mount -t tmpfs -o size=1m tmpfs "$CACHE" || exit 90; "$@" 2> "$LOGS/first"; echo $? > "$LOGS/code"; '
        'ls -A "$CACHE/models" > "$LOGS/left"; mount -o remount,size=64m "$CACHE" || exit 91; '
        '"$KETTLE" download-weights > "$LOGS/folder" 2> "$LOGS/second" || exit 92; '
        'ls "$(cat "$LOGS/folder")" > "$LOGS/files"'
    )
    env = _env(tmp_path, CACHE=str(cache), LOGS=str(logs), KETTLE=KETTLE)
    argv = [*mount_namespace, "sh", "-c", script, "sh", *_launch_argv(tmp_path)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr + "".join(log.read_text() for log in logs.iterdir())
    first = subprocess.CompletedProcess([], int((logs / "code").read_text()), "", (logs / "first").read_text())
    assert _the_error_line(first) == (
        f"Cannot prepare SmolLM2-135M-Instruct.Q4_1.gguf in the cache folder {cache} (KETTLE_CACHE): no space left "
        "on the device; free space there or point KETTLE_CACHE at a larger folder"
    )
    assert (logs / "left").read_text() == ""  # no half-written folder, no temporary one, no lock
    assert Path((logs / "folder").read_text().strip()).parent == cache / "models"
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "model.gguf"} <= set(
        (logs / "files").read_text().split()
    )


def test_a_read_only_cache_fails_at_once_in_one_line(tmp_path, mount_namespace):
    cache = tmp_path / "cache"
    cache.mkdir()
    result = _launch(tmp_path, prefix=(*mount_namespace, "sh", "-c", MOUNTED, "sh", "ro,size=1m", str(cache)))
    assert _the_error_line(result) == (
        f"Cannot prepare SmolLM2-135M-Instruct.Q4_1.gguf in the cache folder {cache} (KETTLE_CACHE): the file "
        "system is read-only; point KETTLE_CACHE at a writable folder"
    )


def test_a_cache_below_a_file_fails_in_one_line_naming_the_file(tmp_path):
    (tmp_path / "cache").write_text("a file, where KETTLE_CACHE's folder should be")
    result = _launch(tmp_path, KETTLE_CACHE=str(tmp_path / "cache" / "kettle"))
    assert _the_error_line(result) == (
        f"Cannot prepare SmolLM2-135M-Instruct.Q4_1.gguf in the cache folder {tmp_path / 'cache' / 'kettle'} "
        f"(KETTLE_CACHE): {tmp_path / 'cache'} is a file where a folder is expected; move that file away or point "
        "KETTLE_CACHE at a folder"
    )


def test_a_missing_model_path_fails_in_one_line(tmp_path):
    missing = tmp_path / "models" / "nowhere.gguf"
    result = _launch(tmp_path, "--model-id", str(missing))
    assert _the_error_line(result) == (
        f"Model '{missing}' does not exist on this machine (no such file or folder); check the path given to "
        "--model-id, or give a Hub model id (org/name)"
    )


def test_a_folder_that_is_no_model_fails_in_one_line(tmp_path):
    folder = tmp_path / "photos"
    folder.mkdir()
    (folder / "cat.jpg").write_bytes(b"\xff\xd8\xff")
    result = _launch(tmp_path, "--model-id", str(folder))
    line = _the_error_line(result)
    assert line.startswith(f"Folder {folder} is not a model folder: it has no config.json; pass a folder with ")


def test_random_bytes_named_gguf_fail_in_one_line_and_debug_shows_the_traceback(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(os.urandom(4096).replace(b"GGUF", b"...."))
    line = _the_error_line(_launch(tmp_path, "--model-id", str(path)))
    assert line == (
        f"Cannot prepare the model: {path} is not a GGUF file (it does not begin with 'GGUF'); download it again or "
        "pass another model"
    )
    debug = _launch(tmp_path, "--model-id", str(path), LOG_LEVEL="debug")
    assert debug.returncode == 1
    assert "Traceback" in debug.stderr and debug.stderr.strip().splitlines()[-1].endswith(line)


def test_a_gguf_cut_short_fails_in_one_line_before_the_cache(tmp_path):
    path = small_gguf(tmp_path / "model.gguf")
    size = path.stat().st_size
    with open(path, "r+b") as file:  # a download that stopped 16 bytes short
        file.truncate(size - 16)
    line = _the_error_line(_launch(tmp_path, "--model-id", str(path)))
    assert line == (
        f"Cannot prepare the model: {path} is truncated (its tensors end at byte {size:,}, the file has "
        f"{size - 16:,}); download it again or pass another model"
    )
    assert not (tmp_path / "cache" / "models").exists()


def test_an_error_nobody_worded_is_still_one_line_naming_the_model(tmp_path):
    """A GGUF file without a tokenizer gets past every check and fails inside transformers: the line is its type and
    first line, with the model it was preparing; the traceback stays at LOG_LEVEL=debug."""
    path = small_gguf(tmp_path / "model.gguf")  # no tokenizer.ggml.* metadata
    line = _the_error_line(_launch(tmp_path, "--model-id", str(path)))
    assert line.startswith(f"Preparing the model '{path}' failed: ValueError: ")
    assert line.endswith("(LOG_LEVEL=debug shows where)")
