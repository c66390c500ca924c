"""`kettle launch`: prepare the model (in a child process), then run the shards and the router under the supervisor."""

from __future__ import annotations

import json
import logging
import signal
import threading
from dataclasses import dataclass, field

from kettle.hub import PreparationError, ResolvedModel
from kettle.launcher import tgi_environment
from kettle.launcher.child import Child, stop_children
from kettle.launcher.config import LauncherConfig
from kettle.launcher.prepare import PreparationFailed, prepare_model
from kettle.launcher.sockets import SocketInUse
from kettle.launcher.specs import router_spec, shard_specs
from kettle.launcher.supervisor import Supervisor, clear_sockets
from kettle.logging_setup import setup_logging
from kettle.shard.config import MODEL_FROM_LAUNCHER

log = logging.getLogger("kettle.launcher")


def launch(config: LauncherConfig) -> int:
    """Runs the whole server until it is stopped; returns the process exit code."""
    setup_logging(config.json_output)
    # Until the supervisor takes over, SIGTERM unwinds like Ctrl-C: the model's preparation is then stopped
    # (its child removes its temporary files) and the launcher exits as on Ctrl-C.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    for name in config.inactive_flags_set():
        log.warning("--%s is not active yet: it is accepted for compatibility and has no effect", _flag(name))
    for name in config.no_effect_flags_set():
        log.warning("--%s is accepted for compatibility with TGI and does nothing in Kettle", _flag(name))
    tgi_environment.apply_token_alias()
    _build_kernels_meanwhile()
    early = Early()  # started while the model is prepared (`_start_early`)
    model = _prepared_model(config, early)
    if not isinstance(model, ResolvedModel):
        stop_children(early.children(), config.graceful_termination_timeout)
        code, reason = model
        log.error("%s", reason)  # after the shards' "Stopping" lines: the reason is the output's last line
        return code
    log.info("Model %s ready in %s", model.display_id, model.path)
    early.tell(model)
    # Not joined: the shards import and start loading while the kernels compile, and wait for that build when they
    # need the library (a lock in kettle/hub/cache.py `build_once`), instead of compiling their own copies.
    supervisor = Supervisor(
        shard_specs(config, str(model.path)),
        # With --nnodes, the router runs on node 0 only: it reaches every rank through rank 0's discovery.
        router_spec(config, model) if config.node_rank == 0 else None,
        graceful_timeout=config.graceful_termination_timeout,
        start_timeout=config.shard_start_timeout,
        started=early.shards or None,
        started_router=early.router,
    )
    return supervisor.run()


@dataclass
class Early:
    """The processes started while the model is prepared: this host's shards and, on node 0, the router."""

    shards: list[Child] = field(default_factory=list)
    router: Child | None = None

    def children(self) -> list[Child]:
        return [*self.shards, *([self.router] if self.router else [])]

    def tell(self, model: ResolvedModel) -> None:
        """The prepared model to each: the shards its folder, the router also the name and revision it reports."""
        for shard in self.shards:
            shard.tell(str(model.path))
        if self.router is not None:
            told = {"folder": str(model.path), "model_id": model.display_id, "model_sha": model.sha}
            self.router.tell(json.dumps(told))


def _prepared_model(config: LauncherConfig, early: Early) -> ResolvedModel | tuple[int, str]:
    """The model, resolved and prepared (in a child process: what that imports, transformers and torch, never enters
    the launcher) and checked; or the exit code to stop with and its reason, one line. A preparation that takes a
    while starts the shards and the router beside it, into `early`."""
    try:
        model = prepare_model(config, meanwhile=lambda: _start_early(config, early))
    except (PreparationError, PreparationFailed, SocketInUse) as error:
        return 1, str(error)
    except KeyboardInterrupt:
        return 130, "Stopped while preparing the model"
    try:
        # Custom code without --trust-remote-code, or a type nobody knows: one line here, not a shard traceback.
        from kettle.catalog import check_loadable

        check_loadable(str(model.path), config.trust_remote_code)
        if config.world_size > 1:
            from kettle.catalog import check_tensor_parallel_folder

            check_tensor_parallel_folder(str(model.path), config.world_size)
    except ValueError as error:
        return 1, str(error)
    return model


def _start_early(config: LauncherConfig, early: Early) -> None:
    """Starts this host's shards and the router before the model is ready (a download or a first start's
    conversion): their imports (torch and the model code, ~3 s on 2 cores; the router's ~1 s) run beside the
    preparation, and each reads the folder from its stdin once the launcher has it (`Early.tell`). The router's
    start would otherwise run beside the shard's loading, whose threads fill the cores."""
    specs = shard_specs(config, MODEL_FROM_LAUNCHER)
    clear_sockets(specs)
    log.info("Starting the shards while the model is prepared: they import meanwhile, then load it")
    early.shards.extend(Child(spec, reads_stdin=True) for spec in specs)
    if config.node_rank == 0:  # as `launch`: other hosts run shards only
        early.router = Child(router_spec(config, None), reads_stdin=True)


def _build_kernels_meanwhile() -> None:
    """Compiles the CPU kernels (a first start where the install did not build them; ~11 s of compiler time) on a
    thread while the child process prepares the model (a first start converts a GGUF's metadata in ~4.5 s, one
    core's Python), instead of after it in the shard: on two cores the two overlap, the compilers at a lower
    priority so that the preparation keeps a core, and the build goes on while the shards import. The compilers
    run as subprocesses; nothing here loads torch."""
    from kettle.kernels.build import built_folder

    threading.Thread(target=built_folder, name="kettle-kernel-build", daemon=True).start()


def _flag(name: str) -> str:
    return name.replace("_", "-")
