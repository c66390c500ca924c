"""`kettle serve`: one shard process — load the model, then serve the shard protocol on a Unix socket."""

from __future__ import annotations

import asyncio
import logging
import os
import signal

import grpc
import psutil
import torch

from kettle.proto import generate_pb2 as pb
from kettle.proto import generate_pb2_grpc
from kettle.shard.config import ShardConfig
from kettle.shard.engine import ShardEngine
from kettle.shard.kv_cache import BLOCK_SIZE
from kettle.shard.runner import ModelRunner
from kettle.shard.service import ShardService
from kettle.shard.vocab import Vocab

logger = logging.getLogger(__name__)

_MAX_MESSAGE = 256 * 1024 * 1024
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def choose_device() -> torch.device:
    """CUDA when present (honouring LOCAL_RANK), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def choose_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """The requested dtype, or the device default: float32 on the CPU (fastest measured here), bf16 on CUDA."""
    if name is not None:
        return _DTYPES[name]
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def build_engine(config: ShardConfig) -> tuple[ShardEngine, pb.InfoResponse]:
    """Loads the model and tokenizer and wires the engine; returns it with the Info the router will ask for."""
    from kettle.models.registry import load_model

    device = choose_device()
    dtype = choose_dtype(config.dtype, device)
    model = load_model(config.model_path, dtype, device, config.trust_remote_code, config.quantize)
    vocab = Vocab.load(config.model_path, config.trust_remote_code)
    watermark = (config.watermark_gamma, config.watermark_delta)
    runner = ModelRunner(model, vocab, device, watermark, config.graph_buckets)
    engine = ShardEngine(
        runner, config.cpu_kv_cache_fraction, config.rank, config.world_size, config.cuda_memory_fraction
    )
    spec = model.spec
    info = pb.InfoResponse(
        requires_padding=False,
        dtype=str(dtype).removeprefix("torch."),
        device_type=device.type,
        window_size=spec.sliding_window,
        block_size=BLOCK_SIZE,
        max_position_embeddings=spec.max_position_embeddings,
        vocab_size=spec.vocab_size,
        model_type=spec.model_type,
        execution_path="native",
    )
    return engine, info


def set_threads(num_threads: int | None) -> None:
    """Sets torch's intra-op threads once: all physical cores unless told otherwise."""
    threads = num_threads or psutil.cpu_count(logical=False) or os.cpu_count() or 1
    torch.set_num_threads(threads)


async def _serve(config: ShardConfig) -> None:
    engine, info = build_engine(config)
    urls = [f"unix://{config.uds_path}-{rank}" for rank in range(config.world_size)]
    server = grpc.aio.server(
        options=[("grpc.max_send_message_length", _MAX_MESSAGE), ("grpc.max_receive_message_length", _MAX_MESSAGE)]
    )
    generate_pb2_grpc.add_TextGenerationServiceServicer_to_server(ShardService(engine, info, urls), server)
    if os.path.exists(config.socket_path):
        os.unlink(config.socket_path)
    server.add_insecure_port(f"unix://{config.socket_path}")
    await server.start()
    logger.info(
        "Shard %d/%d ready on %s (%s, %s, %s)",
        config.rank,
        config.world_size,
        config.socket_path,
        info.model_type,
        info.dtype,
        info.device_type,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(grace=1)
    if os.path.exists(config.socket_path):
        os.unlink(config.socket_path)


def serve(config: ShardConfig) -> None:
    """Blocks serving the shard until SIGTERM/SIGINT."""
    set_threads(config.num_threads)
    asyncio.run(_serve(config))
