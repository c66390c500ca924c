"""The command line: TGI's launcher flags (README.md, Flags), environment fallbacks, aliases, and the child commands'
contracts."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from kettle.cli import app
from kettle.hub import ResolvedModel
from kettle.launcher.config import INACTIVE_FLAGS, LauncherConfig
from kettle.launcher.specs import kettle_command, router_spec, shard_spec
from kettle.router.config import RouterConfig
from kettle.shard.config import ShardConfig

# text-generation-launcher's flags, plus the CPU and CUDA flags Kettle adds.
TGI_FLAGS = (
    "--model-id",
    "--revision",
    "--sharded",
    "--num-shard",
    "--quantize",
    "--dtype",
    "--trust-remote-code",
    "--max-concurrent-requests",
    "--max-best-of",
    "--max-stop-sequences",
    "--max-top-n-tokens",
    "--max-input-tokens",
    "--max-input-length",
    "--max-total-tokens",
    "--waiting-served-ratio",
    "--max-batch-prefill-tokens",
    "--max-batch-total-tokens",
    "--max-waiting-tokens",
    "--max-batch-size",
    "--hostname",
    "--port",
    "--shard-uds-path",
    "--master-addr",
    "--master-port",
    "--huggingface-hub-cache",
    "--json-output",
    "--otlp-endpoint",
    "--otlp-service-name",
    "--cors-allow-origin",
    "--api-key",
    "--watermark-gamma",
    "--watermark-delta",
    "--tokenizer-config-path",
    "--disable-grammar-support",
    "--max-client-batch-size",
    "--payload-limit",
    "--enable-prefill-logprobs",
    "--disable-prefix-caching",
    "--graceful-termination-timeout",
    "--validation-workers",
    "--cpu-kv-cache-fraction",
    "--num-threads",
    "--cuda-memory-fraction",
    "--cuda-graphs",
)
WIDE = {"COLUMNS": "300", "TERMINAL_WIDTH": "300"}

runner = CliRunner()


def command_params(name: str) -> dict:
    """The click parameters of one command, by flag name."""
    command = get_command(app).commands[name]
    return {opt: param for param in command.params for opt in param.opts}


@pytest.fixture
def captured(monkeypatch):
    """Replaces what the commands finally run, recording the config each was given."""
    seen: dict[str, object] = {}

    def record(key):
        def run(config):
            seen[key] = config
            return 0

        return run

    monkeypatch.setattr("kettle.launcher.main.launch", record("launch"))
    for module, function in (("kettle.shard.server", "serve"), ("kettle.router.server", "run")):
        monkeypatch.setitem(sys.modules, module, types.SimpleNamespace(**{function: record(module)}))
    return seen


def test_launch_help_lists_every_spec_flag():
    result = runner.invoke(app, ["launch", "--help"], env=WIDE)
    assert result.exit_code == 0
    missing = [flag for flag in TGI_FLAGS if flag not in result.output]
    assert not missing
    assert set(TGI_FLAGS) <= set(command_params("launch"))


def test_every_launch_flag_reads_its_environment_variable():
    params = command_params("launch")
    for flag in TGI_FLAGS:
        expected = flag.lstrip("-").replace("-", "_").upper()
        if flag in ("--cpu-kv-cache-fraction", "--num-threads"):
            expected = "KETTLE_" + expected
        envvar = params[flag].envvar
        assert (envvar[0] if isinstance(envvar, list) else envvar) == expected, flag


def test_defaults_match_the_launcher_config(captured):
    assert runner.invoke(app, ["launch"]).exit_code == 0
    assert captured["launch"] == LauncherConfig()


def test_environment_fallback_and_flag_precedence(captured):
    env = {
        "MAX_BATCH_PREFILL_TOKENS": "512",
        "TRUST_REMOTE_CODE": "true",
        "KETTLE_CPU_KV_CACHE_FRACTION": "0.25",
        "PORT": "8080",
        "MODEL_ID": "/models/x",
    }
    result = runner.invoke(app, ["launch", "--port", "9000"], env=env)
    assert result.exit_code == 0, result.output
    config = captured["launch"]
    assert config.max_batch_prefill_tokens == 512
    assert config.trust_remote_code is True
    assert config.cpu_kv_cache_fraction == 0.25
    assert config.model_id == "/models/x"
    assert config.port == 9000  # the flag wins over PORT


def test_max_input_length_is_an_alias(captured):
    assert runner.invoke(app, ["launch", "--max-input-length", "100"]).exit_code == 0
    assert captured["launch"].max_input_tokens == 100


def test_max_input_tokens_and_length_together_are_an_error(captured):
    result = runner.invoke(app, ["launch", "--max-input-tokens", "10", "--max-input-length", "20"], env=WIDE)
    assert result.exit_code == 2
    assert "--max-input-length" in result.output
    assert "launch" not in captured


def test_the_kv_cache_dtype_flag_is_active():
    help_text = command_params("launch")["--kv-cache-dtype"].help
    assert "(not active yet)" not in help_text and "fp16" in help_text and "bf16" in help_text


def test_inactive_flag_table_matches_the_help():
    for name in INACTIVE_FLAGS:
        assert "(not active yet)" in command_params("launch")["--" + name.replace("_", "-")].help


@pytest.mark.parametrize("args", [["--sharded", "maybe"], ["--sharded", "false", "--num-shard", "2"]])
def test_bad_sharding_flags_fail_clearly(args, captured):
    result = runner.invoke(app, ["launch", *args], env=WIDE)
    assert result.exit_code == 2
    assert "true or false" in result.output or "contradicts" in result.output
    assert "launch" not in captured


def test_num_shard_starts_that_many_ranks(captured):
    assert runner.invoke(app, ["launch", "--num-shard", "2"], env=WIDE).exit_code == 0
    config = captured["launch"]
    assert config.world_size == 2
    assert [config.shard_config("/m", rank).rank for rank in range(2)] == [0, 1]


def test_sharded_without_num_shard_on_the_cpu_asks_for_num_shard(captured, monkeypatch):
    monkeypatch.setattr("kettle.launcher.config.visible_gpus", lambda: 0)
    result = runner.invoke(app, ["launch", "--sharded", "true"], env=WIDE)
    assert result.exit_code == 2
    assert "--num-shard" in result.output
    assert "launch" not in captured


def test_sharded_alone_uses_every_visible_gpu(captured, monkeypatch):
    monkeypatch.setattr("kettle.launcher.config.visible_gpus", lambda: 4)
    assert runner.invoke(app, ["launch", "--sharded", "true"], env=WIDE).exit_code == 0
    assert captured["launch"].world_size == 4


def test_quantize_fp8_on_the_cpu_names_the_alternatives(captured, monkeypatch):
    monkeypatch.setattr("kettle.launcher.config.cuda_available", lambda: False)
    result = runner.invoke(app, ["launch", "--quantize", "fp8"], env=WIDE)
    assert result.exit_code == 2
    assert "NVIDIA GPU" in result.output and "--dtype float32" in result.output and "bfloat16" in result.output
    assert "launch" not in captured


def test_unknown_quantize_method_fails_clearly(captured):
    result = runner.invoke(app, ["launch", "--quantize", "eetq"], env=WIDE)
    assert result.exit_code == 2
    assert "not supported" in result.output and "fp8" in result.output and "int4" in result.output
    assert "launch" not in captured


def test_quantize_fp8_reaches_the_shard_on_cuda(captured, monkeypatch):
    monkeypatch.setattr("kettle.launcher.config.cuda_available", lambda: True)
    assert runner.invoke(app, ["launch", "--quantize", "fp8"]).exit_code == 0
    config = captured["launch"]
    assert config.shard_config("/m", rank=0).quantize == "fp8"
    assert "--quantize" in shard_spec(config, "/m", rank=0).argv


def test_cuda_flags_reach_the_shard_config(captured):
    args = ["launch", "--cuda-graphs", "1,4", "--cuda-memory-fraction", "0.5"]
    assert runner.invoke(app, args).exit_code == 0
    shard = captured["launch"].shard_config("/m", rank=0)
    assert (shard.cuda_graphs, shard.graph_buckets, shard.cuda_memory_fraction) == ("1,4", (1, 4), 0.5)
    assert ShardConfig(model_path="/m", cuda_graphs="0").graph_buckets == ()
    assert ShardConfig(model_path="/m").graph_buckets is None  # KETTLE_CUDA_GRAPHS or the default decides


def test_cuda_graphs_reads_the_existing_environment_variable(captured):
    assert runner.invoke(app, ["launch"], env={"KETTLE_CUDA_GRAPHS": "0"}).exit_code == 0
    assert captured["launch"].cuda_graphs == "0"


@pytest.mark.parametrize("args", [["--cuda-graphs", "1,-2"], ["--cuda-graphs", "a"], ["--cuda-memory-fraction", "0"]])
def test_bad_cuda_flags_are_usage_errors(args, captured):
    result = runner.invoke(app, ["launch", *args], env=WIDE)
    assert result.exit_code == 2
    assert "launch" not in captured


def test_sharded_false_and_one_shard_are_accepted(captured):
    assert runner.invoke(app, ["launch", "--sharded", "false", "--num-shard", "1"]).exit_code == 0
    assert captured["launch"].sharded is False


def test_shard_argv_round_trips_to_the_same_shard_config(captured):
    config = LauncherConfig(
        dtype="bfloat16",
        trust_remote_code=True,
        num_threads=2,
        watermark_gamma=0.25,
        cuda_memory_fraction=0.7,
        cuda_graphs="1,2",
    )
    spec = shard_spec(config, "/models/m", rank=0)
    command = kettle_command()
    assert list(spec.argv[: len(command) + 1]) == [*command, "serve"]
    result = runner.invoke(app, list(spec.argv[len(command) :]), env={"RANK": "", "WORLD_SIZE": ""})
    assert result.exit_code == 0, result.output
    assert captured["kettle.shard.server"] == config.shard_config("/models/m", rank=0)


def test_router_argv_round_trips_to_the_same_router_config(captured):
    config = LauncherConfig(
        max_total_tokens=512, cors_allow_origin=("http://a", "http://b"), api_key="k", disable_prefix_caching=True
    )
    model = ResolvedModel(Path("/models/m"), "org/model", "abc123")
    result = runner.invoke(app, list(router_spec(config, model).argv[len(kettle_command()) :]))
    assert result.exit_code == 0, result.output
    assert captured["kettle.router.server"] == config.router_config("/models/m", "org/model", "abc123")


def test_router_defaults_match_router_config(captured):
    assert runner.invoke(app, ["router", "--tokenizer-name", "/t"]).exit_code == 0
    expected = RouterConfig(master_shard_uds_path="/tmp/kettle-server-0", tokenizer_name="/t", model_id="/t")
    assert captured["kettle.router.server"] == expected


def test_serve_defaults_match_shard_config(captured):
    assert runner.invoke(app, ["serve", "/m"], env={"RANK": "", "WORLD_SIZE": ""}).exit_code == 0
    assert captured["kettle.shard.server"] == ShardConfig(model_path="/m")


def test_importing_the_cli_does_not_import_torch():
    code = "import sys, kettle.cli; assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_download_weights_reports_a_missing_model_in_one_line(tmp_path):
    result = runner.invoke(app, ["download-weights", str(tmp_path / "missing.gguf")])
    assert result.exit_code == 1
    assert "Traceback" not in result.output


def test_nnodes_gives_each_host_its_block_of_ranks():
    from kettle.launcher.specs import shard_specs

    config = LauncherConfig(num_shard=2, nnodes=2, node_rank=1, master_addr="10.0.0.1")
    envs = [spec.env for spec in shard_specs(config, "/m")]
    assert [(e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"]) for e in envs] == [
        ("2", "0", "4", "2"),
        ("3", "1", "4", "2"),
    ]
    assert all(e["MASTER_ADDR"] == "10.0.0.1" for e in envs)
    with pytest.raises(ValueError, match="--node-rank"):
        LauncherConfig(nnodes=2, node_rank=2)
