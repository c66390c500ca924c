"""429 under overload, on a server with two permits."""

from __future__ import annotations

import asyncio

import httpx

from kettle.bench.process import KettleServer


def test_overload_returns_429_and_server_recovers(tiny_llama_path):
    server = KettleServer(str(tiny_llama_path), "--max-concurrent-requests", "2")
    try:

        async def burst():
            async with httpx.AsyncClient(timeout=120) as client:
                body = {"inputs": "Hello", "parameters": {"max_new_tokens": 64, "stop": ["never-seen"]}}
                return await asyncio.gather(*[client.post(f"{server.url}/generate", json=body) for _ in range(10)])

        statuses = [r.status_code for r in asyncio.run(burst())]
        assert statuses.count(200) >= 2
        assert 429 in statuses
        rejected = next(r for r in asyncio.run(burst()) if r.status_code == 429)
        assert rejected.json() == {"error": "Model is overloaded", "error_type": "overloaded"}
        ok = httpx.post(f"{server.url}/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 2}})
        assert ok.status_code == 200
    finally:
        assert server.stop() == 0, server.logs()
