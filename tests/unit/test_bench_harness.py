"""The benchmark harness: one entry point naming every benchmark, each parsing the commands the docs quote, and
the one timing helper (interleaved calls, median and minimum, same-round ratios)."""

from __future__ import annotations

import functools
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from bench import serving
from bench.__main__ import BENCHMARKS, benchmark, command
from kettle.bench.process import child_environment
from kettle.bench.timing import Timing, interleaved, ratio_summary, same_round

ROOT = Path(__file__).resolve().parents[2]
# Commands the docs and the results file quote, each as a benchmark's arguments: every one must still parse.
QUOTED = [
    "peers --threads 2 --engines transformers,ctranslate2,llama.cpp,kettle --rounds 5",
    "peers --engines transformers,kettle --streams 1,4,8,16 --threads default",
    "peers --shape tinyllama-1.1b --qtype Q4_K_M --rounds 3 --untied",
    "decode --quantize int4 --batch 1 16 --steps 30 --threads 2",
    "decode --family qwen3 --quantize int4 --batch 1 8 --vs layers",
    "decode --batch 16 32 17 --steps 30 --vs float-panels",
    "decode --batch 1 --steps 300 --switch kettle_channel_one",
    "decode --vs schemes --threads 2 --steps 64",
    "decode --vs gguf --steps 40",
    "decode --vs kv-dtypes --skip-accuracy --steps 10",
    "decode --vs gguf-types --types Q8_0 Q5_0",
    "decode --vs compile --batch 1 16 --variants eager-kernels compiled-kernels --mode max-autotune-no-cudagraphs",
    "decode --vs kernels --threads 1 --batch 1 4 16 --bf16 --fp32-kernels --dense",
    "decode --vs fallback --requests 16 --steps 64 --threads 2",
    "decode --vs grammar-engines",
    "decode --vs invariance --layout rows-avx2 --batch 1 8 16 32",
    "decode --vs invariance-mixed --layout rows-avx2",
    "prefill --schemes int4 --tokens 2000 --trials 5 --sdpa --chunk 256",
    "prefill --chunked --streams 2 --stream-tokens 48 --tokens 500 --trials 1",
    "prefill --prefix-cache --trials 5 --tokens 1000",
    "served --rounds 7 --engine",
    "served --load --streams 1,4,8,16 --max-new-tokens 128",
    "served --trees before=/tmp/kettle-base after=. --flags '' --flags '--quantize int4' --requests 8",
    "served --shards 1,2 --streams 1,4 --max-new-tokens 48",
    "served --grammar --streams 1,8 --rounds 3",
    "speculation --server-args '' --configs off,speculate,rows,speculate-rows --together --rounds 3",
    "speculation --in-process --rounds 5 --configs off,speculate-7rows,speculate --max-steps 1",
    "lora --quantize int4 --rounds 5",
    "lora --step --dtype-float32",
    "memory --runs 1 -- --quantize int4",
    "memory --schemes",
    "memory --router --chars 100000 --truncate 1000",
    "startup --runs 2",
    "gpu --kv-dtypes fp8_e4m3fn fp8_e5m2 --batch 1 32 --context 2048 --steps 30 --warmup 5",
    "gpu --int4-kernels --batch 1 8 16 32 64 128",
    "gpu --sampling --batch 1 32 --out /tmp/out",
    "serving --json /tmp/out/serving.json",
    "serving --quantize fp8 --json /tmp/out/serving-fp8.json",
    "serving --model tiny --device cpu --concurrency 1,4 --requests 8 --max-input 64 --max-output 24 "
    "--floor-requests 4",
    "serving --engines kettle --no-offline --concurrency 1,16,64,256 --per-client 2 --kv-tokens 200000",
]
PARSERS = {
    "peers": "bench.peers:parser",
    "decode": "bench.decode:parser",
    "prefill": "bench.prefill:parser",
    "served": "bench.served:served_parser",
    "speculation": "bench.served:speculation_parser",
    "lora": "bench.served:lora_parser",
    "memory": "bench.served:memory_parser",
    "startup": "bench.served:startup_parser",
    "gpu": "bench.gpu:parser",
    "vision": "bench.prefill:vision_parser",
    "serving": "bench.serving:parser",
}


def parser_of(name: str):
    import importlib

    module, function = PARSERS[name].split(":")
    return getattr(importlib.import_module(module), function)()


def test_every_benchmark_has_a_runner_and_a_parser() -> None:
    assert set(PARSERS) == set(BENCHMARKS)
    for name in BENCHMARKS:
        assert callable(benchmark(name))
        assert parser_of(name).prog == f"python -m bench {name}"


@pytest.mark.parametrize("quoted", QUOTED)
def test_quoted_commands_parse(quoted: str) -> None:
    name, *argv = shlex.split(quoted)
    parser_of(name).parse_args(argv)


def test_an_unknown_option_is_refused() -> None:
    with pytest.raises(SystemExit):
        parser_of("decode").parse_args(["--vs", "nothing"])


def test_the_entry_point_lists_the_benchmarks_and_refuses_unknown_names() -> None:
    listed = subprocess.run([sys.executable, "-m", "bench"], cwd=ROOT, capture_output=True, text=True, check=True)
    assert all(f"  {name} " in listed.stdout for name in BENCHMARKS)
    unknown = subprocess.run([sys.executable, "-m", "bench", "nope"], cwd=ROOT, capture_output=True, text=True)
    assert unknown.returncode == 2 and "unknown benchmark 'nope'" in unknown.stderr


def test_the_printed_command_carries_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KETTLE_TUNING", "lanes=off,float-rows=8")
    line = command(["decode", "--server-args", "--quantize int4"])
    assert line.startswith("KETTLE_TUNING=lanes=off,float-rows=8 ")
    assert line.endswith("-m bench decode --server-args '--quantize int4'")


def test_a_child_server_gets_this_process_tuning_the_cap_and_its_own_items(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KETTLE_TUNING", "lanes=off,max-kv-tokens=4096,overlap=on")
    env = child_environment({"KETTLE_TUNING": "overlap=off"}, 65536)
    assert env["KETTLE_TUNING"] == "lanes=off,max-kv-tokens=65536,overlap=off"
    own_cap = child_environment({"KETTLE_TUNING": "max-kv-tokens=8"}, 65536)
    assert own_cap["KETTLE_TUNING"] == "lanes=off,max-kv-tokens=8,overlap=on"
    assert child_environment({}, None)["KETTLE_TUNING"] == "lanes=off,max-kv-tokens=4096,overlap=on"
    monkeypatch.delenv("KETTLE_TUNING")
    assert "KETTLE_TUNING" not in child_environment({"KETTLE_CACHE": "/c"}, None)


def test_tuning_sets_items_inside_the_block_and_restores_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    from kettle import settings
    from kettle.bench.drive import tuning

    # The cached `current` a benchmark has (tests/conftest.py's re-reads and has no cache to clear).
    monkeypatch.setattr(settings, "current", functools.cache(lambda: settings.Settings.from_env(os.environ)))
    monkeypatch.setenv("KETTLE_TUNING", "lanes=off")
    with tuning({"batch-invariant": False}):
        assert os.environ["KETTLE_TUNING"] == "lanes=off,batch-invariant=off"
        assert not settings.current().batch_invariant and not settings.current().cpu_lanes
    assert os.environ["KETTLE_TUNING"] == "lanes=off" and settings.current().batch_invariant
    with tuning({"lanes": None}):
        assert "KETTLE_TUNING" not in os.environ
    assert os.environ["KETTLE_TUNING"] == "lanes=off"


def test_interleaved_calls_alternate_after_the_warm_up() -> None:
    calls: list[str] = []
    clock = iter(range(100))
    timings = interleaved(
        [lambda: calls.append("a"), lambda: calls.append("b")],
        rounds=3,
        warmup=1,
        measure=lambda fn: (fn(), float(next(clock)))[1],
    )
    assert calls == ["a", "b"] * 4  # one warm-up round, then three timed ones
    assert [t.samples for t in timings] == [(0.0, 2.0, 4.0), (1.0, 3.0, 5.0)]


def test_median_and_minimum_are_what_they_say() -> None:
    timing = Timing((0.3, 0.1, 0.2, 0.9))
    assert timing.median == pytest.approx(0.25)
    assert timing.minimum == 0.1


def test_ratios_are_taken_round_by_round() -> None:
    ratios = same_round([2.0, 3.0, 8.0], [1.0, 2.0, 4.0])
    assert ratios == [2.0, 1.5, 2.0]
    assert ratio_summary(ratios) == "2.00x (2.00, 1.50, 2.00)"


def test_the_prefill_count_is_torchs_for_the_projections_and_the_causal_half_of_its_attention() -> None:
    """`bench peers --shape`'s GOP/s: torch's own counter over transformers' Llama of a small shape (eager
    attention, which multiplies the whole score matrix) gives the projections' operations exactly; attention counts
    the scores and values of each token with itself and those before it, (L + 1) / 2L of the whole matrix's."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import LlamaConfig, LlamaForCausalLM

    from bench.peers import prefill_ops

    hidden, layers, heads, kv_heads, inner, prompt = 64, 2, 4, 2, 96, 24
    config = LlamaConfig(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        intermediate_size=inner, vocab_size=50, attn_implementation="eager",
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(torch.arange(prompt)[None])
    counts = counter.get_flop_counts()
    matmuls = sum(n for op, n in counts["Global"].items() if "bmm" not in str(op))
    head = sum(counts["LlamaForCausalLM.lm_head"].values())
    attention = sum(n for op, n in counts["Global"].items() if "bmm" in str(op))
    assert attention > 0 and head == 2 * prompt * hidden * 50
    expected = matmuls - head + attention * (prompt + 1) / (2 * prompt)
    assert prefill_ops((hidden, layers, heads, kv_heads, inner), prompt) == pytest.approx(expected)


def test_the_serving_mix_is_the_committed_1000_pairs_in_their_ranges() -> None:
    requests = serving.load()
    assert len(requests) == 1000
    inputs, outputs = [r.input_tokens for r in requests], [r.output_tokens for r in requests]
    assert min(inputs) >= 50 and max(inputs) <= 1500
    assert min(outputs) >= 50 and max(outputs) <= 800
    # Long-tailed, as ShareGPT is: the mean well above the median on both sides.
    for values in (inputs, outputs):
        assert sum(values) / len(values) > 1.2 * sorted(values)[len(values) // 2]
    # The file is what its generator's documented parameters draw, so it can be checked and drawn again.
    assert serving.PATH.read_text() == serving.document(serving.generate())


def test_a_scaled_mix_keeps_its_shape_under_the_new_longest() -> None:
    mix = serving.load()
    small = serving.scaled(mix, 64, 24)
    assert max(r.input_tokens for r in small) == 64 and max(r.output_tokens for r in small) == 24
    assert min(r.output_tokens for r in small) >= 1
    longest = max(range(len(mix)), key=lambda i: mix[i].input_tokens)
    assert small[longest].input_tokens == 64
    assert serving.scaled(mix, None, None) == mix


def test_kv_use_is_the_fraction_of_blocks_not_free() -> None:
    page = "# HELP kettle_kv_blocks_free ...\nkettle_kv_blocks_free 300.0\nkettle_kv_blocks_total 400.0\n"
    assert serving.kv_used(page) == pytest.approx(0.25)
    assert serving.kv_used(page.replace("free 300.0", "free 400.0")) == 0
