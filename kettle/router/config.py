"""The router's configuration: every flag of `kettle router`, validated once at construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from kettle import settings


@dataclass(frozen=True, kw_only=True)
class ServingFlags:
    """The flags `kettle launch` and `kettle router` share, with their defaults: the one place each default is
    written. Both commands' signatures take their defaults from `SERVING_DEFAULTS`, and `RouterConfig` and the
    launcher's config inherit these fields and their checks."""

    hostname: str = "0.0.0.0"
    port: int = 3000
    max_concurrent_requests: int = 128
    max_best_of: int = 2
    max_stop_sequences: int = 4
    max_top_n_tokens: int = 5
    max_input_tokens: int | None = None
    max_total_tokens: int | None = None
    waiting_served_ratio: float = 0.3
    max_batch_prefill_tokens: int | None = None
    max_batch_total_tokens: int | None = None
    max_waiting_tokens: int = 20
    max_batch_size: int | None = None
    validation_workers: int = 2
    max_client_batch_size: int = 4
    payload_limit: int = 2_000_000
    api_key: str | None = None
    cors_allow_origin: tuple[str, ...] = ()
    json_output: bool = False
    otlp_endpoint: str | None = None
    otlp_service_name: str = "kettle"
    prometheus_port: int = 9000  # 0: no separate metrics listener
    disable_grammar_support: bool = False
    tokenizer_config_path: str | None = None
    enable_prefill_logprobs: bool = False
    disable_prefix_caching: bool = False
    disable_chunked_prefill: bool = False
    graceful_termination_timeout: float = 90.0
    # Images in prompts (a model that takes them): per request, per image, and the URL fetch.
    max_images_per_request: int = 8
    max_image_bytes: int = 20_000_000
    max_image_pixels: int = 4096 * 4096
    image_fetch_timeout: float = 10.0
    disable_image_fetch: bool = False

    def __post_init__(self) -> None:
        positive = ("max_concurrent_requests", "max_best_of", "validation_workers", "max_client_batch_size")
        positive += ("max_images_per_request", "max_image_bytes", "max_image_pixels")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        both = self.max_input_tokens is not None and self.max_total_tokens is not None
        if both and self.max_input_tokens >= self.max_total_tokens:
            raise ValueError("--max-input-tokens must be < --max-total-tokens")
        if not 0 <= self.prometheus_port < 65536:
            raise ValueError("--prometheus-port must be a TCP port (1-65535) or 0 (off)")
        if not self.waiting_served_ratio >= 0.0:
            raise ValueError("--waiting-served-ratio must be >= 0")
        if self.graceful_termination_timeout < 0:
            raise ValueError("--graceful-termination-timeout must be >= 0")
        if not self.image_fetch_timeout > 0:
            raise ValueError("--image-fetch-timeout must be > 0")


SERVING_DEFAULTS = ServingFlags()
# The `--tokenizer-name` of a router the launcher starts while it still prepares the model: the router then reads
# the model's folder, name and revision from its stdin (server.py `model_from_launcher`).
MODEL_FROM_LAUNCHER = "-"


@dataclass(frozen=True, kw_only=True)
class RouterConfig(ServingFlags):
    """Settings of the HTTP router: the serving flags, and where the shards and the model are. Token limits left
    as None are chosen at warmup (server.py)."""

    master_shard_uds_path: str
    tokenizer_name: str  # local folder holding the tokenizer (the resolved model folder)
    model_id: str  # the name /info and /v1/models report
    model_sha: str | None = None
    model_pipeline_tag: str = "text-generation"
    adapters: tuple[str, ...] = ()  # the LoRA adapters the shards loaded, by the names requests use
    launcher_pid: int | None = None  # the `kettle launch` that started this router: its memory is a gauge here


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """Batching limits, final once warmup has chosen the token limits and the KV cache size."""

    max_batch_prefill_tokens: int
    max_batch_total_tokens: int
    max_batch_size: int | None = None
    waiting_served_ratio: float = SERVING_DEFAULTS.waiting_served_ratio
    max_waiting_tokens: int = SERVING_DEFAULTS.max_waiting_tokens
    block_size: int
    num_blocks: int
    prefix_caching: bool = True  # reuse the KV blocks of shared prompt prefixes (`--disable-prefix-caching`)
    # Split long prompts under max_batch_prefill_tokens and run the chunks with the decodes in one forward
    # (`--disable-chunked-prefill` returns to TGI's v2 rule: whole prefills in their own forward).
    chunked_prefill: bool = True
    # Size the chunks that run beside decodes from measured step times (kettle/router/chunk_budget.py);
    # KETTLE_TUNING=adaptive-chunks=off: every step may compute max_batch_prefill_tokens prompt tokens.
    adaptive_chunks: bool = field(default_factory=lambda: settings.current().adaptive_chunks)
    # Several decode steps per shard call while the batch is settled, within this window (kettle/router/
    # decode_steps.py); KETTLE_TUNING=decode-window-ms=0: one step per call.
    decode_window_ms: float = field(default_factory=lambda: settings.current().decode_window_ms)
    # /health turns 503 when work waits and the loop has not moved for this long (or 4x its slowest step).
    stall_timeout: float = 120.0

    def __post_init__(self) -> None:
        for name in ("max_batch_prefill_tokens", "max_batch_total_tokens", "block_size", "num_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_batch_prefill_tokens > self.max_batch_total_tokens:
            raise ValueError("max_batch_prefill_tokens must be <= max_batch_total_tokens")
        if self.max_batch_size is not None and self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.waiting_served_ratio < 0 or self.max_waiting_tokens < 0:
            raise ValueError("waiting_served_ratio and max_waiting_tokens must be >= 0")
