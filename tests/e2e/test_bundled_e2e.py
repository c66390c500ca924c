"""The bundled SmolLM2 model, served with no flags at all, knows the capital of France, and serves on the int4
kernel straight from its Q4_1 GGUF: the same greedy answers as `--quantize int4`."""

from __future__ import annotations

import httpx
import pytest

from kettle.bench.process import KettleServer

PROMPTS = ("The capital of France is", "def fibonacci(n):\n    ")


def greedy_answers(server: KettleServer) -> list[str]:
    answers = []
    for prompt in PROMPTS:
        body = {"inputs": prompt, "parameters": {"max_new_tokens": 20}}
        response = httpx.post(f"{server.url}/generate", json=body, timeout=120)
        assert response.status_code == 200, response.text
        answers.append(response.json()["generated_text"])
    return answers


def serve(*flags: str) -> tuple[list[str], dict]:
    server = KettleServer(None, *flags)
    try:
        return greedy_answers(server), httpx.get(f"{server.url}/info").json()
    finally:
        assert server.stop() == 0, server.logs()


@pytest.fixture(scope="module")
def default_server() -> tuple[list[str], dict]:
    return serve()


def served_types() -> str:
    """/info's quantization for the bundled file: each GGUF type and the kernels' weight type serving it (in lanes
    wherever the kernels run: AVX-512 VNNI's tiles or AVX2's)."""
    from kettle.kernels import ops
    from kettle.kernels.structs import LINEAR_Q4L, LINEAR_Q8L

    q4, q8 = ("_lanes" if ops.lanes(kind) else "" for kind in (LINEAR_Q4L, LINEAR_Q8L))
    return f"gguf Q4_1 → q4{q4}, Q8_0 → q8_0{q8}"


def test_bundled_model_answers_paris_on_the_int4_path_by_default(default_server):
    answers, info = default_server
    assert "Paris" in answers[0]
    assert info["model_id"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert info["quantization"] == served_types()
    assert info["decode_path"] == "as one fused CPU call"
    assert info["cpu_kernels"] == cpu_kernels()


def cpu_kernels() -> str:
    """What the kernels run in this process, which the shard on the same machine and settings runs too."""
    from kettle.kernels import build, isa

    return isa.describe(build.library())


def test_default_answers_match_quantize_int4(default_server):
    """`--quantize int4` on a file whose blocks are 4-bit keeps them (requantizing could only lose): the same
    path and the same answers as no flag at all."""
    int4_answers, int4_info = serve("--quantize", "int4")
    assert int4_info["quantization"] == served_types()
    assert default_server[0] == int4_answers
