"""Deadlines for slow clients (kettle/router/slow_clients.py), on a real uvicorn server with a half-second
timeout: late headers and late bodies get a 408 in TGI's shape and a closed connection, a silent connection is
closed, a body left unread after the answer cannot hold the connection, and clients at a fair pace are served."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from kettle.bench.process import free_port
from kettle.router.errors import install_error_handlers
from kettle.router.slow_clients import MIN_BODY_RATE, BodyDeadline, SlowClientProtocol

TIMEOUT = 0.5


class QuickProtocol(SlowClientProtocol):
    client_timeout = TIMEOUT


def make_app() -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        return {"bytes": len(await request.body())}

    @app.post("/refuse")
    async def refuse() -> JSONResponse:  # answers without reading the body, as a 401 does
        return JSONResponse({"error": "Unauthorized", "error_type": "unauthorized"}, 401)

    return app


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    config = uvicorn.Config(
        BodyDeadline(make_app(), timeout=TIMEOUT),
        host="127.0.0.1",
        port=free_port(),
        http=QuickProtocol,
        lifespan="off",
        log_level="warning",
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    yield config.port
    server.should_exit = True
    thread.join(10)


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def dribble(sock: socket.socket, data: bytes, every: float) -> float:
    """Sends `data` a byte at a time until the server answers or closes; returns the seconds that took."""
    started = time.monotonic()
    for byte in data:
        sock.settimeout(every)
        try:
            if sock.recv(1, socket.MSG_PEEK):
                break
            return time.monotonic() - started  # closed without a word
        except TimeoutError:
            pass
        sock.sendall(bytes([byte]))
    sock.settimeout(5)
    sock.recv(1, socket.MSG_PEEK)
    return time.monotonic() - started


def status_and_body(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body


def test_a_body_sent_too_slowly_gets_a_408_and_the_connection_closes(port):
    with connect(port) as sock:
        sock.sendall(
            b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
        )
        took = dribble(sock, b"x" * 1000, every=0.05)
        status, headers, body = status_and_body(read_all(sock))
    assert status == 408 and headers["connection"] == "close"
    answer = json.loads(body)
    assert answer["error_type"] == "request_timeout" and answer["error"].startswith("Request body timed out")
    assert TIMEOUT - 0.1 <= took < TIMEOUT + 1.5  # the deadline starts with the headers, just before the first byte


def test_late_headers_get_a_408_and_a_silent_connection_is_closed(port):
    with connect(port) as dribbler, connect(port) as silent:
        took = dribble(dribbler, b"POST /echo HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"y" * 1000, every=0.05)
        status, _, body = status_and_body(read_all(dribbler))
        assert status == 408 and json.loads(body)["error_type"] == "request_timeout"
        # The server's clock starts at the connection, a moment before the first byte: a little early is fine.
        assert TIMEOUT - 0.1 <= took < TIMEOUT + 1.5
        assert read_all(silent) == b""  # no request came: nothing to answer


def test_a_body_left_unread_after_the_answer_cannot_hold_the_connection(port):
    with connect(port) as sock:
        sock.sendall(b"POST /refuse HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n")
        sock.settimeout(5)
        assert sock.recv(65536).startswith(b"HTTP/1.1 401")
        started = time.monotonic()
        with pytest.raises(OSError):  # the server closes while the client still sends (a reset, or a broken pipe)
            for _ in range(200):
                sock.sendall(b"z")
                time.sleep(0.02)
                if sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                    raise ConnectionResetError("closed")
        assert time.monotonic() - started < TIMEOUT + 1.5


def test_a_body_at_a_fair_pace_and_a_kept_alive_connection_are_served(port):
    body = b"a" * (3 * MIN_BODY_RATE)
    with connect(port) as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body))
        for start in range(0, len(body), MIN_BODY_RATE):  # a second's allowance a chunk, sent within 0.35 s
            sock.sendall(body[start : start + MIN_BODY_RATE])
            time.sleep(0.35)
        reply = sock.recv(65536)
        assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b'{"bytes":196608}')
        time.sleep(2 * TIMEOUT)  # idle between requests (within keep-alive): the next has its own time
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi")
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
