"""The shard's configuration: every flag of `kettle serve`, validated once at construction."""

from __future__ import annotations

from dataclasses import dataclass

DTYPES = ("float32", "bfloat16", "float16")
QUANTIZE = ("fp8", "int8", "int4", "gptq", "awq")  # kettle/quantization/config.py says where each runs
# `--kv-cache-dtype`: TGI's two float8 formats (CUDA only), and the CPU's 16-bit and float32 caches; "auto" (and
# no flag) is the model's dtype. kettle/shard/dtype.py maps them to torch dtypes per device.
FP8_KV_CACHE_DTYPES = ("fp8_e4m3fn", "fp8_e5m2")
KV_CACHE_DTYPES = ("auto", "float32", "fp16", "bf16", *FP8_KV_CACHE_DTYPES)


def parse_graph_buckets(value: str) -> tuple[int, ...]:
    """Decode-graph batch sizes from "1,2,4" (sorted, deduplicated); "0" or "" means no graphs."""
    try:
        sizes = sorted({int(part) for part in value.split(",") if part.strip()})
    except ValueError:
        sizes = [-1]
    if sizes in ([], [0]):
        return ()
    if sizes[0] < 1:
        raise ValueError(f"--cuda-graphs / KETTLE_CUDA_GRAPHS must list positive batch sizes or be 0, got {value!r}")
    return tuple(sizes)


# The model path of a shard `kettle launch` starts before the model is ready (a first start's preparation): the shard
# imports meanwhile and reads the folder's path from its stdin (kettle/shard/server.py `serve`).
MODEL_FROM_LAUNCHER = "-"


@dataclass(frozen=True)
class ShardConfig:
    """Settings of one shard process (one rank)."""

    model_path: str  # a local folder with config.json, safetensors and tokenizer (resolved by the launcher)
    uds_path: str = "/tmp/kettle-server"  # the socket is f"{uds_path}-{rank}"
    dtype: str | None = None  # None: the device's default (float32 on CPU, bfloat16 on CUDA)
    rank: int = 0
    world_size: int = 1
    trust_remote_code: bool = False
    quantize: str | None = None  # fp8 (CUDA only), int8/int4/gptq/awq (CPU; CUDA opt-in): load_model checks the device
    num_threads: int | None = None  # None: all physical cores
    # Share of the machine's available RAM the KV cache may take on the CPU.
    cpu_kv_cache_fraction: float = 0.1
    # Share of the GPU memory still free once the model is loaded that the KV cache takes on CUDA.
    cuda_memory_fraction: float = 0.9
    # Decode CUDA graph batch sizes ("1,2,4"; "0" disables); None: KETTLE_CUDA_GRAPHS or the default buckets.
    cuda_graphs: str | None = None
    watermark_gamma: float = 0.5
    watermark_delta: float = 2.0
    lora_adapters: str | None = None  # `name=path` or Hub ids, comma-separated (kettle/models/lora_adapters.py)
    speculate: int = 0  # n-gram draft tokens verified per step and request (TGI's --speculate); 0: off
    kv_cache_dtype: str | None = None  # one of KV_CACHE_DTYPES; None: the model's dtype
    # What this shard's packed weights will take, where the launcher knows it ahead: reserved and faulted in while
    # the shard imports (kettle/tensors/weight_arena.py). None: unknown.
    weight_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world size {self.world_size}")
        if not 0.0 < self.cpu_kv_cache_fraction < 1.0:
            raise ValueError("the CPU KV cache fraction must be in (0, 1)")
        if not 0.0 < self.cuda_memory_fraction <= 1.0:
            raise ValueError("--cuda-memory-fraction must be in (0, 1]")
        if self.quantize is not None and self.quantize not in QUANTIZE:
            from kettle.catalog import check_scheme

            check_scheme(self.quantize, "cpu")  # names the alternatives for TGI's values Kettle lacks
            raise ValueError(f"--quantize {self.quantize} is not supported (supported: {', '.join(QUANTIZE)})")
        if self.speculate < 0:
            raise ValueError("--speculate must be >= 0")
        if self.weight_bytes is not None and self.weight_bytes < 0:
            raise ValueError("--weight-bytes must be >= 0")
        if self.kv_cache_dtype is not None and self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}"
            )
        if self.cuda_graphs is not None:
            parse_graph_buckets(self.cuda_graphs)

    @property
    def graph_buckets(self) -> tuple[int, ...] | None:
        """The decode-graph buckets `--cuda-graphs` asks for; None leaves the choice to KETTLE_CUDA_GRAPHS."""
        return None if self.cuda_graphs is None else parse_graph_buckets(self.cuda_graphs)

    @property
    def socket_path(self) -> str:
        return f"{self.uds_path}-{self.rank}"


# Every `kettle serve` flag's default, written once (above): the `serve` and `launch` commands and the launcher's
# config read the shard flags' defaults from here.
SHARD_DEFAULTS = ShardConfig(model_path=MODEL_FROM_LAUNCHER)
