"""End-to-end fixtures: one real server on the tiny model for the whole module set."""

from __future__ import annotations

import pytest

from kettle.bench.process import KettleServer

FAIL_PROMPT = "KETTLE-FAIL-THIS-BATCH"


@pytest.fixture(scope="session")
def tiny_server(tiny_llama_path):
    """The real launcher → shard → router serving the tiny Llama, with a fault hook on FAIL_PROMPT."""
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
        env={"KETTLE_TEST_FAIL_PROMPT": FAIL_PROMPT},
    )
    yield server
    code = server.stop()
    assert code == 0, f"launcher exited with {code}:\n{server.logs()}"
