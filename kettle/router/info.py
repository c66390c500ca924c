"""Open routes about the server (docs/api.md, Info, health and metrics): GET /health (also GET / and /ping), /info and
/metrics.

The OpenAPI document and Swagger UI (/api-doc/openapi.json, /docs) are FastAPI's own, configured in app.py.
"""

from __future__ import annotations

import os
from typing import Protocol

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

import kettle
from kettle.proto import generate_pb2
from kettle.router import metrics
from kettle.router.config import RouterConfig
from kettle.router.errors import error_body
from kettle.router.schemas import ErrorResponse, Info
from kettle.router.validation import ValidationLimits


class HealthCheck(Protocol):
    """The part of `Infer` /health uses."""

    async def health(self) -> bool: ...


def compute_type(info: generate_pb2.InfoResponse) -> str:
    """`x-compute-type`: "cpu" on a CPU shard, "gpu" otherwise."""
    return "cpu" if info.device_type == "cpu" else "gpu"


def server_info(
    config: RouterConfig, info: generate_pb2.InfoResponse, limits: ValidationLimits, takes_images: bool = False
) -> Info:
    """/info's answer: model facts from the shard, limits as chosen at warmup."""
    return Info(
        model_id=config.model_id,
        model_sha=config.model_sha,
        model_pipeline_tag=_pipeline_tag(config.model_pipeline_tag, info.execution_path, takes_images),
        model_dtype=info.dtype,
        model_device_type=info.device_type,
        max_concurrent_requests=config.max_concurrent_requests,
        max_best_of=limits.max_best_of,
        max_stop_sequences=limits.max_stop_sequences,
        max_input_tokens=limits.max_input_tokens,
        max_total_tokens=limits.max_total_tokens,
        validation_workers=config.validation_workers,
        max_client_batch_size=config.max_client_batch_size,
        router="text-generation-router",  # TGI's value: clients that check it expect this
        version=kettle.__version__,
        # Build facts, as TGI reads them: set by the image build, absent in a source checkout.
        sha=os.environ.get("GIT_SHA"),
        docker_label=os.environ.get("DOCKER_LABEL"),
        execution_path=info.execution_path or None,
        quantization=info.quantization or None,
        decode_path=info.decode_path or None,
        speculate=info.speculate,
        kv_cache_dtype=info.kv_cache_dtype or None,
        cpu_kernels=info.cpu_kernels or None,
    )


def _pipeline_tag(configured: str | None, execution_path: str, takes_images: bool = False) -> str | None:
    # An encoder-decoder model is a text2text-generation model on the Hub (FLAN-T5's tag), as TGI reports it.
    if execution_path == "seq2seq" and configured == "text-generation":
        return "text2text-generation"
    # A model that reads images is tagged as the Hub tags LLaVA, Idefics3 or Qwen2-VL.
    if takes_images and configured == "text-generation":
        return "image-text-to-text"
    return configured


def build_router(infer: HealthCheck, info: Info) -> APIRouter:
    """The info routes; they stay open when an API key protects the generation routes."""
    router = APIRouter(tags=["Text Generation Inference"])
    unhealthy = {503: {"model": ErrorResponse, "description": "A forward through the shards failed"}}

    async def health() -> Response:
        """200 when a forward through every shard works, 503 otherwise."""
        if await infer.health():
            return Response(status_code=200)
        return JSONResponse(error_body("unhealthy", "healthcheck"), status_code=503)

    # GET / is health; POST / is the compat generate route (generate.py).
    for path in ("/health", "/", "/ping"):
        router.add_api_route(path, health, methods=["GET"], responses=unhealthy, name=f"health{path}")

    @router.get("/info", response_model=Info)
    async def get_info() -> Info:
        """Model and server facts."""
        return info

    @router.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
    async def get_metrics() -> Response:
        """Prometheus metrics (text format), with TGI's metric names."""
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return router
