"""The launcher's configuration: every `kettle launch` flag, validated before anything starts."""

from __future__ import annotations

import dataclasses
import functools
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from kettle import settings
from kettle.hub.adapters import AdapterSource
from kettle.router.config import RouterConfig, ServingFlags
from kettle.shard.config import DTYPES, FP8_KV_CACHE_DTYPES, KV_CACHE_DTYPES, SHARD_DEFAULTS, ShardConfig

# Flags that parse (so TGI command lines keep working) but change nothing yet, with their inert values.
INACTIVE_FLAGS: dict[str, object] = {}
# Flags of TGI that will never mean anything here (the help says why), with their inert values.
NO_EFFECT_FLAGS: dict[str, object] = {"ngrok": False, "ngrok_authtoken": None, "ngrok_edge": None}
# TGI's values for the flags that take one of a few words.
CHOICES: dict[str, tuple[str, ...]] = {
    "rope_scaling": ("linear", "dynamic"),
    "kv_cache_dtype": KV_CACHE_DTYPES,  # TGI's fp8 ones (CUDA), Kettle's fp16 / bf16 / float32 / auto
    "usage_stats": ("on", "off", "no-stack"),
}
# RouterConfig fields the launcher fills from the resolved model rather than from a flag of the same name.
ROUTER_OWN_FIELDS = {"master_shard_uds_path", "tokenizer_name", "model_id", "model_sha", "model_pipeline_tag"}
# A shard must answer on its socket within this many seconds (loading a large model is slow).
DEFAULT_SHARD_START_TIMEOUT = 600.0


def cuda_available() -> bool:
    """Whether the shards will see a CUDA device (asked only when a flag needs to know)."""
    return visible_gpus() > 0


@functools.cache
def visible_gpus() -> int:
    """How many CUDA devices the shards will see (0 without CUDA), as the shards' torch counts them. Asked in a
    short-lived child: torch imported here would stay resident in the launcher (~200 MB) while the server runs."""
    count = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
    return int(subprocess.run([sys.executable, "-c", count], capture_output=True, text=True, check=True).stdout)


def pick_max_input_tokens(max_input_tokens: int | None, max_input_length: int | None) -> int | None:
    """`--max-input-tokens` or its older name `--max-input-length`; giving both is an error, as in TGI."""
    if max_input_tokens is not None and max_input_length is not None:
        raise ValueError("--max-input-tokens and --max-input-length are the same setting: give only one")
    return max_input_tokens if max_input_tokens is not None else max_input_length


@dataclass(frozen=True, kw_only=True)
class LauncherConfig(ServingFlags):
    """Everything `kettle launch` was told (the serving flags it shares with the router, and its own), split into
    the shard and router configs it starts."""

    model_id: str | None = None
    revision: str | None = None
    gguf_file: str | None = None
    mmproj: str | None = None
    sharded: bool | None = None
    num_shard: int | None = None
    quantize: str | None = None
    dtype: str | None = None
    trust_remote_code: bool = False
    huggingface_hub_cache: str | None = None
    lora_adapters: str | None = None
    weights_cache_override: str | None = None
    rope_scaling: str | None = None
    rope_factor: float | None = None
    speculate: int | None = None
    kv_cache_dtype: str | None = None
    shard_uds_path: str | None = None  # None: derived from --port (`uds_prefix`)
    master_addr: str = "localhost"
    master_port: int = 29500
    # Multi-node tensor parallelism: this host runs ranks node_rank*shards .. +shards of nnodes*shards.
    nnodes: int = 1
    node_rank: int = 0
    watermark_gamma: float = SHARD_DEFAULTS.watermark_gamma
    watermark_delta: float = SHARD_DEFAULTS.watermark_delta
    cpu_kv_cache_fraction: float = SHARD_DEFAULTS.cpu_kv_cache_fraction
    cuda_memory_fraction: float = SHARD_DEFAULTS.cuda_memory_fraction
    cuda_graphs: str | None = None
    num_threads: int | None = None
    disable_custom_kernels: bool = False
    usage_stats: str = "on"  # accepted for TGI compatibility; Kettle sends no statistics
    ngrok: bool = False
    ngrok_authtoken: str | None = None
    ngrok_edge: str | None = None
    shard_start_timeout: float = DEFAULT_SHARD_START_TIMEOUT

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_sharding()
        self._check_quantize()
        AdapterSource.parse_list(self.lora_adapters)  # a malformed list fails here, before any process starts
        self._check_gguf_file()
        self._check_mmproj()
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        for name in ("port", "master_port"):
            if not 0 < getattr(self, name) < 65536:
                raise ValueError(f"--{name.replace('_', '-')} must be a TCP port (1-65535)")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError("--num-threads must be >= 1")
        if self.rope_factor is not None and not self.rope_factor > 0:
            raise ValueError("--rope-factor must be > 0")
        if self.speculate is not None and self.speculate < 0:
            raise ValueError("--speculate must be >= 0")
        for name, allowed in CHOICES.items():
            value = getattr(self, name)
            if value is not None and value not in allowed:
                raise ValueError(f"--{name.replace('_', '-')} must be one of {', '.join(allowed)}, got {value!r}")
        if self.kv_cache_dtype in FP8_KV_CACHE_DTYPES and not cuda_available():
            raise ValueError(f"--kv-cache-dtype {self.kv_cache_dtype} needs a CUDA GPU: on the CPU use fp16 or bf16")
        # Building both child configs runs their own checks now, before any process is started.
        self.shard_config("model", rank=0)
        self.router_config("model", "model")

    def _check_sharding(self) -> None:
        if self.num_shard is not None and self.num_shard < 1:
            raise ValueError("--num-shard must be >= 1")
        if self.sharded is False and (self.num_shard or 1) > 1:
            raise ValueError("--sharded false contradicts --num-shard > 1")
        if self.sharded and self.num_shard is None and visible_gpus() < 2:
            raise ValueError(
                "--sharded true without --num-shard uses every visible GPU, and fewer than 2 are visible: "
                "give --num-shard N (on the CPU: N shard processes splitting the cores)"
            )
        gpus = visible_gpus() if self.local_shards > 1 else 0
        if gpus and self.local_shards > gpus:
            raise ValueError(f"--num-shard {self.local_shards} needs {self.local_shards} GPUs, but {gpus} are visible")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(
                f"--node-rank must be in [0, --nnodes) and --nnodes >= 1, got {self.node_rank}/{self.nnodes}"
            )

    def _check_gguf_file(self) -> None:
        if self.gguf_file is None:
            return
        if not self.gguf_file.endswith(".gguf"):
            raise ValueError(f"--gguf-file names a .gguf file, got {self.gguf_file!r}")
        if self.model_id is None and self.weights_cache_override is None:
            raise ValueError("--gguf-file names a file of the --model-id repository (or folder): give --model-id too")

    def _check_mmproj(self) -> None:
        if self.mmproj is None:
            return
        if not self.mmproj.endswith(".gguf"):
            raise ValueError(f"--mmproj names a projector .gguf file (llama.cpp's mmproj-*.gguf), got {self.mmproj!r}")
        if self.model_id is None and self.weights_cache_override is None:
            raise ValueError("--mmproj serves the images of a GGUF --model-id: give --model-id too")

    def _check_quantize(self) -> None:
        from kettle.catalog import check_scheme

        # The shard runs on CUDA when a GPU is visible, else on the CPU (kettle.shard.server.choose_device).
        check_scheme(self.quantize, "cuda" if self.quantize and cuda_available() else "cpu")

    @property
    def local_shards(self) -> int:
        """Shards on this host: --num-shard; with `--sharded true` alone, every visible GPU."""
        if self.num_shard is None and self.sharded:
            return visible_gpus()
        return self.num_shard or 1

    @property
    def world_size(self) -> int:
        """Ranks in the tensor-parallel group over all hosts (--nnodes of them, each with local_shards)."""
        return self.local_shards * self.nnodes

    @property
    def ranks(self) -> range:
        """The global ranks this host runs."""
        return range(self.node_rank * self.local_shards, (self.node_rank + 1) * self.local_shards)

    def inactive_flags_set(self) -> list[str]:
        """The not-yet-active flags given a value other than their inert one (the launcher warns about them)."""
        return [name for name, inert in INACTIVE_FLAGS.items() if getattr(self, name) != inert]

    def no_effect_flags_set(self) -> list[str]:
        """The never-active flags given a value other than their inert one (the launcher says they do nothing)."""
        return [name for name, inert in NO_EFFECT_FLAGS.items() if getattr(self, name) != inert]

    @property
    def uds_prefix(self) -> str:
        """Where the shard sockets go: --shard-uds-path, else a name with the HTTP port in it, so that servers
        on one machine (each on its own port) never share sockets."""
        if self.shard_uds_path is not None:
            return self.shard_uds_path
        return os.path.join(tempfile.gettempdir(), f"kettle-server-{self.port}")

    @property
    def rope(self) -> tuple[str, float] | None:
        """The RoPE override as TGI resolves the two flags: a factor alone is linear, a type alone has factor 1."""
        if self.rope_scaling is None and self.rope_factor is None:
            return None
        return self.rope_scaling or "linear", self.rope_factor if self.rope_factor is not None else 1.0

    def shard_environment(self) -> dict[str, str]:
        """Variables the shards read besides their flags: the RoPE override and the kernels switches (added to the
        launcher's own KETTLE_TUNING items)."""
        env: dict[str, str] = {}
        if self.rope is not None:
            env["ROPE_SCALING"], factor = self.rope[0], self.rope[1]
            env["ROPE_FACTOR"] = repr(factor)
        if self.disable_custom_kernels:
            off = {"cpu-kernels": False, "cuda-fused-kernels": False}
            env[settings.TUNING_VARIABLE] = settings.merge_tuning(os.environ.get(settings.TUNING_VARIABLE), off)
        return env

    def shard_config(self, model_path: str, rank: int, weight_bytes: int | None = None) -> ShardConfig:
        return ShardConfig(
            model_path=model_path,
            uds_path=self.uds_prefix,
            dtype=self.dtype,
            rank=rank,
            world_size=self.world_size,
            trust_remote_code=self.trust_remote_code,
            quantize=self.quantize,
            num_threads=self.num_threads,
            cpu_kv_cache_fraction=self.cpu_kv_cache_fraction,
            cuda_memory_fraction=self.cuda_memory_fraction,
            cuda_graphs=self.cuda_graphs,
            watermark_gamma=self.watermark_gamma,
            watermark_delta=self.watermark_delta,
            lora_adapters=self.lora_adapters,
            speculate=self.speculate or 0,
            kv_cache_dtype=self.kv_cache_dtype,
            weight_bytes=weight_bytes,
        )

    def router_config(self, tokenizer_name: str, model_id: str, model_sha: str | None = None) -> RouterConfig:
        """The router's settings: the fields it shares with the launcher by name, plus where the model is."""
        shared = {
            field.name: getattr(self, field.name)
            for field in dataclasses.fields(RouterConfig)
            if field.name not in ROUTER_OWN_FIELDS and hasattr(self, field.name)
        }
        return RouterConfig(
            master_shard_uds_path=f"{self.uds_prefix}-0",
            tokenizer_name=tokenizer_name,
            model_id=model_id,
            model_sha=model_sha,
            adapters=tuple(source.name for source in AdapterSource.parse_list(self.lora_adapters)),
            launcher_pid=os.getpid(),  # this process: the router reports its memory beside its own
            **shared,
        )
