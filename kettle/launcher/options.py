"""The command-line options `kettle launch` and `kettle router` share, with TGI's names and help.

Each is an `Annotated` type used as a parameter annotation; every option also reads the environment
variable of the same name in UPPER_SNAKE case (`--max-total-tokens` ← `MAX_TOTAL_TOKENS`), as TGI's
launcher and router do. Their defaults are written once, in `kettle.router.config.ServingFlags`, and
`with_serving_flags` adds them to both commands' signatures.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Annotated, Any

import typer

INACTIVE = "(not active yet)"
MODEL = "Model"
LIMITS = "Limits and batching"
SERVER = "HTTP server"
SHARDS = "Shards"
COMPATIBILITY = "Accepted for TGI compatibility"
IMAGES = "Images (models that take them)"


def option(
    flag: str,
    help: str,
    panel: str,
    *short: str,
    envvar: str | list[str] | None = None,
    inactive: bool = False,
    no_effect: str | None = None,
    **extra,
):
    """A typer option named `flag` (and the `short` names), read from `envvar` (default: the flag in UPPER_SNAKE
    case; a list is tried in order).

    `inactive` marks a flag accepted for TGI compatibility that has no effect yet; `no_effect` gives the reason a
    flag accepted for compatibility will never have one. Either way the help says so.
    """
    env = envvar or flag.lstrip("-").replace("-", "_").upper()
    text = f"{help} {INACTIVE}" if inactive else help
    if no_effect is not None:
        text = f"{text} (no effect: {no_effect})"
    return typer.Option(flag, *short, envvar=env, help=text, rich_help_panel=panel, show_envvar=True, **extra)


MaxConcurrentRequests = Annotated[
    int, option("--max-concurrent-requests", "Requests handled at once; more get 429 overloaded.", LIMITS)
]
MaxBestOf = Annotated[int, option("--max-best-of", "Largest `best_of` a request may ask for.", LIMITS)]
MaxStopSequences = Annotated[int, option("--max-stop-sequences", "Most `stop` sequences per request.", LIMITS)]
MaxTopNTokens = Annotated[int, option("--max-top-n-tokens", "Largest `top_n_tokens` per request.", LIMITS)]
MaxInputTokens = Annotated[
    int | None,
    option("--max-input-tokens", "Most prompt tokens per request (default: derived at warmup).", LIMITS),
]
MaxTotalTokens = Annotated[
    int | None,
    option("--max-total-tokens", "Most prompt + generated tokens per request (default: derived at warmup).", LIMITS),
]
WaitingServedRatio = Annotated[
    float,
    option("--waiting-served-ratio", "Waiting/running ratio at which queued requests join the batch.", LIMITS),
]
MaxBatchPrefillTokens = Annotated[
    int | None, option("--max-batch-prefill-tokens", "Most tokens computed in one prefill (default: derived).", LIMITS)
]
MaxBatchTotalTokens = Annotated[
    int | None,
    option("--max-batch-total-tokens", "KV cache capacity in tokens (default: from the memory at warmup).", LIMITS),
]
MaxWaitingTokens = Annotated[
    int, option("--max-waiting-tokens", "Decode steps a queued request may wait before it forces a prefill.", LIMITS)
]
MaxBatchSize = Annotated[int | None, option("--max-batch-size", "Most requests in one batch (default: none).", LIMITS)]
ValidationWorkers = Annotated[
    int, option("--validation-workers", "Tokenizer workers for validation, off the event loop.", LIMITS)
]
MaxClientBatchSize = Annotated[
    int, option("--max-client-batch-size", "Most prompts in one /v1/completions request.", LIMITS)
]
PayloadLimit = Annotated[int, option("--payload-limit", "Largest request body in bytes; larger get 413.", LIMITS)]

Hostname = Annotated[
    str,
    option(
        "--hostname",
        "IP address the HTTP server listens on; anything else (such as the container name Docker and Kubernetes "
        "put in HOSTNAME) means 0.0.0.0, as in TGI.",
        SERVER,
    ),
]
Port = Annotated[int, option("--port", "TCP port of the HTTP server.", SERVER, "-p")]
ApiKey = Annotated[
    str | None, option("--api-key", "Require `Authorization: Bearer KEY` on the generation routes.", SERVER)
]
CorsAllowOrigin = Annotated[
    list[str] | None, option("--cors-allow-origin", "An origin allowed by CORS (repeat for more).", SERVER)
]
JsonOutput = Annotated[bool, option("--json-output", "Log JSON lines instead of text.", SERVER)]
OtlpEndpoint = Annotated[
    str | None,
    option("--otlp-endpoint", "OpenTelemetry collector (OTLP/gRPC, e.g. http://localhost:4317) for traces.", SERVER),
]
OtlpServiceName = Annotated[str, option("--otlp-service-name", "Service name in exported traces.", SERVER)]
PrometheusPort = Annotated[
    int, option("--prometheus-port", "Port serving /metrics on its own (0: off; a taken port only warns).", SERVER)
]
TokenizerConfigPath = Annotated[
    str | None, option("--tokenizer-config-path", "A tokenizer_config.json to use instead of the model's.", SERVER)
]
DisableGrammarSupport = Annotated[
    bool, option("--disable-grammar-support", "Reject `grammar` / `response_format` requests.", SERVER)
]
EnablePrefillLogprobs = Annotated[
    bool, option("--enable-prefill-logprobs", "Allow requests for prompt logprobs (`decoder_input_details`).", SERVER)
]
DisablePrefixCaching = Annotated[
    bool,
    option("--disable-prefix-caching", "Do not reuse the KV cache of prompt prefixes shared across requests.", LIMITS),
]
MaxImagesPerRequest = Annotated[
    int, option("--max-images-per-request", "Most images one request may carry (422 beyond).", IMAGES)
]
MaxImageBytes = Annotated[int, option("--max-image-bytes", "Largest image file accepted, in bytes.", IMAGES)]
MaxImagePixels = Annotated[int, option("--max-image-pixels", "Most pixels (width x height) of an image.", IMAGES)]
ImageFetchTimeout = Annotated[
    float, option("--image-fetch-timeout", "Seconds an http(s) image URL's whole fetch may take.", IMAGES)
]
DisableImageFetch = Annotated[
    bool, option("--disable-image-fetch", "Read only data: image URLs; never fetch http(s) ones.", IMAGES)
]
DisableChunkedPrefill = Annotated[
    bool,
    option(
        "--disable-chunked-prefill",
        "Prefill whole prompts in their own forward instead of chunks under --max-batch-prefill-tokens "
        "that run together with the running decodes.",
        LIMITS,
    ),
]
GracefulTerminationTimeout = Annotated[
    float,
    option("--graceful-termination-timeout", "Seconds each process gets to stop after SIGTERM.", SERVER),
]


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))


def with_serving_flags(command: Callable[..., Any]) -> Callable[..., Any]:
    """Gives `command`, which takes `**serving`, one keyword parameter per serving flag (`ServingFlags`' fields, in
    their order): its option is the type of the same name above (`max_best_of` → `MaxBestOf`), its default
    `SERVING_DEFAULTS`' (a list option's is None, typer's empty list). `kettle launch` and `kettle router` both take
    their shared flags from here, so neither writes their list out."""
    from kettle.router.config import SERVING_DEFAULTS, ServingFlags

    options = globals()
    signature = inspect.signature(command, eval_str=True)
    own = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    shared = []
    for field in dataclasses.fields(ServingFlags):
        option = options[_camel(field.name)]
        default = getattr(SERVING_DEFAULTS, field.name)
        if isinstance(default, tuple):  # typer gives a list option as a list, or None when not given
            default = None
        shared.append(inspect.Parameter(field.name, inspect.Parameter.KEYWORD_ONLY, annotation=option, default=default))
    command.__signature__ = signature.replace(parameters=[*own, *shared])
    return command
