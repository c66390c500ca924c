"""Kettle's command line: `kettle launch | serve | router | download-weights | benchmark`.

Only typer and small config modules are imported here; torch, transformers, grpc and the servers are
imported inside the commands, so `kettle --help` answers at once.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any

import typer

from kettle.launcher import options as o
from kettle.launcher.command import launch
from kettle.shard.config import SHARD_DEFAULTS as S  # and the shard's

app = typer.Typer(
    name="kettle",
    help="Kettle: a text-generation inference server with Hugging Face TGI's API.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)
app.command("launch")(launch)
# `text-generation-launcher`: TGI's launcher name, the `launch` command alone (flags straight after the name).
launcher_app = typer.Typer(name="text-generation-launcher", add_completion=False, pretty_exceptions_show_locals=False)
launcher_app.command()(launch)
log = logging.getLogger("kettle.cli")


def _config_or_usage_error(factory, **settings):
    """Builds a config dataclass; its validation errors become a usage error (exit 2, no traceback)."""
    try:
        return factory(**settings)
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None


@app.command()
def serve(
    model_path: Annotated[str, typer.Argument(help="Local model folder (config.json, safetensors, tokenizer).")],
    uds_path: Annotated[str, typer.Option(help="Socket prefix; this shard listens on PATH-RANK.")] = (
        "/tmp/kettle-server"
    ),
    dtype: Annotated[str | None, typer.Option(help="float32, bfloat16 or float16.")] = None,
    rank: Annotated[int, typer.Option(envvar="RANK", help="This shard's rank.")] = 0,
    world_size: Annotated[int, typer.Option(envvar="WORLD_SIZE", help="Number of shards.")] = 1,
    trust_remote_code: Annotated[bool, typer.Option("--trust-remote-code", help="Allow the model's code.")] = False,
    quantize: Annotated[str | None, typer.Option(help="int8, int4, gptq, awq (CPU) or fp8 (CUDA).")] = None,
    num_threads: Annotated[int | None, typer.Option(envvar="KETTLE_NUM_THREADS", help="Torch threads.")] = None,
    cpu_kv_cache_fraction: Annotated[
        float, typer.Option(envvar="KETTLE_CPU_KV_CACHE_FRACTION", help="Share of RAM for the KV cache on CPU.")
    ] = S.cpu_kv_cache_fraction,
    cuda_memory_fraction: Annotated[
        float, typer.Option(envvar="CUDA_MEMORY_FRACTION", help="Share of free GPU memory for the KV cache.")
    ] = S.cuda_memory_fraction,
    cuda_graphs: Annotated[
        str | None,
        typer.Option(envvar=["CUDA_GRAPHS", "KETTLE_CUDA_GRAPHS"], help="Decode CUDA graph batch sizes; 0 disables."),
    ] = None,
    watermark_gamma: Annotated[float, typer.Option(help="Green-list share of the watermark.")] = S.watermark_gamma,
    watermark_delta: Annotated[
        float, typer.Option(help="Logit bias of the watermark's green list.")
    ] = S.watermark_delta,
    lora_adapters: Annotated[
        str | None, typer.Option(help="LoRA adapters to attach: `name=path` or Hub ids, comma-separated.")
    ] = None,
    speculate: Annotated[int, typer.Option(help="N-gram draft tokens verified per step (0: off).")] = 0,
    kv_cache_dtype: Annotated[
        str | None, typer.Option(help="KV cache dtype: fp16, bf16, float32 or auto (the model's, the default).")
    ] = None,
    weight_bytes: Annotated[
        int | None, typer.Option(hidden=True, help="Bytes the packed weights will take (from the launcher).")
    ] = None,
    json_output: o.JsonOutput = False,
    otlp_endpoint: o.OtlpEndpoint = None,
    otlp_service_name: o.OtlpServiceName = "kettle",
) -> None:
    """Run one shard (the model) as a gRPC server on a Unix socket. Started by `kettle launch`."""
    settings = dict(locals())  # exactly the parameters, which are named like ShardConfig's fields
    from kettle.process_memory import collection_paused, reuse_freed_memory, use_one_heap
    from kettle.tensors import weight_arena

    use_one_heap()  # first: before torch, gRPC or the engine start a thread
    reuse_freed_memory()  # the steps' activations stay in that heap from one step to the next
    weight_arena.reserve(max(weight_bytes or 0, 0))  # its pages fault in while torch and the model code import
    from kettle import tracing
    from kettle.logging_setup import setup_logging
    from kettle.shard.config import ShardConfig

    setup_logging(settings.pop("json_output"))
    endpoint, service = settings.pop("otlp_endpoint"), settings.pop("otlp_service_name")
    config = _config_or_usage_error(ShardConfig, **settings)
    with collection_paused():  # torch's imports and the load: until the shard is ready
        from kettle.shard.server import serve as serve_shard

        # The shards' spans join the router's traces under their own service name, as TGI's `.server` ones do.
        tracing.setup_tracing(endpoint, f"{service}.shard")
        try:
            serve_shard(config)
        finally:
            tracing.shutdown_tracing()


@app.command()
@o.with_serving_flags
def router(
    tokenizer_name: Annotated[str, typer.Option(help="Local folder holding the model's tokenizer.")],
    master_shard_uds_path: Annotated[str, typer.Option(help="Socket of shard 0.")] = "/tmp/kettle-server-0",
    model_id: Annotated[
        str | None, typer.Option(help="Model name in /info and /v1/models (default: the tokenizer name).")
    ] = None,
    model_sha: Annotated[str | None, typer.Option(help="Model revision shown in /info.")] = None,
    model_pipeline_tag: Annotated[str, typer.Option(help="Pipeline tag shown in /info.")] = "text-generation",
    adapters: Annotated[
        list[str] | None, typer.Option(help="A LoRA adapter the shards loaded (repeat for each).")
    ] = None,
    launcher_pid: Annotated[
        int | None, typer.Option(help="The launcher's pid, for its resident memory gauge on /metrics.", hidden=True)
    ] = None,
    **serving: Any,
) -> None:
    """Run the HTTP router in front of running shards. Started by `kettle launch`."""
    # Exactly the parameters (the serving flags among them), which are named like RouterConfig's fields.
    settings = {**{k: v for k, v in locals().items() if k != "serving"}, **serving}
    from kettle.logging_setup import setup_logging
    from kettle.router.config import RouterConfig

    settings["model_id"] = model_id or tokenizer_name
    settings["cors_allow_origin"] = tuple(settings["cors_allow_origin"] or ())
    settings["adapters"] = tuple(adapters or ())
    setup_logging(settings["json_output"])
    from kettle.router.listen_address import listen_address

    settings["hostname"] = listen_address(settings["hostname"])
    config = _config_or_usage_error(RouterConfig, **settings)
    from kettle.process_memory import collection_paused

    with collection_paused():  # the imports, the tokenizer and the warm-up: until the router serves
        from kettle.router.server import run

        run(config)


@app.command("download-weights")
def download_weights(
    model_id: Annotated[str | None, typer.Argument(help="Hub id, local folder or .gguf (default: bundled).")] = None,
    revision: Annotated[str | None, typer.Option(envvar="REVISION", help="Hub revision.")] = None,
    gguf_file: Annotated[
        str | None,
        typer.Option(envvar="GGUF_FILE", help="The GGUF file of the repository (or folder) to download, only that."),
    ] = None,
    mmproj: Annotated[
        str | None,
        typer.Option(envvar="MMPROJ", help="A GGUF model's projector file (mmproj-*.gguf) to prepare its images with."),
    ] = None,
    huggingface_hub_cache: Annotated[str | None, typer.Option(envvar="HUGGINGFACE_HUB_CACHE")] = None,
    trust_remote_code: Annotated[bool, typer.Option("--trust-remote-code", help="Allow the model's code.")] = False,
    json_output: o.JsonOutput = False,
) -> None:
    """Download and convert a model ahead of time; prints the local folder it resolved to."""
    from kettle.hub import PreparationError, resolve_model
    from kettle.logging_setup import setup_logging

    setup_logging(json_output)
    try:
        model = resolve_model(model_id, revision, huggingface_hub_cache, trust_remote_code, gguf_file, mmproj)
    except PreparationError as error:
        log.error("%s", error)
        raise typer.Exit(1) from None
    typer.echo(str(model.path))


@app.command()
def benchmark(
    tokenizer_name: Annotated[
        str | None,
        typer.Option("--tokenizer-name", "--model-id", help="Model to benchmark (default: the bundled model)."),
    ] = None,
    batch_size: Annotated[list[int] | None, typer.Option(help="A batch size to measure (repeat for more).")] = None,
    sequence_length: Annotated[int, typer.Option(help="Prompt tokens per request.")] = 10,
    decode_length: Annotated[int, typer.Option(help="Decode steps per run (EOS ignored).")] = 8,
    runs: Annotated[int, typer.Option(help="Measured runs per batch size.")] = 10,
    warmups: Annotated[int, typer.Option(help="Unmeasured runs first.")] = 1,
    master_shard_uds_path: Annotated[
        str | None, typer.Option(help="Socket of a running shard (default: start one).")
    ] = None,
    dtype: Annotated[str | None, typer.Option(help="dtype of the shard it starts.")] = None,
    quantize: Annotated[str | None, typer.Option(help="--quantize of the shard it starts (int8, int4, ...).")] = None,
) -> None:
    """Measure prefill and decode latency and throughput per batch size, talking to a shard directly."""
    from kettle.bench.benchmark import DEFAULT_BATCH_SIZES, BenchmarkConfig, run
    from kettle.logging_setup import setup_logging

    setup_logging()
    config = _config_or_usage_error(
        BenchmarkConfig,
        model_id=tokenizer_name,
        batch_sizes=tuple(batch_size or DEFAULT_BATCH_SIZES),
        sequence_length=sequence_length,
        decode_length=decode_length,
        runs=runs,
        warmups=warmups,
        master_shard_uds_path=master_shard_uds_path,
        dtype=dtype,
        quantize=quantize,
    )
    run(config)


if __name__ == "__main__":
    app(prog_name="kettle")
