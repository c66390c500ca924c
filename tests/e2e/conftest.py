"""End-to-end fixtures: one real server on the tiny model for the whole module set."""

from __future__ import annotations

import pytest

from kettle.bench.process import KettleServer
from tests.e2e.kv_pool import assert_pool_whole
from tests.faults import fault_env


@pytest.fixture(scope="session")
def tiny_server(tiny_llama_path):
    """The real launcher → shard → router serving the tiny Llama, with fault injection (tests/faults.py)."""
    server = KettleServer(
        str(tiny_llama_path),
        "--max-concurrent-requests",
        "32",
        "--max-input-tokens",
        "200",
        "--max-total-tokens",
        "256",
        "--max-best-of",
        "3",
        # A float32 KV cache (the CPU's default is float16): tests compare its outputs with transformers' float32.
        "--kv-cache-dtype",
        "float32",
        # Overlap scheduling is opt-in; the session server runs with it so every e2e test here exercises it.
        env={**fault_env(), "KETTLE_TUNING": "overlap=on"},
    )
    yield server
    try:
        assert_pool_whole(server.url)  # after every test of the session: no block leaked
    finally:
        code = server.stop()
    assert code == 0, f"launcher exited with {code}:\n{server.logs()}"
