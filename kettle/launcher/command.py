"""The `kettle launch` command: every flag of text-generation-launcher (TGI's names, defaults and environment
variables), the ones Kettle has no use for included, so TGI command lines and manifests work unchanged."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from kettle.launcher import options as o
from kettle.launcher.options import COMPATIBILITY, MODEL, SHARDS, option
from kettle.shard.config import SHARD_DEFAULTS as S  # and the shard's

TRUE_WORDS = {"true", "1", "yes", "on"}
FALSE_WORDS = {"false", "0", "no", "off"}


def _print_version(value: bool) -> None:
    """`-V/--version`: eager, so it answers before any other flag is checked, as TGI's does."""
    if value:
        import kettle

        typer.echo(f"kettle {kettle.__version__}")
        raise typer.Exit()


def parse_boolean(value: str | None) -> bool | None:
    """TGI spells `--sharded true` / `--sharded false`: a value, not a bare flag."""
    if value is None:
        return None
    word = value.lower()
    if word not in TRUE_WORDS | FALSE_WORDS:
        raise ValueError(f"--sharded takes true or false, got {value!r}")
    return word in TRUE_WORDS


ModelId = Annotated[
    str | None,
    option("--model-id", "Hub model id, local folder or .gguf file (default: the bundled SmolLM2-135M).", MODEL),
]
Revision = Annotated[str | None, option("--revision", "Hub revision: branch, tag or commit.", MODEL)]
GgufFile = Annotated[
    str | None,
    option(
        "--gguf-file",
        "The GGUF file of a --model-id repository (or folder) to serve, e.g. `--model-id org/name-GGUF --gguf-file "
        "name.Q4_K_M.gguf`; only that file is downloaded. `--model-id org/name-GGUF:Q4_K_M` picks one by its tag.",
        MODEL,
    ),
]
Mmproj = Annotated[
    str | None,
    option(
        "--mmproj",
        "A vision-language GGUF's projector file (llama.cpp's `mmproj-*.gguf`) to serve the model's images with; "
        "without it, the mmproj file beside the model's GGUF (in its folder or Hub repository) is used.",
        MODEL,
    ),
]
Sharded = Annotated[
    str | None,
    option("--sharded", "Split the model across shards: true or false (true alone: one shard per GPU).", MODEL),
]
NumShard = Annotated[int | None, option("--num-shard", "Number of shards (tensor parallel ranks).", MODEL)]
Quantize = Annotated[
    str | None,
    option(
        "--quantize",
        "Weight quantization: int8, int4 (CPU; group size KETTLE_INT4_GROUP_SIZE, default 128), gptq, awq "
        "(4-bit checkpoints; found from config.json too), fp8 (NVIDIA Hopper GPUs). int8/int4/gptq/awq run on CUDA "
        "too (int4 there is fastest at small batches).",
        MODEL,
    ),
]
Dtype = Annotated[
    str | None, option("--dtype", "float32, bfloat16 or float16 (default: float32 on CPU, bfloat16 on GPU).", MODEL)
]
TrustRemoteCode = Annotated[bool, option("--trust-remote-code", "Allow the model's own Python code.", MODEL)]
HubCache = Annotated[
    str | None, option("--huggingface-hub-cache", "Hugging Face cache folder (default: huggingface_hub's).", MODEL)
]
LoraAdapters = Annotated[
    str | None,
    option(
        "--lora-adapters",
        "LoRA adapters to serve beside the base model, comma-separated: `name=path` or a Hub id (requests pick "
        "one with `adapter_id`, or `model` on the OpenAI routes).",
        MODEL,
    ),
]
WeightsCacheOverride = Annotated[
    str | None,
    option(
        "--weights-cache-override",
        "A local folder holding the model's files, used instead of downloading --model-id (which stays the name "
        "clients see).",
        MODEL,
    ),
]
RopeScaling = Annotated[
    str | None,
    option(
        "--rope-scaling",
        "Override the model's RoPE scaling: linear or dynamic (factor from --rope-factor, default 1.0).",
        MODEL,
    ),
]
RopeFactor = Annotated[
    float | None,
    option("--rope-factor", "RoPE scaling factor; alone it means --rope-scaling linear.", MODEL),
]
Speculate = Annotated[
    int | None,
    option("--speculate", "Draft tokens verified per step (n-gram prompt-lookup speculative decoding).", MODEL),
]
KvCacheDtype = Annotated[
    str | None,
    option(
        "--kv-cache-dtype",
        "KV cache dtype: fp16 or bf16 (half the memory per token of float32), float32, auto (the default: fp16 "
        "under a float32 model on the CPU, else the model's dtype), or TGI's fp8_e4m3fn / fp8_e5m2 (CUDA, "
        "compute capability 8.9+: half the memory per token of bf16).",
        MODEL,
    ),
]
DisableCustomKernels = Annotated[
    bool,
    option(
        "--disable-custom-kernels",
        "Turn off Kettle's own kernels (the C CPU kernels, the fused CUDA ones) and use PyTorch's ops.",
        SHARDS,
    ),
]
ShardUdsPath = Annotated[
    str | None,
    option(
        "--shard-uds-path",
        "Shard sockets are PATH-0, PATH-1, ... (removed at exit; default: kettle-server-PORT in the temp folder, "
        "so servers on different ports need no flag).",
        SHARDS,
    ),
]
UsageStats = Annotated[
    str,
    option(
        "--usage-stats",
        "TGI's usage statistics setting: on, off or no-stack.",
        COMPATIBILITY,
        no_effect="Kettle collects and sends nothing, whatever the value",
    ),
]
Ngrok = Annotated[
    bool, option("--ngrok", "Older TGI's ngrok tunnel.", COMPATIBILITY, no_effect="Kettle opens no tunnels")
]
NgrokAuthtoken = Annotated[
    str | None,
    option("--ngrok-authtoken", "Older TGI's ngrok token.", COMPATIBILITY, no_effect="Kettle opens no tunnels"),
]
NgrokEdge = Annotated[
    str | None, option("--ngrok-edge", "Older TGI's ngrok edge.", COMPATIBILITY, no_effect="Kettle opens no tunnels")
]
Env = Annotated[
    bool,
    typer.Option(
        "--env",
        "-e",
        help="Print a report of the runtime environment (versions, devices, settings) before starting, as TGI does.",
        rich_help_panel=COMPATIBILITY,
    ),
]
Version = Annotated[
    bool,
    typer.Option(
        "--version",
        "-V",
        help="Print the version and exit.",
        is_eager=True,
        callback=_print_version,
    ),
]
MasterAddr = Annotated[str, option("--master-addr", "torch.distributed rendezvous address.", SHARDS)]
MasterPort = Annotated[int, option("--master-port", "torch.distributed rendezvous port.", SHARDS)]
Nnodes = Annotated[
    int, option("--nnodes", "Hosts sharing one tensor-parallel model (each runs --num-shard ranks).", SHARDS)
]
NodeRank = Annotated[
    int, option("--node-rank", "This host's index among --nnodes; only node 0 runs the router.", SHARDS)
]
WatermarkGamma = Annotated[float, option("--watermark-gamma", "Green-list share of the watermark.", SHARDS)]
WatermarkDelta = Annotated[float, option("--watermark-delta", "Logit bias of the watermark's green list.", SHARDS)]
CpuKvCacheFraction = Annotated[
    float,
    option(
        "--cpu-kv-cache-fraction",
        "On CPU, share of available RAM the KV cache may take.",
        SHARDS,
        envvar="KETTLE_CPU_KV_CACHE_FRACTION",
    ),
]
CudaMemoryFraction = Annotated[
    float,
    option(
        "--cuda-memory-fraction",
        "On CUDA, share of the GPU memory left free by the model that the KV cache takes.",
        SHARDS,
    ),
]
CudaGraphs = Annotated[
    str | None,
    option(
        "--cuda-graphs",
        "Decode batch sizes captured as CUDA graphs, comma-separated; 0 disables "
        "(default: 1,2,4,8,16,24,32,48,64,96,128,192,256).",
        SHARDS,
        envvar=["CUDA_GRAPHS", "KETTLE_CUDA_GRAPHS"],  # TGI's name first; Kettle's earlier one still works
    ),
]
NumThreads = Annotated[
    int | None,
    option("--num-threads", "Torch threads per shard (default: physical cores).", SHARDS, envvar="KETTLE_NUM_THREADS"),
]
MaxInputLength = Annotated[
    int | None, option("--max-input-length", "Old name of --max-input-tokens (give only one).", o.LIMITS)
]


@o.with_serving_flags
def launch(
    model_id: ModelId = None,
    revision: Revision = None,
    gguf_file: GgufFile = None,
    mmproj: Mmproj = None,
    sharded: Sharded = None,
    num_shard: NumShard = None,
    quantize: Quantize = None,
    dtype: Dtype = None,
    trust_remote_code: TrustRemoteCode = False,
    huggingface_hub_cache: HubCache = None,
    lora_adapters: LoraAdapters = None,
    weights_cache_override: WeightsCacheOverride = None,
    rope_scaling: RopeScaling = None,
    rope_factor: RopeFactor = None,
    speculate: Speculate = None,
    kv_cache_dtype: KvCacheDtype = None,
    max_input_length: MaxInputLength = None,
    shard_uds_path: ShardUdsPath = None,
    master_addr: MasterAddr = "localhost",
    master_port: MasterPort = 29500,
    nnodes: Nnodes = 1,
    node_rank: NodeRank = 0,
    watermark_gamma: WatermarkGamma = S.watermark_gamma,
    watermark_delta: WatermarkDelta = S.watermark_delta,
    cpu_kv_cache_fraction: CpuKvCacheFraction = S.cpu_kv_cache_fraction,
    cuda_memory_fraction: CudaMemoryFraction = S.cuda_memory_fraction,
    cuda_graphs: CudaGraphs = None,
    num_threads: NumThreads = None,
    disable_custom_kernels: DisableCustomKernels = False,
    usage_stats: UsageStats = "on",
    ngrok: Ngrok = False,
    ngrok_authtoken: NgrokAuthtoken = None,
    ngrok_edge: NgrokEdge = None,
    env: Env = False,
    version: Version = False,
    **serving: Any,
) -> None:
    """Start a server: resolve the model, start the shards and the router, and supervise them."""
    # The parameters (the serving flags among them), which are named like LauncherConfig's fields.
    settings = {**{k: v for k, v in locals().items() if k != "serving"}, **serving}
    del settings["version"]  # handled by its callback before this runs
    from kettle.launcher import tgi_environment
    from kettle.launcher.config import LauncherConfig, pick_max_input_tokens
    from kettle.launcher.main import launch as run_launcher
    from kettle.router.listen_address import listen_address

    if settings.pop("env"):
        from kettle.launcher.env_report import environment_report

        typer.echo(environment_report())
    try:
        disabled = settings["disable_prefix_caching"] or tgi_environment.prefix_caching_disabled()
        settings["disable_prefix_caching"] = disabled
        settings["hostname"] = listen_address(settings["hostname"])  # HOSTNAME is often a container's name
        settings["sharded"] = parse_boolean(sharded)
        asked = settings["max_input_tokens"], settings.pop("max_input_length")
        settings["max_input_tokens"] = pick_max_input_tokens(*asked)
        settings["cors_allow_origin"] = tuple(settings["cors_allow_origin"] or ())
        config = LauncherConfig(**settings)
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None
    raise typer.Exit(run_launcher(config))
