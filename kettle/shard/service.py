"""The gRPC servicer of `TextGenerationService` (docs/api.md, Shard protocol), backed by a `ShardEngine`.

Model calls run in one worker thread under a lock, so the event loop keeps answering Health and Info while a
forward runs, and the engine is never entered twice at once. It is always the same thread (`ENGINE_THREAD`,
which also loads the model): each thread that runs torch ops gets its own OpenMP team, and with several teams
on a small machine libgomp stops spinning between parallel regions and puts its threads to sleep, which cost
~10 ms of a 17 ms int4 decode step here when calls hopped between `asyncio.to_thread`'s pool threads.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from concurrent.futures import ThreadPoolExecutor

import grpc

from kettle import settings, tracing
from kettle.process_memory import log_resident_memory, release_free_memory, release_library_pages, resident_bytes
from kettle.proto import generate_pb2 as pb
from kettle.proto import generate_pb2_grpc
from kettle.shard.engine import ShardEngine
from kettle.shard.tracing import shard_span

logger = logging.getLogger(__name__)
# Seconds without a model call, the engine holding no batch, before the shard hands freed memory back.
IDLE_SECONDS = 1.0
# The one thread that runs every torch op of the shard (see the module docstring).
ENGINE_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kettle-engine")


async def on_engine_thread(fn, *args):
    """`fn(*args)` on ENGINE_THREAD, with the caller's context variables (as `asyncio.to_thread` does)."""
    context = contextvars.copy_context()
    return await asyncio.get_running_loop().run_in_executor(ENGINE_THREAD, context.run, fn, *args)


class ShardService(generate_pb2_grpc.TextGenerationServiceServicer):
    """Answers the router's calls for one rank."""

    def __init__(self, engine: ShardEngine, info: pb.InfoResponse, urls: list[str]) -> None:
        self.engine = engine
        self.info = info
        self.urls = urls
        self._lock = asyncio.Lock()
        self._memory_report: asyncio.Task | None = None  # held: the loop keeps only weak references to tasks
        self._calls = 0  # model calls answered so far: an idle check compares it with its own call's

    def _settle_if_idle(self, calls: int) -> None:
        """`engine.settle` (memory back to the system) if no call came since the one numbered `calls`, which left
        the engine without batches. Not after every such call: a request arriving right after would fault the
        pages back in, 5-10 ms added to a one-token request here."""
        if calls == self._calls:
            ENGINE_THREAD.submit(self.engine.settle)

    async def _call(self, context: grpc.aio.ServicerContext, fn, request):
        if tracing.enabled():  # the router's trace continues here (its span context is in the call's metadata)
            with shard_span(context, fn.__name__, request):
                return await self._locked_call(context, fn, request)
        return await self._locked_call(context, fn, request)

    async def _locked_call(self, context: grpc.aio.ServicerContext, fn, request):
        async with self._lock:
            try:
                answer = await on_engine_thread(fn, request)
            except Exception as error:  # a failed batch fails its call, never the shard
                logger.exception("%s failed", fn.__name__)
                await context.abort(grpc.StatusCode.INTERNAL, f"{type(error).__name__}: {error}")
            # Queued, not awaited: the next step is computed while this answer travels to the router, and the next
            # call queues behind it on the same thread (overlap scheduling, kettle/shard/lookahead.py).
            ENGINE_THREAD.submit(contextvars.copy_context().run, self.engine.look_ahead)
            self._calls += 1
            if not self.engine.batches:
                asyncio.get_running_loop().call_later(IDLE_SECONDS, self._settle_if_idle, self._calls)
            return answer

    async def Info(self, request, context):
        return self.info

    async def Health(self, request, context):
        return pb.HealthResponse(resident_memory_bytes=resident_bytes() or 0)

    async def ServiceDiscovery(self, request, context):
        return pb.ServiceDiscoveryResponse(urls=self.urls)

    async def ClearCache(self, request, context):
        await self._call(context, self.engine.clear_cache, request)
        return pb.ClearCacheResponse()

    async def FilterBatch(self, request, context):
        return await self._call(context, self.engine.filter_batch, request)

    async def Warmup(self, request, context):
        answer = await self._call(context, self.engine.warmup, request)
        self._memory_report = asyncio.create_task(self._report_memory())
        return answer

    async def _report_memory(self) -> None:
        """Logs the memory the shard serves with once its KV cache is resident (on the CPU its pages fault in after
        the warm-up, in 32 MiB pieces: 0.5-4.5 s on the bundled model), without holding the warm-up's answer back."""
        await asyncio.to_thread(self.engine.runner.kv_cache.residency.wait)
        # The warm-up prefill's activations are freed but glibc keeps most of them resident (25-75 MiB on
        # the bundled model): hand them back before the shard settles.
        release_free_memory()
        if settings.current().release_library_pages:
            dropped = await asyncio.to_thread(release_library_pages)  # reads /proc/self/smaps: ~30 ms
            logger.debug("Dropped %.1f MiB of library pages start-up ran", dropped / 2**20)
        cache = self.engine.runner.kv_cache
        # The part of the shard that grows with --cpu-kv-cache-fraction, told apart from the rest (a CUDA cache is
        # in the GPU's memory, not this process's).
        in_rss = cache.nbytes if cache.device.type == "cpu" else 0
        log_resident_memory(logger, f"shard-{self.engine.rank}", in_rss)

    async def Prefill(self, request, context):
        return await self._call(context, self.engine.prefill, request)

    async def Decode(self, request, context):
        return await self._call(context, self.engine.decode, request)
