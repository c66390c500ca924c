"""The benchmark's configuration: every flag of `kettle benchmark`, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32)


@dataclass(frozen=True)
class BenchmarkConfig:
    """What to measure and against which shard.

    With `master_shard_uds_path` the benchmark drives an already running shard; without it, it starts its
    own shard on `model_id` (resolved like `kettle launch --model-id`) and stops it at the end. The
    model's tokenizer builds the prompts either way.
    """

    model_id: str | None = None  # Hub id, local folder or .gguf; None: the bundled model
    batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES
    sequence_length: int = 10  # prompt tokens per request, exactly
    decode_length: int = 8  # decode steps timed per run, EOS ignored
    runs: int = 10
    warmups: int = 1
    master_shard_uds_path: str | None = None  # a running shard's rank-0 socket
    dtype: str | None = None  # of the shard the benchmark starts; None: the device's default
    quantize: str | None = None  # `--quantize` of the shard the benchmark starts

    def __post_init__(self) -> None:
        if not self.batch_sizes:
            raise ValueError("--batch-size needs at least one value")
        if any(size < 1 for size in self.batch_sizes):
            raise ValueError("--batch-size values must be >= 1")
        for name in ("sequence_length", "decode_length", "runs"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.warmups < 0:
            raise ValueError("--warmups must be >= 0")
