"""64 streaming clients, some of which stop reading: those are cut off once their socket buffers
fill and they fall `max_pending_outputs` behind (their KV freed, counted in /metrics); the
clients that read get their whole answers."""

from __future__ import annotations

import http.client
import json
import socket
import threading

import pytest

from dspark.server.limits import ServerLimits
from tiny import save_tiny
from tiny_server import VOCAB, serve, write_tokenizer

CLIENTS, STALLED = 64, 8
READ_TOKENS, STALL_TOKENS = 24, 1800


@pytest.fixture(scope="module")
def long_target(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("long_target"))
    save_tiny(path, "qwen3", tied=True, vocab=VOCAB, num_hidden_layers=2, seed=5,
              max_position_embeddings=2048)
    write_tokenizer(path)
    return path


def small_send_buffers(served) -> None:
    """Connections accepted from now on inherit a 4 KiB send buffer from the listening socket:
    a slow network path, where loopback's autotuned megabytes would hide a stalled reader for
    thousands of tokens."""
    for listener in served.thread.server.servers[0].sockets:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)


def stalled_client(port: int, prompt: str) -> socket.socket:
    """Sends a long streaming request, reads the response head, then never reads again."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)     # a small window: fills fast
    sock.connect(("127.0.0.1", port))
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": STALL_TOKENS, "stream": True,
                       "ignore_eos": True}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(1)
    assert head.startswith(b"HTTP/1.1 200"), head
    return sock


def reading_client(port: int, prompt: str, out: list, index: int) -> None:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": READ_TOKENS, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    lines = conn.getresponse().read().decode().splitlines()
    conn.close()
    out[index] = [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: {")]


@pytest.mark.slow
def test_clients_that_stop_reading_are_cut_off(long_target):
    # a reader is sent READ_TOKENS outputs in all, fewer than the limit, so however long the
    # machine keeps its thread from running it cannot be taken for a stalled one
    limits = ServerLimits(max_pending_outputs=32)
    with serve(long_target, limits=limits, max_model_len=2048, kv_tokens=32_768, max_num_seqs=64,
               max_num_batched_tokens=512) as served:
        small_send_buffers(served)
        stalled = [stalled_client(served.thread.port, f"w{i} w9") for i in range(STALLED)]
        results: list = [None] * (CLIENTS - STALLED)
        threads = [threading.Thread(target=reading_client, args=(served.thread.port, f"w{i} w5", results, i))
                   for i in range(len(results))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        values = served.wait_idle(timeout=120)
        assert values[("dspark_slow_reader_aborts_total", ())] == STALLED
        assert values[("dspark_requests_aborted_total", ())] == STALLED
        for events in results:
            assert events is not None and "error" not in events[-1]
            assert events[-1]["usage"]["completion_tokens"] == READ_TOKENS
        engine = served.state.engine
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        for sock in stalled:
            sock.close()
