"""The shard's configuration: every flag of `kettle serve`, validated once at construction."""

from __future__ import annotations

from dataclasses import dataclass

DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ShardConfig:
    """Settings of one shard process (one rank)."""

    model_path: str  # a local folder with config.json, safetensors and tokenizer (resolved by the launcher)
    uds_path: str = "/tmp/kettle-server"  # the socket is f"{uds_path}-{rank}"
    dtype: str | None = None  # None: the device's default (float32 on CPU, bfloat16 on CUDA)
    rank: int = 0
    world_size: int = 1
    trust_remote_code: bool = False
    quantize: str | None = None
    num_threads: int | None = None  # None: all physical cores
    # Share of the machine's available RAM the KV cache may take on the CPU.
    cpu_kv_cache_fraction: float = 0.1
    watermark_gamma: float = 0.5
    watermark_delta: float = 2.0

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world size {self.world_size}")
        if not 0.0 < self.cpu_kv_cache_fraction < 1.0:
            raise ValueError("the CPU KV cache fraction must be in (0, 1)")

    @property
    def socket_path(self) -> str:
        return f"{self.uds_path}-{self.rank}"
