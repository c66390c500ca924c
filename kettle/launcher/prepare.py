"""The model's resolution and preparation in a short-lived child process, as TGI's launcher runs
`text-generation-server download-weights` before it starts the shards.

Resolving a model may download it, prepare a GGUF's config and tokenizer through transformers, or convert pickled
weights through torch: hundreds of MiB of imports and heap. Done in the launcher, they would stay resident for as
long as it supervises (CPython hands little of it back): 344 MiB instead of 37 after a first start of the bundled
model. So the launcher runs `python -m kettle.launcher.prepare` and reads back only the result, the
`ResolvedModel` as a small JSON file; a later start pays one interpreter start and a few light imports (~0.1 s).

The child is started as the shards are (kettle/launcher/child.py): in its own process group and dying with the
launcher. It inherits stdout and stderr, so download bars and log lines reach the user as before, in the same
format (`--json-output` is passed on). A failure comes back in the JSON file too, as one line (what failed, the
file or folder, the cause, what to do: kettle/hub/failures.py) that the launcher logs last; the child writes the
traceback only at `LOG_LEVEL=debug`. Ctrl-C or SIGTERM to the launcher is forwarded as SIGTERM, which the child
turns into KeyboardInterrupt so a conversion in progress removes its temporary folder (kettle/hub/cache.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import kettle
from kettle.hub import ModelNotFound, PreparationError, ResolvedModel, resolve_model
from kettle.hub.resolve import hub_model_cached

if TYPE_CHECKING:
    from kettle.launcher.child import Child
    from kettle.launcher.config import LauncherConfig

log = logging.getLogger(__name__)

# What the child exits with when it was stopped (by the launcher's forwarded SIGTERM), as a shell reports Ctrl-C.
STOPPED_EXIT_CODE = 130
# A preparation of a Hub id still running after this long does real work (a download; a cached model's look-up
# takes ~0.2 s): the launcher's `meanwhile` then starts the shards beside it. A mistyped id fails sooner, without
# starting any. A model on this machine gets them at once (`ModelRequest.on_this_machine`).
SLOW_SECONDS = 0.5


class PreparationFailed(Exception):
    """The child ended without a result: killed by a signal from outside (the kernel's out-of-memory killer, say),
    or crashed in the interpreter itself. The message is one line."""


@dataclass(frozen=True)
class ModelRequest:
    """What to resolve: the launcher's model flags, all the child needs to know."""

    model_id: str | None = None
    revision: str | None = None
    hub_cache: str | None = None
    trust_remote_code: bool = False
    gguf_file: str | None = None
    mmproj: str | None = None
    weights_cache_override: str | None = None

    def on_this_machine(self) -> bool:
        """Whether the model is on this machine (the bundled one, an existing file or folder, a Hub id the Hub cache
        already holds: `hub_model_cached`): no download, no mistyped Hub id. Its look-up or preparation then starts
        the shards and the router beside it at once; a later start's look-up (a Python start, ~0.15 s; ~0.45 s for a
        Hub id) no longer comes before their imports (~1.5 s)."""
        local = self.weights_cache_override or self.model_id
        if local is None or os.path.exists(local):
            return True
        return hub_model_cached(local, self.gguf_file, self.revision, self.hub_cache)

    @classmethod
    def of(cls, config: LauncherConfig) -> ModelRequest:
        """The request `kettle launch` makes with `config`'s flags."""
        return cls(
            model_id=config.model_id,
            revision=config.revision,
            hub_cache=config.huggingface_hub_cache,
            trust_remote_code=config.trust_remote_code,
            gguf_file=config.gguf_file,
            mmproj=config.mmproj,
            weights_cache_override=config.weights_cache_override,
        )


def resolve(request: ModelRequest) -> ResolvedModel:
    """The model folder: --model-id resolved (downloaded, converted; --gguf-file picks a file of it), or with
    --weights-cache-override the local folder it names, served under --model-id's name. Runs in the child."""
    trust = request.trust_remote_code
    if request.weights_cache_override is None:
        return resolve_model(
            request.model_id, request.revision, request.hub_cache, trust, request.gguf_file, request.mmproj
        )
    if not os.path.exists(request.weights_cache_override):
        raise ModelNotFound(
            f"--weights-cache-override {request.weights_cache_override!r} does not exist on this machine"
        )
    local = resolve_model(
        request.weights_cache_override, None, request.hub_cache, trust, request.gguf_file, request.mmproj
    )
    return dataclasses.replace(local, display_id=request.model_id or local.display_id)


def prepare_model(config: LauncherConfig, meanwhile: Callable[[], None] | None = None) -> ResolvedModel:
    """Resolves and prepares `config`'s model in a child process and returns what it resolved to. `meanwhile` runs
    once: at once for a model on this machine, else if the child is still at work after `SLOW_SECONDS` (a download,
    not a cached model's look-up).

    Raises `PreparationError` with the child's one-line reason, `PreparationFailed` when it ended without a result,
    and KeyboardInterrupt (Ctrl-C, or SIGTERM as the launcher maps it) or what `meanwhile` raised once the child
    has stopped and cleaned up.
    """
    from kettle.launcher.child import Child
    from kettle.launcher.specs import ProcessSpec, child_env

    handle, result = tempfile.mkstemp(prefix="kettle-model-", suffix=".json")
    os.close(handle)
    request = ModelRequest.of(config)
    argv = [*kettle.python_command(__name__), result, json.dumps(dataclasses.asdict(request))]
    if config.json_output:
        argv.append("--json-output")
    try:
        child = Child(ProcessSpec("model preparation", tuple(argv), child_env({})))
        try:
            code = _wait(child, meanwhile, 0.0 if request.on_this_machine() else SLOW_SECONDS)
        except BaseException:  # Ctrl-C, or what `meanwhile` raised: the child stops and cleans up first
            _stop(child, config.graceful_termination_timeout)
            raise
        return _read_result(Path(result), code)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(result)


def _wait(child: Child, meanwhile: Callable[[], None] | None, slow: float) -> int:
    try:
        return child.process.wait(timeout=slow)
    except subprocess.TimeoutExpired:
        if meanwhile is not None:
            meanwhile()
        return child.process.wait()


def _stop(child: Child, timeout: float) -> None:
    """SIGTERM to the child, then the wait for it to remove its temporary files (SIGKILL after `timeout`)."""
    from kettle.launcher.child import stop_children

    try:
        stop_children([child], timeout)
    except KeyboardInterrupt:
        # A second Ctrl-C: stop waiting. What the child leaves behind, the next start sweeps (cache.py).
        child.signal_group(signal.SIGKILL)
        child.process.wait()


def _read_result(result: Path, code: int) -> ResolvedModel:
    """The child's answer: a model, or the reason it found none; anything else ends the launch."""
    try:
        answer = json.loads(result.read_text())
    except (OSError, ValueError):
        answer = {}  # it ended before writing one
    if "error" in answer:
        raise PreparationError(answer["error"])
    if code == 0 and "path" in answer:
        return ResolvedModel(Path(answer["path"]), answer["display_id"], answer["sha"])
    if code == STOPPED_EXIT_CODE:
        raise KeyboardInterrupt  # stopped from outside, not by the launcher: the same end as Ctrl-C here
    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    raise PreparationFailed(f"Preparing the model failed: the child process {how} (its output, if any, is above)")


def main(argv: list[str]) -> int:
    """The child: `python -m kettle.launcher.prepare RESULT_FILE REQUEST_JSON [--json-output]`."""
    from kettle.hub import preparation_process
    from kettle.hub.failures import unexpected_failure
    from kettle.logging_setup import setup_logging

    preparation_process.set_up()
    result, request = Path(argv[0]), ModelRequest(**json.loads(argv[1]))
    setup_logging("--json-output" in argv[2:])
    # SIGTERM (forwarded by the launcher) unwinds like Ctrl-C (`set_up`), so a download or conversion in progress
    # removes its temporary files instead of dying mid-write.
    try:
        model = resolve(request)
    except KeyboardInterrupt:
        return STOPPED_EXIT_CODE
    except Exception as error:  # every failure reaches the user as one line, the launcher's last
        log.debug("Preparing the model failed", exc_info=True)
        given = request.weights_cache_override or request.model_id
        what = f"the model {given!r}" if given else "the bundled model"
        line = str(error) if isinstance(error, PreparationError) else unexpected_failure(error, what)
        result.write_text(json.dumps({"error": line.replace("\n", " ")}))
        return 1
    result.write_text(json.dumps({"path": str(model.path), "display_id": model.display_id, "sha": model.sha}))
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # The result is written and closed: skip the interpreter's teardown of what the preparation imported
    # (transformers, torch), which took 1.3 s of a first start on a busy 2-core machine and saves nothing.
    os._exit(code)
