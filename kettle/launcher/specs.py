"""Process specs: the exact command line and environment of every child the launcher starts.

Children are started as `python -m kettle.cli ...` with the launcher's own interpreter, so they run the same
Kettle and the same virtual environment whether or not the `kettle` script is on PATH. Their flags are
generated from the ShardConfig / RouterConfig fields, which the `serve` and `router` commands parse back
field by field (kebab-case flags), so the two sides cannot drift apart silently.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import kettle
from kettle import settings
from kettle.hub.resolve import cached_hub_gguf, local_gguf
from kettle.hub.types import ResolvedModel
from kettle.launcher.config import LauncherConfig
from kettle.router.config import MODEL_FROM_LAUNCHER


@dataclass(frozen=True)
class ProcessSpec:
    """One child process: a name for the logs, its argv, its full environment, the socket it serves, and how much
    lower than the launcher's its CPU priority starts (`niceness`)."""

    name: str
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    socket: str | None = None  # the launcher waits until this Unix socket answers before going on
    niceness: int = 0


def kettle_command() -> list[str]:
    """The command that runs Kettle's CLI with this very interpreter and package (with `child_env`)."""
    return kettle.python_command("kettle.cli")


def config_argv(config: object, skip: frozenset[str] = frozenset()) -> list[str]:
    """Flags for a config dataclass: `--field-name value`, flags for true booleans, one per tuple item.

    None and False are left out, so the child falls back to the same default the config has.
    """
    argv: list[str] = []
    for item in dataclasses.fields(config):
        value = getattr(config, item.name)
        flag = "--" + item.name.replace("_", "-")
        if item.name in skip or value is None or value is False:
            continue
        if value is True:
            argv.append(flag)
        elif isinstance(value, tuple | list):
            for element in value:
                argv += [flag, str(element)]
        else:
            argv += [flag, str(value)]
    return argv


def child_env(extra: Mapping[str, str]) -> dict[str, str]:
    """The launcher's environment plus `extra`; Python output unbuffered so child logs appear at once, and this
    package first on the path, so the child runs the launcher's own code (`kettle.python_command`)."""
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = kettle.child_pythonpath(os.environ.get("PYTHONPATH"))
    env.update(extra)
    return env


def shard_spec(config: LauncherConfig, model_path: str, rank: int) -> ProcessSpec:
    """`kettle serve MODEL_PATH ...` for one rank, with the torch.distributed rendezvous variables."""
    shard = config.shard_config(model_path, rank, weight_bytes(config))
    argv = [*kettle_command(), "serve", model_path, *config_argv(shard, skip=frozenset({"model_path"}))]
    if config.json_output:
        argv.append("--json-output")
    if config.otlp_endpoint:
        argv += ["--otlp-endpoint", config.otlp_endpoint, "--otlp-service-name", config.otlp_service_name]
    distributed = {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank - config.ranks.start),  # the GPU index on this host
        "WORLD_SIZE": str(shard.world_size),
        "LOCAL_WORLD_SIZE": str(config.local_shards),
        "MASTER_ADDR": config.master_addr,
        "MASTER_PORT": str(config.master_port),
        **config.shard_environment(),
    }
    return ProcessSpec(f"shard-{rank}", tuple(argv), child_env(distributed), socket=shard.socket_path)


def weight_bytes(config: LauncherConfig) -> int | None:
    """About what one shard's packed weights take, where the launcher knows before the model is prepared: a GGUF
    file on this machine served as stored (no --quantize, no float --dtype) packs into about the file's size, split
    among the ranks; a Hub id's GGUF pick counts once the Hub cache holds it. None otherwise (safetensors, a Hub id
    not yet downloaded, a conversion to another scheme)."""
    if config.quantize is not None or config.dtype is not None:
        return None
    model_id = config.weights_cache_override or config.model_id
    path = local_gguf(model_id, config.gguf_file)
    if path is None and model_id and not Path(model_id).expanduser().exists():
        path = cached_hub_gguf(model_id, config.gguf_file, config.revision, config.huggingface_hub_cache)
    return None if path is None else path.stat().st_size // config.world_size


def shard_specs(config: LauncherConfig, model_path: str) -> list[ProcessSpec]:
    """This host's ranks: all of them, or with --nnodes the block of --node-rank."""
    return [shard_spec(config, model_path, rank) for rank in config.ranks]


def router_spec(config: LauncherConfig, model: ResolvedModel | None) -> ProcessSpec:
    """`kettle router ...` pointed at shard 0's socket and at the resolved model folder's tokenizer; with no model
    (started while it is prepared), told the folder on its stdin (`MODEL_FROM_LAUNCHER`)."""
    if model is None:
        router = config.router_config(MODEL_FROM_LAUNCHER, MODEL_FROM_LAUNCHER)
    else:
        router = config.router_config(str(model.path), model.display_id, model.sha)
    argv = [*kettle_command(), "router", *config_argv(router)]
    # From its first instruction, so that its imports are low priority too (kettle/router/priority.py).
    return ProcessSpec("router", tuple(argv), child_env({}), niceness=settings.current().router_nice)
