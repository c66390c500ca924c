"""The bundled SmolLM2 model, served with no flags at all, knows the capital of France."""

from __future__ import annotations

import httpx

from kettle.bench.process import KettleServer


def test_bundled_model_answers_paris():
    server = KettleServer(None)
    try:
        body = {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 20}}
        response = httpx.post(f"{server.url}/generate", json=body, timeout=120)
        assert response.status_code == 200, response.text
        assert "Paris" in response.json()["generated_text"]
        info = httpx.get(f"{server.url}/info").json()
        assert info["model_id"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    finally:
        assert server.stop() == 0, server.logs()
