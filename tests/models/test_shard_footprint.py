"""What the shard process loads: on the native path neither transformers nor torch's compiler stack (dynamo,
inductor), each ~100 MB resident and over a second of start-up that the shard never uses."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("transformers", "torch._dynamo", "torch._inductor", "sympy")


def loaded_after(script: str) -> dict:
    script += f"\nimport json, sys\nprint(json.dumps({{'heavy': [m for m in {HEAVY!r} if m in sys.modules], **facts}}))"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_importing_the_shard_server_loads_no_compiler_and_no_transformers():
    assert loaded_after("import kettle.shard.server\nfacts = {}")["heavy"] == []


def test_a_native_model_starts_without_transformers(tiny_llama_path):
    script = (
        "from kettle.shard.config import ShardConfig\n"
        "from kettle.shard.server import build_engine\n"
        f"engine, info = build_engine(ShardConfig(model_path={str(tiny_llama_path)!r}))\n"
        "facts = {'tokenizer': type(engine.runner.vocab.tokenizer).__name__, 'path': info.execution_path}\n"
    )
    assert loaded_after(script) == {"heavy": [], "tokenizer": "FileTokenizer", "path": "native"}
