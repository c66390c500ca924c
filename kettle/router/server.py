"""`kettle router`: connect to the shards, choose the token limits, warm up, serve HTTP until a signal.

Token limits left unset are derived: `max_total_tokens` from the model's context length (the shard's
`max_position_embeddings`, config.json and the tokenizer's `model_max_length`, whichever is smallest) capped at
4096; `max_input_tokens = max_total_tokens - 1`; `max_batch_prefill_tokens = max_input_tokens + 50`. Warmup then
sizes the KV cache, which gives `max_batch_total_tokens` and the block layout for the scheduler.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import uvicorn
from starlette.types import ASGIApp

from kettle import settings, tracing
from kettle.process_memory import exit_without_teardown, keep_start_objects, log_resident_memory
from kettle.proto import generate_pb2
from kettle.router import metrics
from kettle.router.app import create_app
from kettle.router.client import ShardedClient, ShardError
from kettle.router.config import MODEL_FROM_LAUNCHER, RouterConfig, SchedulerConfig
from kettle.router.images import tokens as image_tokens
from kettle.router.images.check import ImageLimits
from kettle.router.images.fetch import FetchPolicy
from kettle.router.images.prompt import ImageReader
from kettle.router.infer import Infer
from kettle.router.metrics_server import start_metrics_server
from kettle.router.priority import yield_cpu
from kettle.router.shutdown import Drain, DrainingServer
from kettle.router.slow_clients import BodyDeadline, SlowClientProtocol
from kettle.router.tokenizer import TokenizerPool
from kettle.router.types import ShuttingDown
from kettle.router.validation import Validation, ValidationLimits

logger = logging.getLogger(__name__)

DEFAULT_MAX_TOTAL_TOKENS = 4096
_PREFILL_MARGIN = 50  # TGI's edge over max_input_tokens, for block-size alignment
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length", "n_ctx")
_UNSET_MODEL_MAX_LENGTH = 10**9  # transformers writes ~1e30 when a tokenizer has no limit
STANDALONE_CONNECT_SECONDS = 60.0  # a router started by hand waits this long for rank 0's socket
# After the drain: closing connections and the lifespan shutdown. Every request has answered by then (drained, or
# ended with an error at the deadline), so this is only a bound; the whole tree must exit within the deadline + 1 s.
_CLOSE_SECONDS = 0.25
# How often the router asks the shards for their resident memory (a Health call each: no model work).
MEMORY_REFRESH_SECONDS = 5.0


class StartupError(Exception):
    """A configuration or environment problem that stops the router before it serves (exit code 1)."""


@dataclass(frozen=True)
class TokenLimits:
    """The token limits in force; `max_batch_total_tokens` is known only after warmup."""

    max_input_tokens: int
    max_total_tokens: int
    max_batch_prefill_tokens: int
    max_batch_total_tokens: int | None = None


def run(config: RouterConfig) -> None:
    """Serves until SIGINT/SIGTERM; a startup problem is logged in one line and exits with code 1."""
    yield_cpu(settings.current().router_nice, config.launcher_pid)
    if config.tokenizer_name == MODEL_FROM_LAUNCHER:
        config = model_from_launcher(config)
    # Before the shard channels exist: they get the trace-context interceptor only when tracing is on.
    tracing.setup_tracing(config.otlp_endpoint, config.otlp_service_name)
    try:
        asyncio.run(serve(config))
    except StartupError as exc:
        logger.error("%s", exc)
        raise SystemExit(1) from None
    finally:
        tracing.shutdown_tracing()
    exit_without_teardown()


def model_from_launcher(config: RouterConfig) -> RouterConfig:
    """`config` with the model's folder, name and revision, one JSON line on stdin from the launcher. It started
    this router while it prepared the model (a first start's conversion), so that the router's imports ran beside
    the preparation: started with the model ready, they took cores from the shard's loading, which runs on every
    core (a 1.7B GGUF's first start: the load 0.8 s alone, 2.4 s beside the router's start). What serving loads
    is imported first; an empty stdin (the launcher stopped before the model was ready) ends the router."""
    import tokenizers  # noqa: F401 (the tokenizer pool's)

    line = sys.stdin.readline().strip()
    if not line:
        raise SystemExit("router: the launcher stopped before the model was ready")
    model = json.loads(line)
    logger.info("Model folder from the launcher: %s", model["folder"])
    return replace(config, tokenizer_name=model["folder"], model_id=model["model_id"], model_sha=model["model_sha"])


async def serve(config: RouterConfig) -> None:
    # The launcher starts the router beside the shards: what needs no shard loads first, while they load the
    # model, and then the router waits for rank 0 as long as the launcher does (it stops the router if a shard
    # fails or its start times out). Started by hand, the router gives up after a minute.
    tokenizers = TokenizerPool.from_path(config.tokenizer_name, config.validation_workers)
    try:
        await tokenizers.warm()
        client = await _connect(config)
        try:
            await _serve_with(config, client, tokenizers)
        finally:
            await client.close()
    finally:
        tokenizers.close()


async def _connect(config: RouterConfig) -> ShardedClient:
    timeout = None if config.launcher_pid is not None else STANDALONE_CONNECT_SECONDS
    try:
        return await ShardedClient.connect(config.master_shard_uds_path, timeout)
    except Exception as exc:
        raise StartupError(f"cannot reach the shards at {config.master_shard_uds_path}: {exc}") from exc


async def _serve_with(config: RouterConfig, client: ShardedClient, tokenizers: TokenizerPool) -> None:
    info = await client.info()
    limits = choose_limits(config, context_length(config, info))
    logger.info("Warming up the shards: they size and allocate the KV cache, then run a prefill")
    warmup = await client.warmup(
        limits.max_input_tokens, limits.max_batch_prefill_tokens, limits.max_total_tokens, config.max_batch_size
    )
    limits = apply_warmup(config, limits, warmup)
    block_size = warmup.block_size or info.block_size
    logger.info(
        "Token limits: max_input_tokens=%d, max_total_tokens=%d, max_batch_prefill_tokens=%d, "
        "max_batch_total_tokens=%d (KV cache: %d blocks of %d tokens)",
        *(limits.max_input_tokens, limits.max_total_tokens, limits.max_batch_prefill_tokens),
        *(limits.max_batch_total_tokens, warmup.num_blocks, block_size),
    )
    infer = Infer(client, _scheduler_config(config, limits, warmup.num_blocks, block_size))
    validation_limits = ValidationLimits.from_config(config, limits.max_input_tokens, limits.max_total_tokens)
    validation = Validation(
        validation_limits,
        tokenizers,
        grammar_support=not config.disable_grammar_support,
        images=image_reader(config, info.takes_images),
    )
    drain = Drain()
    app = create_app(config, infer, validation, info, validation_limits, drain)
    _log_serving(config, info, validation_limits)
    keep_start_objects()
    log_resident_memory(logger, "router")
    metrics.track_process_memory(config.launcher_pid)
    # The first reading before serving, so /metrics has every process from its first answer.
    metrics.record_shard_memory(await client.resident_memory())
    memory = asyncio.create_task(_refresh_shard_memory(client), name="kettle-shard-memory")
    metrics_server = start_metrics_server(config.hostname, config.prometheus_port)
    infer.start()
    try:
        timeout = config.graceful_termination_timeout
        await DrainingServer(_uvicorn_config(app, config), drain, timeout, lambda: infer.stop(ShuttingDown())).serve()
    finally:
        memory.cancel()
        await infer.stop()
        if metrics_server is not None:
            metrics_server.shutdown()


def image_reader(config: RouterConfig, shard_takes_images: bool = True) -> ImageReader | None:
    """How this model's prompts take images, under the image flags; None for a model that takes none, or whose
    shard does not run its vision tower (then images are refused rather than read as text)."""
    tokens = image_tokens.for_model(config.tokenizer_name)
    if tokens is None:
        return None
    if not shard_takes_images:
        logger.warning("The model has a vision tower the shard does not run: requests with images are refused")
        return None
    limits = ImageLimits(config.max_images_per_request, config.max_image_bytes, config.max_image_pixels)
    policy = FetchPolicy(not config.disable_image_fetch, config.max_image_bytes, config.image_fetch_timeout)
    logger.info("The model takes images (%s): %s image tokens", tokens.model_type, tokens.image_token)
    return ImageReader(tokens, limits, policy)


async def _refresh_shard_memory(client: ShardedClient) -> None:
    """Asks the shards for their resident memory every few seconds, for /metrics. A scrape never waits on the
    shards, and a shard that does not answer leaves its last value: /health is what reports it."""
    while True:
        await asyncio.sleep(MEMORY_REFRESH_SECONDS)
        with contextlib.suppress(ShardError):
            metrics.record_shard_memory(await client.resident_memory())


def _log_serving(config: RouterConfig, info: generate_pb2.InfoResponse, limits: ValidationLimits) -> None:
    logger.info(
        "Serving %s (%s, %s on %s) at http://%s:%d: max_concurrent_requests=%d, max_batch_size=%s, "
        "max_best_of=%d, max_client_batch_size=%d, payload_limit=%d",
        *(config.model_id, info.model_type or "model", info.dtype, info.device_type, config.hostname, config.port),
        *(config.max_concurrent_requests, config.max_batch_size or "unbounded", limits.max_best_of),
        *(config.max_client_batch_size, config.payload_limit),
    )


def _scheduler_config(config: RouterConfig, limits: TokenLimits, num_blocks: int, block_size: int) -> SchedulerConfig:
    assert limits.max_batch_total_tokens is not None
    return SchedulerConfig(
        max_batch_prefill_tokens=limits.max_batch_prefill_tokens,
        max_batch_total_tokens=limits.max_batch_total_tokens,
        max_batch_size=config.max_batch_size,
        waiting_served_ratio=config.waiting_served_ratio,
        max_waiting_tokens=config.max_waiting_tokens,
        block_size=block_size,
        num_blocks=num_blocks,
        prefix_caching=not config.disable_prefix_caching,
        chunked_prefill=not config.disable_chunked_prefill,
    )


def _uvicorn_config(app: ASGIApp, config: RouterConfig) -> uvicorn.Config:
    return uvicorn.Config(
        BodyDeadline(app),
        http=SlowClientProtocol,  # deadlines on the headers and on a body left unread (slow_clients.py)
        host=config.hostname,
        port=config.port,
        log_level=logging.getLogger().level,  # LOG_LEVEL, as set up for the whole process
        log_config=None,  # keep the process's logging setup (text or JSON lines)
        # The drain (shutdown.py) already waited for the requests in flight; this only bounds the close.
        timeout_graceful_shutdown=_CLOSE_SECONDS,
    )


def context_length(config: RouterConfig, info: generate_pb2.InfoResponse) -> int | None:
    """The smallest known context length: the shard's, the model config's, the tokenizer's."""
    folder = Path(config.tokenizer_name)
    candidates = [info.max_position_embeddings, _model_context(folder), _tokenizer_max_length(folder)]
    known = [value for value in candidates if value]
    return min(known) if known else None


def _model_context(folder: Path) -> int | None:
    model_config = _read_json(folder / "config.json")
    for section in (model_config, model_config.get("text_config") or {}):
        for key in _CONTEXT_KEYS:
            if isinstance(section.get(key), int):
                return section[key]
    return None


def _tokenizer_max_length(folder: Path) -> int | None:
    value = _read_json(folder / "tokenizer_config.json").get("model_max_length")
    return int(value) if isinstance(value, int | float) and 0 < value < _UNSET_MODEL_MAX_LENGTH else None


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def choose_limits(config: RouterConfig, context: int | None) -> TokenLimits:
    """The limits before warmup: flags first, then defaults derived from the context length."""
    total = config.max_total_tokens
    if total is None:
        total = min(context or DEFAULT_MAX_TOTAL_TOKENS, DEFAULT_MAX_TOTAL_TOKENS)
        if config.max_input_tokens is not None:
            total = max(total, config.max_input_tokens + 1)
    max_input = config.max_input_tokens if config.max_input_tokens is not None else total - 1
    if not 0 < max_input < total:
        raise StartupError(f"`max_input_tokens` ({max_input}) must be > 0 and < `max_total_tokens` ({total})")
    prefill = config.max_batch_prefill_tokens or max_input + _PREFILL_MARGIN
    # With chunked prefill a longer prompt is computed in pieces of the budget; without, it must fit in one.
    if prefill < max_input and config.disable_chunked_prefill:
        raise StartupError(
            f"`max_batch_prefill_tokens` must be >= `max_input_tokens`. Given: {prefill} and {max_input}"
        )
    return TokenLimits(max_input, total, prefill)


def apply_warmup(config: RouterConfig, limits: TokenLimits, warmup: generate_pb2.WarmupResponse) -> TokenLimits:
    """Final limits: the KV capacity found at warmup bounds the batch, and a request must fit in it."""
    supported = warmup.max_supported_total_tokens
    if not supported:
        raise StartupError("warmup reported no KV cache capacity: the shards cannot hold any token")
    batch_total = config.max_batch_total_tokens or supported
    if batch_total > supported:
        # The KV blocks are allocated: a bigger budget would only make the scheduler wait on blocks.
        logger.warning(
            "--max-batch-total-tokens %d exceeds the KV cache (%d tokens); using %d", batch_total, *[supported] * 2
        )
        batch_total = supported
    if limits.max_total_tokens > batch_total:
        limits = _shrink_to_cache(config, limits, batch_total)
    prefill = limits.max_batch_prefill_tokens
    if prefill > batch_total:
        if config.max_batch_prefill_tokens is not None:
            raise StartupError(f"`max_batch_prefill_tokens` ({prefill}) exceeds the KV cache ({batch_total} tokens)")
        prefill = batch_total
    return replace(limits, max_batch_prefill_tokens=prefill, max_batch_total_tokens=batch_total)


def _shrink_to_cache(config: RouterConfig, limits: TokenLimits, batch_total: int) -> TokenLimits:
    """A request of max_total_tokens must fit in the KV cache; derived limits shrink, explicit ones are an error."""
    if config.max_total_tokens is not None or batch_total < 2:
        raise StartupError(
            f"`max_total_tokens` ({limits.max_total_tokens}) does not fit in the KV cache ({batch_total} tokens): "
            "lower --max-total-tokens or give the cache more memory"
        )
    max_input = min(limits.max_input_tokens, batch_total - 1)
    if config.max_input_tokens is not None and max_input < config.max_input_tokens:
        raise StartupError(f"`max_input_tokens` ({config.max_input_tokens}) does not fit in the KV cache")
    logger.warning("KV cache holds %d tokens: max_total_tokens lowered to fit", batch_total)
    return replace(limits, max_input_tokens=max_input, max_total_tokens=batch_total)
