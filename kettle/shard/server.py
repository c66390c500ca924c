"""`kettle serve`: one shard process — load the model, then serve the shard protocol on a Unix socket."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import sys

import grpc
import psutil
import torch

from kettle import settings, tracing
from kettle.process_memory import exit_without_teardown, keep_start_objects, release_free_memory
from kettle.proto import generate_pb2 as pb
from kettle.proto import generate_pb2_grpc
from kettle.shard.config import MODEL_FROM_LAUNCHER, ShardConfig
from kettle.shard.dtype import choose_dtype, choose_kv_dtype
from kettle.shard.engine import ShardEngine
from kettle.shard.runner import PagedRunner
from kettle.shard.runner_protocol import Capabilities, Runner
from kettle.shard.service import ShardService, on_engine_thread
from kettle.shard.vocab import Vocab
from kettle.tensors import weight_arena
from kettle.tensors.distributed import init_distributed, shutdown
from kettle.tensors.kv_cache import BLOCK_SIZE

logger = logging.getLogger(__name__)

_MAX_MESSAGE = 256 * 1024 * 1024


def _native_runner(model, vocab: Vocab, device: torch.device, watermark, graph_buckets) -> Runner:
    runner = PagedRunner(model, vocab, device, watermark, graph_buckets)
    if hasattr(model, "encode_images"):  # a vision-language model: its prompts' forwards place image rows
        from kettle.shard.image_inputs import ImageInputs, load_image_processor

        runner.images = ImageInputs(model, load_image_processor(model.folder))
    return runner


def _fallback_runner(model, vocab: Vocab, device: torch.device, watermark, graph_buckets) -> Runner:
    from kettle.shard.fallback_runner import FallbackRunner

    runner = FallbackRunner(model, vocab, device, watermark)  # padded batches: no decode graphs
    if hasattr(model, "token_types"):  # a vision-language model through transformers: its prompts take images
        from kettle.shard.fallback_images import FallbackImages

        runner.images = FallbackImages.load(model)
    return runner


def _seq2seq_runner(model, vocab: Vocab, device: torch.device, watermark, graph_buckets) -> Runner:
    from kettle.shard.seq2seq_runner import Seq2SeqRunner

    return Seq2SeqRunner(model, vocab, device, watermark)


# The model's execution path → the runner that drives it: Kettle's paged forward for native families,
# transformers' own KV cache for the causal fallback and for encoder-decoders.
RUNNERS = {"native": _native_runner, "transformers": _fallback_runner, "seq2seq": _seq2seq_runner}


def describe_decode_path(model, capabilities: Capabilities, device: torch.device) -> str:
    """How decode steps run, for the start-up log and /info: the fused CPU call, or layer by layer and, on the
    CPU, what keeps the model off the fused call."""
    from kettle.models.decoder_step import DecoderStep

    if getattr(model, "cpu_decoder_step", None) is not None:
        return "as one fused CPU call"
    if not capabilities.paged or device.type != "cpu":
        return "layer by layer"
    return f"layer by layer (the fused CPU step does not take {DecoderStep.why_not})"


def cpu_kernels(device: torch.device) -> str:
    """What Kettle's CPU kernels run (kettle/kernels/isa.py), for /info; empty on a GPU or without the kernels."""
    from kettle.kernels import build

    return (build.instructions() or "") if device.type == "cpu" else ""


def model_from_launcher() -> str:
    """The model folder's path, one line on stdin from the launcher, which started this shard before the folder was
    ready so that the imports (torch, the model code: seconds) ran beside its preparation. What loading imports is
    imported first; an empty stdin (the launcher stopped before the model was ready) ends the shard."""
    import kettle.models.lora_adapters
    import kettle.models.registry  # noqa: F401 (imported here, while the launcher still prepares the model)

    path = sys.stdin.readline().strip()
    if not path:
        raise SystemExit("shard: the launcher stopped before the model was ready")
    logger.info("Model folder from the launcher: %s", path)
    return path


def choose_device() -> torch.device:
    """CUDA when present (honouring LOCAL_RANK), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def build_engine(config: ShardConfig) -> tuple[ShardEngine, pb.InfoResponse]:
    """Loads the model and tokenizer and wires the engine; returns it with the Info the router will ask for."""
    from kettle.models.lora_adapters import load_adapters
    from kettle.models.registry import load_model

    device = choose_device()
    dtype = choose_dtype(config.dtype, device, config.model_path)
    kv_dtype = choose_kv_dtype(config.kv_cache_dtype, dtype, device)  # before loading: a refusal costs nothing
    # Join the tensor-parallel group before loading: the loaders read only this rank's slices.
    init_distributed(config.rank, config.world_size, device)
    # A float --dtype asks a quantized (GGUF) checkpoint for dequantized weights; without one it serves quantized.
    dequantize = config.dtype is not None
    model = load_model(config.model_path, dtype, device, config.trust_remote_code, config.quantize, dequantize)
    weight_arena.close()  # what the weights did not take of the memory reserved for them goes back
    vocab = Vocab.load(config.model_path, config.trust_remote_code)
    watermark = (config.watermark_gamma, config.watermark_delta)
    execution_path = getattr(model, "execution_path", "native")
    runner = RUNNERS[execution_path](model, vocab, device, watermark, config.graph_buckets)
    can = runner.capabilities
    # Built here (after quantization) rather than on the first decode, so the log says which path serves.
    decode_path = describe_decode_path(model, can, device)
    logger.info("Decode steps run %s", decode_path)
    if can.speculation:
        runner.speculate = config.speculate
    elif config.speculate:
        logger.warning("--speculate needs the paged KV cache: this model decodes one token a step")
    if can.kv_dtypes:
        runner.kv_dtype = kv_dtype
    elif kv_dtype != dtype:
        logger.warning("--kv-cache-dtype applies to the paged KV cache only: this model's stays in %s", dtype)
    # Opt-in (KETTLE_TUNING=overlap=on): on a 2-core machine the step computed ahead competes for the cores with
    # the router and measured slower than waiting (docs/performance.md).
    overlap = can.overlap and settings.current().overlap
    engine = ShardEngine(
        runner, config.cpu_kv_cache_fraction, config.rank, config.world_size, config.cuda_memory_fraction, overlap
    )
    engine.adapters = load_adapters(config.lora_adapters, model, config.world_size)
    spec = model.spec
    info = pb.InfoResponse(
        requires_padding=not can.paged,
        dtype=str(dtype).removeprefix("torch."),
        device_type=device.type,
        window_size=spec.sliding_window,
        block_size=BLOCK_SIZE,
        max_position_embeddings=spec.max_position_embeddings,
        vocab_size=spec.vocab_size,
        model_type=spec.model_type,
        execution_path=execution_path,
        quantization=getattr(model, "quantization", None) or config.quantize or "",
        decode_path=decode_path,
        speculate=runner.speculate,
        kv_cache_dtype=str(runner.cache_dtype).removeprefix("torch."),
        takes_images=getattr(runner, "images", None) is not None,
        cpu_kernels=cpu_kernels(device),
    )
    # Loading freed far more than it kept (the tokenizer's JSON tree, conversion temporaries): give it back.
    release_free_memory()
    return engine, info


def set_threads(num_threads: int | None, local_shards: int = 1) -> None:
    """Sets torch's intra-op threads once: unless told otherwise, the physical cores shared out among the
    shards of this machine (several shards each using every core would fight over them)."""
    cores = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    threads = num_threads or max(1, cores // local_shards)
    torch.set_num_threads(threads)


async def _serve(config: ShardConfig) -> None:
    engine, info = await on_engine_thread(build_engine, config)  # the thread every later model call runs on
    urls = [f"unix://{config.uds_path}-{rank}" for rank in range(config.world_size)]
    server = grpc.aio.server(
        options=[("grpc.max_send_message_length", _MAX_MESSAGE), ("grpc.max_receive_message_length", _MAX_MESSAGE)]
    )
    generate_pb2_grpc.add_TextGenerationServiceServicer_to_server(ShardService(engine, info, urls), server)
    if os.path.exists(config.socket_path):
        os.unlink(config.socket_path)
    server.add_insecure_port(f"unix://{config.socket_path}")
    await server.start()
    keep_start_objects()
    logger.info(
        "Shard %d/%d ready on %s (%s, %s, %s, weights %s)",
        config.rank,
        config.world_size,
        config.socket_path,
        info.model_type,
        info.dtype,
        info.device_type,
        info.quantization or "dense",
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    # The KV cache's pages may still be faulting in (seconds for gigabytes); the exit need not wait for them.
    engine.runner.kv_cache.residency.stop()
    await server.stop(grace=1)
    if os.path.exists(config.socket_path):
        os.unlink(config.socket_path)


def serve(config: ShardConfig) -> None:
    """Blocks serving the shard until SIGTERM/SIGINT."""
    if config.model_path == MODEL_FROM_LAUNCHER:
        config = dataclasses.replace(config, model_path=model_from_launcher())
    set_threads(config.num_threads, int(os.environ.get("LOCAL_WORLD_SIZE", config.world_size)))
    try:
        asyncio.run(_serve(config))
    finally:
        shutdown()
    tracing.shutdown_tracing()  # the spans go out before the process ends without its teardown
    exit_without_teardown()
