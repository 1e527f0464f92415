"""What a vLLM user expects around the OpenAI routes: an API key, X-Request-Id, /version,
/detokenize, chat /tokenize, a chat template override, several served names, the CLI flags."""

from __future__ import annotations

import argparse
import json
import re
import urllib.error
import urllib.request

import pytest

import dspark
from dspark.llm import build_config
from dspark.server import ServerThread, build_app
from dspark.server.launch import add_serve_args, engine_config_from_args
from dspark.tokenizer import Tokenizer
from tiny_server import engine_kwargs

KEY = "sk-test-123"
OVERRIDE = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}:{% endif %}"
CHAT = [{"role": "user", "content": "w1 w2"}]


@pytest.fixture(scope="module")
def template_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("template") / "chat.jinja"
    path.write_text(OVERRIDE)
    return str(path)


@pytest.fixture(scope="module")
def server(target_dir, template_file):
    config = build_config(model=target_dir, drafter=None, **engine_kwargs())
    app = build_app(config, served_model_name=["tiny", "tiny-alias"], api_key=KEY,
                    chat_template=template_file)
    with ServerThread(app) as thread:
        yield thread.url


def call(url: str, path: str, body: dict | None = None, key: str | None = KEY,
         headers: dict | None = None) -> tuple[int, dict, dict]:
    """(status, JSON body, response headers) of a GET (no body) or POST."""
    sent = {"Content-Type": "application/json", **(headers or {})}
    if key is not None:
        sent["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url + path, data=data, headers=sent)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read() or b"null"), dict(response.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null"), dict(exc.headers)


def test_api_routes_need_the_key(server):
    for path, body in [("/v1/models", None), ("/tokenize", {"prompt": "w1"}), ("/detokenize", {"tokens": [5]}),
                       ("/v1/completions", {"prompt": "w1", "max_tokens": 2})]:
        status, got, headers = call(server, path, body, key=None)
        assert status == 401, path
        assert got["error"]["code"] == "invalid_api_key" and "missing API key" in got["error"]["message"]
        assert headers["www-authenticate"] == "Bearer"
        status, got, _ = call(server, path, body, key="sk-wrong")
        assert status == 401 and got["error"]["message"] == "invalid API key"
        assert call(server, path, body)[0] == 200, path
    status, _, _ = call(server, "/v1/models", key=None, headers={"Authorization": f"Basic {KEY}"})
    assert status == 401


def test_health_metrics_and_version_stay_open(server):
    assert call(server, "/health", key=None)[:2] == (200, {"status": "ok"})
    assert call(server, "/version", key=None)[:2] == (200, {"version": dspark.__version__})
    with urllib.request.urlopen(f"{server}/metrics", timeout=10) as response:
        assert response.status == 200 and b"vllm:num_requests_running" in response.read()


def test_request_id_is_echoed_or_generated(server):
    _, _, headers = call(server, "/v1/models", headers={"X-Request-Id": "my-id-42"})
    assert headers["x-request-id"] == "my-id-42"
    _, _, refused = call(server, "/v1/models", key=None, headers={"X-Request-Id": "refused-1"})
    assert refused["x-request-id"] == "refused-1"          # a 401 carries it too
    first = call(server, "/health", key=None)[2]["x-request-id"]
    second = call(server, "/health", key=None)[2]["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", first) and first != second


def test_detokenize_round_trips_tokenize(server):
    status, tokenized, _ = call(server, "/tokenize", {"prompt": "w1 w2 w40"})
    assert status == 200 and tokenized["count"] == 3
    status, got, _ = call(server, "/detokenize", {"model": "tiny", "tokens": tokenized["tokens"]})
    assert status == 200 and got == {"prompt": "w1 w2 w40"}
    status, got, _ = call(server, "/detokenize", {"tokens": [5, 128]})
    assert status == 400 and got["error"]["param"] == "tokens"
    assert "tokens[1]" in got["error"]["message"] and "128" in got["error"]["message"]
    status, got, _ = call(server, "/detokenize", {"tokens": [-1]})
    assert status == 400 and "tokens[0]" in got["error"]["message"]
    assert call(server, "/detokenize", {"tokens": "w1"})[0] == 400


def test_tokenize_chat_uses_the_template_override(server, target_dir):
    model_template = Tokenizer.from_folder(target_dir)
    status, got, _ = call(server, "/tokenize", {"messages": CHAT})
    assert status == 200
    want = model_template.encode("w1 w2 :", add_special_tokens=False)      # OVERRIDE rendered
    assert got["tokens"] == want
    default = model_template.encode(model_template.apply_chat_template(CHAT), add_special_tokens=False)
    assert got["tokens"] != default                         # the model's own template is replaced
    _, without, _ = call(server, "/tokenize", {"messages": CHAT, "add_generation_prompt": False})
    assert without["tokens"] == want[:-1]


def test_tokenize_refuses_both_or_neither_form(server):
    status, got, _ = call(server, "/tokenize", {"prompt": "w1", "messages": CHAT})
    assert status == 400 and "not both" in got["error"]["message"]
    status, got, _ = call(server, "/tokenize", {"model": "tiny"})
    assert status == 400 and got["error"]["param"] == "prompt"


def test_chat_completion_renders_the_override(server):
    status, got, _ = call(server, "/v1/chat/completions", {"model": "tiny-alias", "messages": CHAT,
                                                            "max_tokens": 2, "temperature": 0})
    assert status == 200 and got["usage"]["prompt_tokens"] == 3     # "w1 w2 :"


def test_every_served_name_is_accepted_and_listed(server):
    _, models, _ = call(server, "/v1/models")
    assert [card["id"] for card in models["data"]] == ["tiny", "tiny-alias"]
    status, got, _ = call(server, "/v1/completions", {"model": "tiny-alias", "prompt": "w1", "max_tokens": 2})
    assert status == 200 and got["model"] == "tiny"            # the first name is reported
    status, got, _ = call(server, "/v1/completions", {"model": "other", "prompt": "w1", "max_tokens": 2})
    assert status == 404 and "'tiny-alias'" in got["error"]["message"]


def test_bad_templates_fail_at_startup(target_dir, tmp_path):
    config = build_config(model=target_dir, drafter=None, **engine_kwargs())
    with pytest.raises(FileNotFoundError, match="neither a file nor a Jinja template"):
        build_app(config, chat_template=str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="does not compile"):
        build_app(config, chat_template="{% for m in messages %}{{ m }")
    with pytest.raises(ValueError, match="must not be empty"):
        build_app(config, api_key="")


def test_inline_template_that_fails_to_render_is_a_400(target_dir):
    inline = "{{ raise_exception('no chats here') }}"
    config = build_config(model=target_dir, drafter=None, **engine_kwargs())
    with ServerThread(build_app(config, chat_template=inline)) as thread:
        status, got, _ = call(thread.url, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2}, key=None)
        assert status == 400 and "no chats here" in got["error"]["message"]
        assert got["error"]["code"] == "chat_template_error"


def test_cli_flags():
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args(["--served-model-name", "a", "b", "--api-key", KEY, "--chat-template", "t.jinja",
                              "--uvicorn-log-level", "debug", "--generation-config", "vllm"])
    assert args.served_model_name == ["a", "b"] and args.api_key == KEY
    assert args.chat_template == "t.jinja" and args.uvicorn_log_level == "debug"
    assert engine_config_from_args(args).generation_config == "vllm"
    defaults = parser.parse_args([])
    assert defaults.uvicorn_log_level == "info" and defaults.api_key is None
    assert engine_config_from_args(defaults).generation_config == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["--uvicorn-log-level", "loud"])
