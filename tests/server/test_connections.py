"""The server's HTTP/1.1 connections (jaxinfer/server/connections.py), over raw sockets to an in-process server:
a request head that does not arrive in time is a 408 and a closed connection, a malformed one a 400, both in
OpenAI's shape; a slow body is the body deadline's business, not the head's."""

from __future__ import annotations

import json
import logging
import select
import socket
import time
from urllib.parse import urlsplit

import pytest

from jaxinfer.server import connections
from tests.server.test_lifecycle import InProcessServer

HEAD_TIMEOUT_S = 0.5
REQUEST = b'{"prompt": "hi", "max_tokens": 2}'
HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"


@pytest.fixture()
def server(tokenizer, monkeypatch):
    monkeypatch.setattr(connections, "HEAD_TIMEOUT_S", HEAD_TIMEOUT_S)
    monkeypatch.setattr(connections, "LEFTOVER_BODY_S", HEAD_TIMEOUT_S)
    srv = InProcessServer(tokenizer)
    srv.wait_ready()
    yield srv
    srv.close()


def connect(srv: InProcessServer) -> socket.socket:
    url = urlsplit(srv.url)
    return socket.create_connection((url.hostname, url.port), timeout=20)


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One response (status, lower-cased headers, body), read up to its Content-Length."""
    data = b""
    while b"\r\n\r\n" not in data:
        more = sock.recv(4096)
        assert more, f"connection closed before a response: {data!r}"
        data += more
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
    while len(body) < int(headers["content-length"]):
        more = sock.recv(4096)
        assert more, f"connection closed mid-body: {body!r}"
        body += more
    return int(status_line.split()[1]), headers, body


def closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def error_of(body: bytes) -> dict:
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    return err


@pytest.mark.parametrize("sent", [b"", b"POST /v1/compl", HEAD[:40]], ids=["nothing", "request-line", "headers"])
def test_a_head_that_does_not_arrive_in_time_is_a_408_and_closes(server, sent):
    """A connection that sends nothing or part of a head used to be held open for as long as the client liked
    (uvicorn arms no timer before the first response): thousands of them exhaust the server's file descriptors."""
    with connect(server) as sock:
        sock.sendall(sent)
        t0 = time.monotonic()
        status, headers, body = read_response(sock)
        waited = time.monotonic() - t0
        assert status == 408 and headers["connection"] == "close"
        assert error_of(body)["code"] == "request_timeout"
        assert HEAD_TIMEOUT_S * 0.8 <= waited < HEAD_TIMEOUT_S + 10
        assert closed_by_server(sock)


def test_a_head_sent_slowly_still_has_one_deadline(server):
    """A byte at a time, each well within the deadline, does not extend it: the head as a whole must arrive."""
    with connect(server) as sock:
        for byte in HEAD[:60]:
            if select.select([sock], [], [], HEAD_TIMEOUT_S / 10)[0]:  # answered: sending on would reset it
                break
            sock.sendall(bytes([byte]))
        status, _, body = read_response(sock)
        assert status == 408 and error_of(body)["code"] == "request_timeout"


def test_a_kept_alive_connection_gets_a_new_deadline_for_each_head(server):
    """Served requests on one connection are not cut by the first request's deadline; a later head that stalls
    is, counted from its own first byte."""
    with connect(server) as sock:
        for _ in range(3):
            sock.sendall(HEAD % len(REQUEST) + REQUEST)
            status, _, body = read_response(sock)
            assert status == 200, body
            time.sleep(HEAD_TIMEOUT_S * 0.6)  # three of these: past one deadline since the connection opened
        sock.sendall(HEAD[:20])
        status, _, body = read_response(sock)
        assert status == 408 and error_of(body)["code"] == "request_timeout"


def test_a_slow_body_is_not_cut_by_the_head_deadline(server):
    """Once the head has arrived, the body has its own (longer) deadline."""
    with connect(server) as sock:
        sock.sendall(HEAD % len(REQUEST))
        time.sleep(HEAD_TIMEOUT_S * 2)
        sock.sendall(REQUEST)
        status, _, body = read_response(sock)
        assert status == 200, body
        assert json.loads(body)["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize(
    "raw",
    # h11 refuses a head once 16 KiB of it have arrived unfinished (one that arrives whole in one read is taken).
    [b"NOT HTTP AT ALL\r\n\r\n", b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20_000],
    ids=["syntax", "unfinished-head-over-16KiB"],
)
def test_a_malformed_request_is_a_400_in_openai_shape(server, raw):
    """uvicorn answered these with a plain-text 400 of its own."""
    with connect(server) as sock:
        sock.sendall(raw)
        status, headers, body = read_response(sock)
        assert status == 400 and headers["content-type"] == "application/json"
        err = error_of(body)
        assert err["code"] == "invalid_http" and err["type"] == "invalid_request_error"
        assert closed_by_server(sock)


def test_a_body_left_unread_by_an_early_response_has_a_deadline(server):
    """/health answers without reading the declared body; a byte of it now and then cancelled uvicorn's only timer
    and held the connection open for good (80 of 100 such connections were still open after 70 s)."""
    with connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n")
        status, _, _ = read_response(sock)
        assert status == 200
        t0 = time.monotonic()
        for _ in range(6):  # a byte every third of the deadline, for twice the deadline
            if select.select([sock], [], [], HEAD_TIMEOUT_S / 3)[0]:
                break
            sock.sendall(b"x")
        assert closed_by_server(sock) and time.monotonic() - t0 < HEAD_TIMEOUT_S * 2.5


def test_a_body_finished_after_an_early_response_keeps_the_connection(server):
    """The rest of the body arriving in time leaves a working kept-alive connection; a next head that started in
    the same write as the body's end has its own deadline (it had none)."""
    with connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n\r\n")
        assert read_response(sock)[0] == 200
        sock.sendall(b"abcd" + HEAD % len(REQUEST) + REQUEST)
        status, _, body = read_response(sock)
        assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 2
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n")
        assert read_response(sock)[0] == 200
        sock.sendall(b"ab" + HEAD[:20])  # the body's end, then half a head
        status, _, body = read_response(sock)
        assert status == 408 and error_of(body)["code"] == "request_timeout"


def test_bad_bytes_after_a_complete_response_get_no_second_response(server):
    """A chunked body nobody read, broken after the route answered: the client got an unasked-for 400 after its
    200."""
    with connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        assert read_response(sock)[0] == 200
        sock.sendall(b"zz-not-a-chunk-size\r\n")
        rest = b""
        while more := sock.recv(4096):
            rest += more
        assert rest == b""


def test_sigterm_waits_for_a_request_still_sending_its_body(server):
    """Draining counted only engine requests: a handler still reading its body was cancelled by uvicorn's shutdown,
    and the client got a plain-text 500. It now finishes: read, then refused as the server is stopping."""
    import signal

    with connect(server) as sock:
        sock.sendall(HEAD % len(REQUEST) + REQUEST[:5])
        time.sleep(0.3)
        server.server.handle_exit(signal.SIGTERM, None)
        time.sleep(3)  # past uvicorn's cancel grace (1 s here): the drain must still be waiting
        sock.sendall(REQUEST[5:])
        status, headers, body = read_response(sock)
    assert status == 503 and headers["content-type"] == "application/json"
    assert error_of(body)["code"] == "shutting_down"
    server.thread.join(30)
    assert not server.thread.is_alive()


def test_the_connection_layers_errors_are_counted_on_metrics_and_logged(server, caplog):
    """These answers never reach the app's error handlers: /metrics did not count them (450 head timeouts of a
    flood left jaxinfer:http_errors_total{status="408"} at 0), nor did the access log show them."""
    from jaxinfer.server.access_log import ACCESS_LOGGER
    from tests.server.conftest import metric

    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)

    def count(status: str) -> float:
        try:
            return metric(server.http.get("/metrics").text, "jaxinfer:http_errors_total", status=status)
        except AssertionError:  # no such sample yet
            return 0.0

    before = count("408"), count("400")
    for _ in range(2):
        with connect(server) as sock:
            sock.sendall(b"GET /hea")
            assert read_response(sock)[0] == 408
    with connect(server) as sock:
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        assert read_response(sock)[0] == 400
    assert (count("408"), count("400")) == (before[0] + 2, before[1] + 1)
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == ACCESS_LOGGER]
    told = [(x["status"], x["error"], x["endpoint"]) for x in lines if x["status"] in (400, 408)]
    assert told == [(408, "request_timeout", None)] * 2 + [(400, "invalid_http", None)], lines
