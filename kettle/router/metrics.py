"""Prometheus metrics with TGI's names (docs/api.md, Info, health and metrics), so existing TGI dashboards work
unchanged.

Request-level metrics are recorded by the route handlers, batch-level ones by the scheduler.
"""

from __future__ import annotations

import math
import re
from typing import Protocol

from prometheus_client import Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from kettle.process_memory import resident_bytes

# `*_created` series are noise for dashboards built on TGI's exporter, which has none.
disable_created_metrics()

# Durations in seconds: from sub-millisecond validation to multi-minute generations.
_DURATION_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_PER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2)
_TOKEN_BUCKETS = (1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

REQUEST_COUNT = Counter("tgi_request_count", "Requests received")
REQUEST_SUCCESS = Counter("tgi_request_success", "Requests answered successfully")
REQUEST_FAILURE = Counter("tgi_request_failure", "Requests failed, by error type", ["err"])

REQUEST_DURATION = Histogram("tgi_request_duration", "End-to-end request duration (s)", buckets=_DURATION_BUCKETS)
REQUEST_VALIDATION_DURATION = Histogram(
    "tgi_request_validation_duration", "Validation and tokenization duration (s)", buckets=_DURATION_BUCKETS
)
REQUEST_QUEUE_DURATION = Histogram("tgi_request_queue_duration", "Time spent queued (s)", buckets=_DURATION_BUCKETS)
REQUEST_INFERENCE_DURATION = Histogram(
    "tgi_request_inference_duration", "Time from first batch to last token (s)", buckets=_DURATION_BUCKETS
)
REQUEST_MEAN_TIME_PER_TOKEN = Histogram(
    "tgi_request_mean_time_per_token_duration", "Mean time per generated token (s)", buckets=_PER_TOKEN_BUCKETS
)
REQUEST_INPUT_LENGTH = Histogram("tgi_request_input_length", "Prompt tokens per request", buckets=_TOKEN_BUCKETS)
REQUEST_GENERATED_TOKENS = Histogram(
    "tgi_request_generated_tokens", "Generated tokens per request", buckets=_TOKEN_BUCKETS
)
# Kettle's own: time from a request's arrival to its first generated token, as the router hands it out (not a TGI
# metric; TGI's dashboards approximate it from queue and prefill times). Recorded for finished requests.
REQUEST_FIRST_TOKEN_DURATION = Histogram(
    "kettle_request_time_to_first_token", "Time to first token (s)", buckets=_DURATION_BUCKETS
)

BATCH_INFERENCE_COUNT = Counter("tgi_batch_inference_count", "Shard calls, by method", ["method"])
BATCH_INFERENCE_SUCCESS = Counter("tgi_batch_inference_success", "Successful shard calls, by method", ["method"])
BATCH_INFERENCE_FAILURE = Counter("tgi_batch_inference_failure", "Failed shard calls, by method", ["method"])
BATCH_FORWARD_DURATION = Histogram(
    "tgi_batch_forward_duration", "Shard call duration (s), by method", ["method"], buckets=_DURATION_BUCKETS
)
BATCH_NEXT_SIZE = Histogram("tgi_batch_next_size", "Size of each new batch", buckets=_BATCH_BUCKETS)

# Kettle's own: prompt tokens taken from the prefix cache instead of being computed (not a TGI metric).
PREFIX_CACHE_HIT_TOKENS = Counter("kettle_prefix_cache_hit_tokens", "Prompt tokens reused from the prefix cache")
# Kettle's own: speculative decoding (--speculate), draft tokens the shards verified and those the model accepted.
SPECULATIVE_DRAFT_TOKENS = Counter("kettle_speculative_draft_tokens", "Draft tokens verified (--speculate)")
SPECULATIVE_ACCEPTED_TOKENS = Counter("kettle_speculative_accepted_tokens", "Draft tokens accepted (--speculate)")

# Kettle's own: requests admitted per LoRA adapter (the base model's requests are not counted here).
LORA_REQUESTS = Counter("kettle_lora_requests", "Requests admitted with each LoRA adapter", ["adapter"])

QUEUE_SIZE = Gauge("tgi_queue_size", "Requests waiting in the queue")
BATCH_CURRENT_SIZE = Gauge("tgi_batch_current_size", "Requests in the running batch")
BATCH_CURRENT_MAX_TOKENS = Gauge("tgi_batch_current_max_tokens", "KV tokens reserved by the running batch")

# Kettle's own: the KV block pool, read from the allocator at scrape time. Free counts blocks a new request can
# take (cached prefix blocks nobody references are evicted on demand, so they count as free).
KV_BLOCKS_FREE = Gauge("kettle_kv_blocks_free", "KV cache blocks free for new requests")
KV_BLOCKS_TOTAL = Gauge("kettle_kv_blocks_total", "KV cache blocks in the pool")
# Kettle's own: steps after which the referenced KV blocks differed from the live requests' blocks (a leak or a
# double free). Always 0 in a healthy server; tests assert it.
KV_LEDGER_VIOLATIONS = Counter("kettle_kv_ledger_violations", "Steps after which the KV block ledger did not balance")


# Kettle's own: resident memory (RSS) of each process of the server, by `process`: "router" and "launcher" read at
# scrape time, "shard-N" as of the shards' last Health answer (refreshed every few seconds, server.py).
PROCESS_RESIDENT_MEMORY = Gauge(
    "kettle_process_resident_memory_bytes", "Resident memory of each Kettle process (bytes)", ["process"]
)


def track_process_memory(launcher_pid: int | None) -> None:
    """Reports the router's own RSS and, when it was started by `kettle launch`, the launcher's, on every scrape."""
    PROCESS_RESIDENT_MEMORY.labels("router").set_function(lambda: _bytes_or_nan(resident_bytes()))
    if launcher_pid is not None:
        PROCESS_RESIDENT_MEMORY.labels("launcher").set_function(lambda: _bytes_or_nan(resident_bytes(launcher_pid)))


def record_shard_memory(sizes: list[int]) -> None:
    """The shards' RSS as their Health answers gave it, rank by rank (0 means the shard could not read it)."""
    for rank, size in enumerate(sizes):
        PROCESS_RESIDENT_MEMORY.labels(f"shard-{rank}").set(size or math.nan)


def _bytes_or_nan(size: int | None) -> float:
    return math.nan if size is None else float(size)


class _BlockPool(Protocol):
    @property
    def free_blocks(self) -> int: ...

    block_size: int

    @property
    def capacity(self) -> int: ...  # tokens


def track_kv_blocks(allocator: _BlockPool) -> None:
    """Reports `allocator`'s free and total blocks on every scrape (the last allocator given wins)."""
    KV_BLOCKS_FREE.set_function(lambda: allocator.free_blocks)
    KV_BLOCKS_TOTAL.set_function(lambda: allocator.capacity // allocator.block_size)


# prometheus_client names counter samples `<name>_total`; TGI's exporter (and its dashboards) use `<name>`.
_TOTAL_SUFFIX = re.compile(rb"\b(tgi_[a-z_]+)_total(?=[{ ])")


def render() -> bytes:
    """The text exposition with TGI's exact sample names."""
    return _TOTAL_SUFFIX.sub(rb"\1", generate_latest())
