"""TGI compatibility on real servers: two launchers side by side with no socket flags (one started with a
container name in HOSTNAME, as Docker and Kubernetes set it), and TGI's quirks through real clients."""

from __future__ import annotations

import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from openai import OpenAI, UnprocessableEntityError
from text_generation import Client
from text_generation.errors import ValidationError

from kettle.bench.process import KettleServer

TEMPERATURE_ERROR = "Input validation error: `temperature` must be strictly positive"


def shard_socket(server: KettleServer) -> str:
    """Where the launcher puts shard 0's socket when no --shard-uds-path is given."""
    return os.path.join(tempfile.gettempdir(), f"kettle-server-{server.port}-0")


def test_two_servers_on_one_machine_need_no_flags(tiny_llama_path):
    model = str(tiny_llama_path)
    # Started at the same time, as two replicas on one host would be. No --hostname: the first reads HOSTNAME,
    # a container name, and so listens on every address.
    with ThreadPoolExecutor(2) as pool:
        starting = [
            pool.submit(KettleServer, model, env={"HOSTNAME": "3f4e5d6c7b8a"}, hostname=None, own_sockets=False),
            pool.submit(KettleServer, model, own_sockets=False),
        ]
        outcomes = [future.exception() or future.result() for future in starting]
    servers = [outcome for outcome in outcomes if isinstance(outcome, KettleServer)]
    if len(servers) < len(outcomes):  # one failed to start: stop the other before reporting it
        for server in servers:
            server.stop()
        raise next(outcome for outcome in outcomes if isinstance(outcome, BaseException))
    try:
        body = {"inputs": "Hello", "parameters": {"max_new_tokens": 3}}
        for server in servers:
            answer = httpx.post(f"{server.url}/generate", json=body, timeout=60)
            assert answer.status_code == 200 and answer.json()["generated_text"]
            assert os.path.exists(shard_socket(server))
        assert shard_socket(servers[0]) != shard_socket(servers[1])
    finally:
        codes = [server.stop() for server in servers]
    assert codes == [0, 0], [server.logs() for server in servers]
    # The whole log: `logs()` is its tail, and the line comes before everything the processes log once started.
    assert "Invalid hostname, defaulting to 0.0.0.0" in Path(servers[0].log.name).read_text()
    assert not any(os.path.exists(shard_socket(server)) for server in servers)


def test_info_names_tgis_router(tiny_server):
    assert httpx.get(f"{tiny_server.url}/info").json()["router"] == "text-generation-router"


def test_stream_validation_error_is_one_event_the_tgi_client_raises(tiny_server):
    with httpx.stream(
        "POST", f"{tiny_server.url}/generate_stream", json={"inputs": "Hi", "parameters": {"temperature": 0.0}}
    ) as response:
        assert response.status_code == 200
        body = response.read().decode()
    assert body == f'data: {{"error":"{TEMPERATURE_ERROR}","error_type":"validation"}}\n\n'
    with pytest.raises(ValidationError, match="`temperature` must be strictly positive"):
        list(Client(tiny_server.url).generate_stream("Hi", temperature=0.0))


def test_unknown_adapter_is_refused(tiny_server):
    body = {"inputs": "Hi", "parameters": {"adapter_id": "org/lora", "max_new_tokens": 2}}
    response = httpx.post(f"{tiny_server.url}/generate", json=body, timeout=60)
    assert response.status_code == 422
    assert (
        response.json()["error"] == "Input validation error: adapter `org/lora` is not loaded (loaded adapters: none)"
    )


def test_completions_refusals_carry_tgis_error_types(tiny_server):
    client = OpenAI(base_url=f"{tiny_server.url}/v1", api_key="-")
    with pytest.raises(UnprocessableEntityError) as caught:
        client.completions.create(model="tgi", prompt="Hi", suffix="!", max_tokens=2)
    assert caught.value.body == "Suffix is not supported and can be achieved by preprocessing the prompt."
    response = httpx.post(f"{tiny_server.url}/v1/completions", json={"prompt": ["a"] * 5, "max_tokens": 2})
    assert response.status_code == 422 and response.json()["error_type"] == "batch size exceeded"


def test_json_schema_without_properties_is_refused(tiny_server):
    grammar = {"type": "json", "value": {"type": "object"}}
    response = httpx.post(f"{tiny_server.url}/generate", json={"inputs": "Hi", "parameters": {"grammar": grammar}})
    assert response.status_code == 422
    assert response.json()["error"].endswith("Grammar must have a 'properties' field")
