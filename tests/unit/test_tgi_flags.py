"""Flag parity with text-generation-launcher: TGI's whole flag list, kept here as data, walked through the parser.

Every TGI flag must parse (by its long name, its short name, and its environment variable) and reach the launcher's
configuration; the flags Kettle has no use for say so in `--help`. The HOSTNAME rule and the TGI-only environment
names are checked here too.
"""

from __future__ import annotations

import logging

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from kettle.cli import app, launcher_app
from kettle.launcher.config import INACTIVE_FLAGS, NO_EFFECT_FLAGS, LauncherConfig
from kettle.launcher.specs import shard_spec
from kettle.router.listen_address import listen_address

# text-generation-launcher 3.x `--help`, plus the ngrok flags of older releases: (names, environment variable, a
# valid value; None for switches). -h/--help and -V/--version are checked on their own below.
TGI_LAUNCHER_FLAGS: list[tuple[tuple[str, ...], str | None, str | None]] = [
    (("--model-id",), "MODEL_ID", "/models/x"),
    (("--revision",), "REVISION", "refs/pr/2"),
    (("--validation-workers",), "VALIDATION_WORKERS", "3"),
    (("--sharded",), "SHARDED", "false"),
    (("--num-shard",), "NUM_SHARD", "2"),
    (("--quantize",), "QUANTIZE", "awq"),
    (("--speculate",), "SPECULATE", "2"),
    (("--dtype",), "DTYPE", "bfloat16"),
    (("--kv-cache-dtype",), "KV_CACHE_DTYPE", "bf16"),
    (("--trust-remote-code",), "TRUST_REMOTE_CODE", None),
    (("--max-concurrent-requests",), "MAX_CONCURRENT_REQUESTS", "16"),
    (("--max-best-of",), "MAX_BEST_OF", "3"),
    (("--max-stop-sequences",), "MAX_STOP_SEQUENCES", "6"),
    (("--max-top-n-tokens",), "MAX_TOP_N_TOKENS", "7"),
    (("--max-input-tokens",), "MAX_INPUT_TOKENS", "100"),
    (("--max-input-length",), "MAX_INPUT_LENGTH", "100"),
    (("--max-total-tokens",), "MAX_TOTAL_TOKENS", "200"),
    (("--waiting-served-ratio",), "WAITING_SERVED_RATIO", "1.2"),
    (("--max-batch-prefill-tokens",), "MAX_BATCH_PREFILL_TOKENS", "512"),
    (("--max-batch-total-tokens",), "MAX_BATCH_TOTAL_TOKENS", "4096"),
    (("--max-waiting-tokens",), "MAX_WAITING_TOKENS", "10"),
    (("--max-batch-size",), "MAX_BATCH_SIZE", "8"),
    (("--cuda-graphs",), "CUDA_GRAPHS", "1,2"),
    (("--hostname",), "HOSTNAME", "127.0.0.1"),
    (("-p", "--port"), "PORT", "8080"),
    (("--prometheus-port",), "PROMETHEUS_PORT", "9100"),
    (("--shard-uds-path",), "SHARD_UDS_PATH", "/tmp/tgi-sockets"),
    (("--master-addr",), "MASTER_ADDR", "10.0.0.1"),
    (("--master-port",), "MASTER_PORT", "29501"),
    (("--huggingface-hub-cache",), "HUGGINGFACE_HUB_CACHE", "/data"),
    (("--weights-cache-override",), "WEIGHTS_CACHE_OVERRIDE", "/weights"),
    (("--disable-custom-kernels",), "DISABLE_CUSTOM_KERNELS", None),
    (("--cuda-memory-fraction",), "CUDA_MEMORY_FRACTION", "0.8"),
    (("--rope-scaling",), "ROPE_SCALING", "dynamic"),
    (("--rope-factor",), "ROPE_FACTOR", "2.0"),
    (("--json-output",), "JSON_OUTPUT", None),
    (("--otlp-endpoint",), "OTLP_ENDPOINT", "http://localhost:4317"),
    (("--otlp-service-name",), "OTLP_SERVICE_NAME", "text-generation-inference.router"),
    (("--cors-allow-origin",), "CORS_ALLOW_ORIGIN", "http://example.com"),
    (("--api-key",), "API_KEY", "secret"),
    (("--watermark-gamma",), "WATERMARK_GAMMA", "0.3"),
    (("--watermark-delta",), "WATERMARK_DELTA", "1.5"),
    (("--ngrok",), "NGROK", None),
    (("--ngrok-authtoken",), "NGROK_AUTHTOKEN", "token"),
    (("--ngrok-edge",), "NGROK_EDGE", "edge"),
    (("--tokenizer-config-path",), "TOKENIZER_CONFIG_PATH", "/t/tokenizer_config.json"),
    (("--disable-grammar-support",), "DISABLE_GRAMMAR_SUPPORT", None),
    (("-e", "--env"), None, None),
    (("--max-client-batch-size",), "MAX_CLIENT_BATCH_SIZE", "8"),
    (("--lora-adapters",), "LORA_ADAPTERS", "org/adapter"),
    (("--usage-stats",), "USAGE_STATS", "off"),
    (("--payload-limit",), "PAYLOAD_LIMIT", "1000"),
    (("--enable-prefill-logprobs",), "ENABLE_PREFILL_LOGPROBS", None),
    (("--graceful-termination-timeout",), "GRACEFUL_TERMINATION_TIMEOUT", "30"),
]
# Flags whose whole point is the environment of a single launch, not the configuration.
NOT_IN_CONFIG = {"--env"}
WIDE = {"COLUMNS": "300", "TERMINAL_WIDTH": "300"}
IDS = [names[-1] for names, _, _ in TGI_LAUNCHER_FLAGS]

runner = CliRunner()


@pytest.fixture
def launched(monkeypatch):
    """Replaces the launcher's run: records the configuration `kettle launch` built."""
    seen: list[LauncherConfig] = []
    monkeypatch.setattr("kettle.launcher.main.launch", lambda config: seen.append(config) or 0)
    # A machine with GPUs must not change what --num-shard / --sharded mean in these tests.
    monkeypatch.setattr("kettle.launcher.config.visible_gpus", lambda: 0)
    monkeypatch.setattr("kettle.launcher.config.cuda_available", lambda: False)
    return seen


def _argv(name: str, value: str | None) -> list[str]:
    return [name] if value is None else [name, value]


@pytest.mark.parametrize(("names", "envvar", "value"), TGI_LAUNCHER_FLAGS, ids=IDS)
def test_every_tgi_flag_parses_and_reaches_the_configuration(names, envvar, value, launched):
    for name in names:
        result = runner.invoke(app, ["launch", *_argv(name, value)], env=WIDE)
        assert result.exit_code == 0, f"{name}: {result.output}"
        if names[-1] not in NOT_IN_CONFIG:
            assert launched[-1] != LauncherConfig(), f"{name} changed nothing"
    if envvar is not None:
        result = runner.invoke(app, ["launch"], env={envvar: value or "true"})
        assert result.exit_code == 0, f"{envvar}: {result.output}"
        assert launched[-1] == launched[-2], f"{envvar} differs from {names[-1]}"


def test_gguf_file_flag_and_its_environment_variable_reach_the_configuration(launched):
    # Not a flag of TGI's launcher: Kettle's own, for GGUF repositories that hold one file per quantization.
    args = ["launch", "--model-id", "org/x-GGUF"]
    assert runner.invoke(app, [*args, "--gguf-file", "x.Q4_K_M.gguf"]).exit_code == 0
    assert runner.invoke(app, args, env={"GGUF_FILE": "x.Q4_K_M.gguf"}).exit_code == 0
    assert launched[-1] == launched[-2] and launched[-1].gguf_file == "x.Q4_K_M.gguf"


def test_text_generation_launcher_is_kettle_launch(launched):
    result = runner.invoke(launcher_app, ["--model-id", "/models/x", "-p", "8080"])
    assert result.exit_code == 0, result.output
    assert (launched[-1].model_id, launched[-1].port) == ("/models/x", 8080)


@pytest.mark.parametrize("flag", ["-V", "--version"])
def test_version_prints_and_exits_without_launching(flag, launched):
    import kettle

    result = runner.invoke(app, ["launch", flag])
    assert result.exit_code == 0 and result.output.strip() == f"kettle {kettle.__version__}"
    assert launched == []


def test_env_prints_the_environment_report_then_launches(launched):
    result = runner.invoke(app, ["launch", "-e"])
    assert result.exit_code == 0, result.output
    for line in ("Kettle", "Python", "Package torch", "GPUs", "C compiler"):
        assert line in result.output
    assert len(launched) == 1


def test_help_says_which_flags_do_nothing_and_why():
    params = {opt: p for p in get_command(app).commands["launch"].params for opt in p.opts}
    for name in NO_EFFECT_FLAGS:
        assert "(no effect: " in params["--" + name.replace("_", "-")].help
    assert "Kettle collects and sends nothing" in params["--usage-stats"].help
    for name in INACTIVE_FLAGS:
        assert "(not active yet)" in params["--" + name.replace("_", "-")].help
    help_text = runner.invoke(app, ["launch", "--help"], env=WIDE).output
    assert "Accepted for TGI compatibility" in help_text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--rope-scaling", "yarn"], "--rope-scaling must be one of linear, dynamic"),
        (["--rope-factor", "0"], "--rope-factor must be > 0"),
        (["--kv-cache-dtype", "int8"], "--kv-cache-dtype must be one of auto, float32, fp16, bf16, fp8_e4m3fn"),
        (["--kv-cache-dtype", "fp8_e5m2"], "--kv-cache-dtype fp8_e5m2 needs a CUDA GPU: on the CPU use fp16 or bf16"),
        (["--usage-stats", "maybe"], "--usage-stats must be one of on, off, no-stack"),
        (["--model-id", "org/x-GGUF", "--gguf-file", "x.bin"], "--gguf-file names a .gguf file"),
        (["--gguf-file", "x.gguf"], "give --model-id too"),
    ],
)
def test_bad_values_are_usage_errors(args, message, launched):
    result = runner.invoke(app, ["launch", *args], env=WIDE)
    assert result.exit_code == 2 and message in result.output
    assert launched == []


@pytest.mark.parametrize(
    ("args", "rope"),
    [
        ([], None),
        (["--rope-factor", "2"], ("linear", 2.0)),
        (["--rope-scaling", "dynamic"], ("dynamic", 1.0)),
        (["--rope-scaling", "dynamic", "--rope-factor", "4"], ("dynamic", 4.0)),
    ],
)
def test_rope_flags_resolve_as_tgi_and_reach_the_shards(args, rope, launched):
    assert runner.invoke(app, ["launch", *args]).exit_code == 0
    config = launched[-1]
    assert config.rope == rope
    env = shard_spec(config, "/m", rank=0).env
    if rope is None:
        assert "ROPE_SCALING" not in config.shard_environment()
    else:
        assert (env["ROPE_SCALING"], float(env["ROPE_FACTOR"])) == rope


def test_disable_custom_kernels_turns_the_kernels_off_in_the_shards(launched):
    assert runner.invoke(app, ["launch", "--disable-custom-kernels"]).exit_code == 0
    env = shard_spec(launched[-1], "/m", rank=0).env
    assert env["KETTLE_TUNING"] == "cpu-kernels=off,cuda-fused-kernels=off"


def test_shard_sockets_are_per_port_unless_given(launched):
    for port in ("3000", "3001"):
        assert runner.invoke(app, ["launch", "--port", port]).exit_code == 0
    first, second = launched
    assert first.uds_prefix != second.uds_prefix and first.uds_prefix.endswith("kettle-server-3000")
    assert first.shard_config("/m", 0).socket_path == first.uds_prefix + "-0"
    assert first.router_config("/m", "m").master_shard_uds_path == first.uds_prefix + "-0"
    assert runner.invoke(app, ["launch", "--shard-uds-path", "/tmp/mine"]).exit_code == 0
    assert launched[-1].uds_prefix == "/tmp/mine"


@pytest.mark.parametrize("value", ["off", "0", "false"])
def test_prefix_caching_environment_variable_turns_it_off(value, launched):
    assert runner.invoke(app, ["launch"], env={"PREFIX_CACHING": value}).exit_code == 0
    assert launched[-1].disable_prefix_caching is True
    assert launched[-1].router_config("/m", "m").disable_prefix_caching is True


def test_prefix_caching_on_by_default_and_with_prefix_caching_1(launched):
    assert runner.invoke(app, ["launch"], env={"PREFIX_CACHING": "1"}).exit_code == 0
    assert launched[-1].disable_prefix_caching is False


def test_hf_api_token_becomes_hf_token(monkeypatch):
    from kettle.launcher import tgi_environment

    environ = {"HF_API_TOKEN": "hf_abc", "HF_TOKEN": "hf_old"}
    tgi_environment.apply_token_alias(environ)
    assert environ["HF_TOKEN"] == "hf_abc"  # TGI's launcher lets HF_API_TOKEN win
    environ = {}
    tgi_environment.apply_token_alias(environ)
    assert "HF_TOKEN" not in environ


@pytest.mark.parametrize(
    ("hostname", "address"),
    [
        ("127.0.0.1", "127.0.0.1"),
        ("0.0.0.0", "0.0.0.0"),
        ("::1", "::1"),
        ("::", "::"),
        ("kettle-7d9f8b6c5-x2x4q", "0.0.0.0"),  # a pod name, as Kubernetes sets HOSTNAME
        ("3f4e5d6c7b8a", "0.0.0.0"),  # a container id, as Docker sets it
        ("localhost", "0.0.0.0"),  # not an IP address either: TGI listens everywhere then too
    ],
)
def test_hostname_rule(hostname, address, caplog):
    with caplog.at_level(logging.WARNING, logger="kettle.router"):
        assert listen_address(hostname) == address
    assert ("Invalid hostname, defaulting to 0.0.0.0" in caplog.text) == (hostname != address)


def test_router_binds_everywhere_when_hostname_is_a_container_name(monkeypatch):
    import sys
    import types

    seen = []
    monkeypatch.setitem(sys.modules, "kettle.router.server", types.SimpleNamespace(run=seen.append))
    result = runner.invoke(app, ["router", "--tokenizer-name", "/t"], env={"HOSTNAME": "3f4e5d6c7b8a"})
    assert result.exit_code == 0, result.output
    assert seen[0].hostname == "0.0.0.0"


def test_weights_cache_override_serves_a_local_folder_under_the_model_id(tiny_llama_path, tmp_path):
    from kettle.hub import ModelNotFound
    from kettle.launcher.prepare import ModelRequest, resolve

    model = resolve(ModelRequest.of(LauncherConfig(model_id="org/model", weights_cache_override=str(tiny_llama_path))))
    assert model.display_id == "org/model"
    assert (model.path / "config.json").is_file()
    with pytest.raises(ModelNotFound, match="--weights-cache-override"):
        resolve(ModelRequest.of(LauncherConfig(model_id="org/model", weights_cache_override=str(tmp_path / "missing"))))


def test_launcher_applies_the_hostname_rule_too(launched):
    assert runner.invoke(app, ["launch"], env={"HOSTNAME": "kettle-7d9f8b6c5-x2x4q"}).exit_code == 0
    assert launched[-1].hostname == "0.0.0.0"
    assert launched[-1] == LauncherConfig()
