"""Tiny random models with a word-level tokenizer and a chat template, served on a loopback port."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers

from dspark.llm import build_config
from dspark.server import ServerThread, build_app
from dspark.server.api_server import ServerState
from dspark.server.limits import ServerLimits
from tiny import save_random_drafter, save_tiny

VOCAB = 128
SPECIALS = ["<unk>", "<s>", "</s>", "<|end|>"]
WORDS = ["user", "assistant", "system", ":"] + [f"w{i}" for i in range(VOCAB - len(SPECIALS) - 4)]
TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['user', 'assistant', 'system'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}"
    "{% endif %}"
    "{{ message['role'] }} : {{ message['content'] }}<|end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant :{% endif %}"
)


def write_tokenizer(path: str) -> None:
    vocab = {token: i for i, token in enumerate(SPECIALS + WORDS)}
    backend = BackendTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(SPECIALS)
    backend.decoder = decoders.WordPiece(cleanup=False)
    backend.save(os.path.join(path, "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<unk>", "add_bos_token": False,
              "chat_template": TEMPLATE}
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)


def make_target(path: str, seed: int = 5) -> str:
    save_tiny(path, "qwen3", tied=True, vocab=VOCAB, num_hidden_layers=4, seed=seed)
    write_tokenizer(path)
    return path


def make_drafter(path: str, target: str, gamma: int = 4) -> str:
    save_random_drafter(path, target, gamma=gamma, copy_prev=4.0)
    return path


def engine_kwargs(kv_tokens: int = 8192, **overrides) -> dict:
    per_token = 2 * (4 + 1) * 2 * 16 * 4        # K+V of 4 target + 1 drafter layers, fp32
    kwargs = dict(dtype="float32", block_size=4, kv_cache_bytes=kv_tokens * per_token,
                  max_model_len=128, graph="eager")
    kwargs.update(overrides)
    return kwargs


@dataclass
class Served:
    """A running server and its in-process state (for checks the HTTP API cannot make)."""
    thread: ServerThread
    state: ServerState

    @property
    def base_url(self) -> str:
        return self.thread.base_url

    @property
    def url(self) -> str:
        return self.thread.url

    def metrics(self) -> dict[tuple[str, tuple], float]:
        return read_metrics(self.url)

    def wait_idle(self, timeout: float = 20.0) -> dict[tuple[str, tuple], float]:
        """Aborts land asynchronously: wait until the engine holds no request and /metrics,
        published after the engine's last turn, shows nothing waiting or running."""
        deadline = time.monotonic() + timeout
        while True:
            busy = self.state.engine.has_unfinished or self.state.async_engine.num_waiting
            values = self.metrics()
            idle = (values[("dspark_num_requests_running", ())] == 0
                    and values[("dspark_num_requests_waiting", ())] == 0)
            if (idle and not busy) or time.monotonic() > deadline:
                return values
            time.sleep(0.05)


@contextmanager
def serve(model: str, drafter: str | None = None, max_queue: int | None = 256,
          limits: ServerLimits | None = None, **engine_overrides) -> Iterator[Served]:
    config = build_config(model=model, drafter=drafter, **engine_kwargs(**engine_overrides))
    app = build_app(config, served_model_name="tiny", max_queue=max_queue, limits=limits)
    with ServerThread(app) as thread:
        yield Served(thread, app.state.server)



def post(served: "Served", path: str, body: dict) -> tuple[int, dict | list]:
    """(status, JSON body), or for a stream (200, the list of its data payloads before [DONE])."""
    import http.client
    import json
    conn = http.client.HTTPConnection("127.0.0.1", served.thread.port, timeout=60)
    conn.request("POST", path, json.dumps({"model": "tiny", **body}), {"Content-Type": "application/json"})
    response = conn.getresponse()
    raw = response.read().decode()
    conn.close()
    if not body.get("stream") or response.status != 200:
        return response.status, json.loads(raw)
    events = [line[len("data: "):] for line in raw.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return response.status, [json.loads(e) for e in events[:-1]]

def served_and_offline(model: str, drafter: str | None):
    """A served engine and an offline LLM of the same setup (what a test compares answers of)."""
    from dspark import LLM
    offline = LLM(model, drafter=drafter, **engine_kwargs())
    with serve(model, drafter) as served:
        yield served, offline


def read_metrics(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics as {(name, sorted labels): value}."""
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


@contextmanager
def gated(engine) -> Iterator[threading.Event]:
    """Hold every engine step until the yielded event is set (requests pile up meanwhile)."""
    real_step, gate = engine.step, threading.Event()

    def gated_step():
        gate.wait(30)
        return real_step()

    engine.step = gated_step
    try:
        yield gate
    finally:
        gate.set()
        engine.step = real_step


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def launched(code: str, *serve_args: str) -> Iterator[tuple[subprocess.Popen, str]]:
    """`dspark serve` in a child process (`code`: the Python that runs the CLI), once /health
    answers: (process, base url); killed afterwards if still running."""
    port = free_port()
    cmd = [sys.executable, "-c", code, "serve", *serve_args, "--port", str(port)]
    with tempfile.TemporaryDirectory() as cache:            # its cost model is no user's
        from tiny import share_kernels
        share_kernels(cache)
        env = {**os.environ, "XDG_CACHE_HOME": cache}
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        yield from _serving(proc, port)


def _serving(proc: subprocess.Popen, port: int) -> Iterator[tuple[subprocess.Popen, str]]:
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=1)
            break
        except (urllib.error.URLError, ConnectionError):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise AssertionError(f"the server did not start:\n{proc.stdout.read()}")
            time.sleep(0.2)
    try:
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
