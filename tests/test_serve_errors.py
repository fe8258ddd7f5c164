"""Bad clients: malformed requests, auth, bind address, readiness. The server must answer each
with a 4xx OpenAI-style JSON error and keep serving."""

from __future__ import annotations

import dataclasses
import json
import socket

import httpx
import openai
import pytest

from tests.serve_util import ServerThread, client, metric, serve_config, wait_for_idle

OK_CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
OK_COMPLETION = {"prompt": "hi", "max_tokens": 4}


def malformed_corpus(model_name: str, vocab: int) -> list[tuple[str, str, bytes | dict, dict]]:
    """(name, path, body, headers) of at least 100 requests that must each get a 4xx."""
    cases: list[tuple[str, str, bytes | dict, dict]] = []

    def add(name, body, path="/v1/completions", headers=None):
        cases.append((name, path, body, headers or {}))

    # 1. Bodies that are not a JSON object.
    for i, raw in enumerate([b"", b"{", b"{bad json}", b"[1, 2]", b"null", b"42", b'"text"', b"{'single': 1}",
                             b'{"prompt": "x",}', b"\x00\x01\x02", b"\xff\xfe\xfd{}", b'{"prompt": "\xe9t\xe9"}',
                             b"{" * 1000, b'{"prompt": NaN}'.replace(b"NaN", b"nan")]):
        for path in ("/v1/completions", "/v1/chat/completions"):
            add(f"raw{i}{path}", raw, path)
    # 2. Wrong types and values, field by field (completions).
    wrong = {
        "max_tokens": [-1, 0, "10", 1.5, True, [1], 10**9, 300],
        "temperature": [-0.1, 2.5, "hot", None and 1, [0.5], True],
        "top_p": [0, -1, 1.5, "0.9", False],
        "top_k": [-2, 1.5, "5", True],
        "n": [0, -1, 17, 1.5, "2", True],
        "seed": [1.5, "7", [1], 2**64, 2**32, -1],  # the sampler's seed is a uint32
        "stop": [1, [1, 2], [""], ["a"] * 17, {"a": 1}],
        "stream": ["yes", 1, [True]],
        "logprobs": [True, 21, -1, "3"],  # completions: an integer in [0, 20]
        "echo": ["yes", 1],
        "presence_penalty": [2.5, "1", -3, True],  # OpenAI's range, [-2, 2]
        "frequency_penalty": [-2.01, [1]],
        "repetition_penalty": [0, -1, 101, "1.2"],
        "min_tokens": [-1, 1.5, 11],  # at most max_tokens (OK_COMPLETION's is 10)
        "logit_bias": [[1], {"x": 1}, {"5": 101}, {"-1": 1}, {str(vocab): 1}, {str(i): 1 for i in range(301)}],
        "stop_token_ids": [5, [-1], ["a"], [vocab], list(range(17))],
        "stream_options": ["x", {"include_usage": "yes"}],
        "prompt": [None, "", [], [[]], [1.5, 2], [-1], [vocab], [True], {"a": 1}, 5, ["ok", 3], [[1, 2], "x", 7],
                   ["x"] * 17],
    }
    for field, values in wrong.items():
        for j, v in enumerate(values):
            if v is None and field != "prompt":
                continue
            body = {**OK_COMPLETION, field: v}
            if field == "prompt" and v is None:
                body.pop("prompt")
            add(f"{field}{j}", body)
    # 3. Chat messages.
    for j, m in enumerate([None, [], "hi", [{}], [{"role": "user"}], [{"role": "wizard", "content": "x"}],
                           [{"role": "user", "content": 5}], [{"role": "user", "content": None}],
                           [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], [["user", "x"]],
                           [{"role": "user", "content": "x"}, 3], {"role": "user", "content": "x"}]):
        body = {**OK_CHAT, "messages": m}
        if m is None:
            body.pop("messages")
        add(f"messages{j}", body, "/v1/chat/completions")
    for j, v in enumerate([-5, "4", 0]):
        add(f"chat_max_tokens{j}", {**OK_CHAT, "max_tokens": v}, "/v1/chat/completions")
    # 4. Too long: prompt over the context, prompt + max_tokens over it, a body over the size limit.
    add("prompt_over_context", {"prompt": [7] * 400, "max_tokens": 4})
    add("chat_over_context", {"messages": [{"role": "user", "content": "word " * 400}]}, "/v1/chat/completions")
    add("total_over_context", {"prompt": [7] * 100, "max_tokens": 200})
    add("body_over_limit", {"prompt": "x" * 70000, "max_tokens": 4})
    add("body_over_limit_chat", {"messages": [{"role": "user", "content": "y" * 70000}]}, "/v1/chat/completions")
    # 5. Wrong model, method, path, content length.
    add("wrong_model", {**OK_COMPLETION, "model": "gpt-9"})
    add("wrong_model_chat", {**OK_CHAT, "model": ""}, "/v1/chat/completions")
    add("unknown_path", OK_COMPLETION, "/v1/embeddings")
    add("unknown_path2", OK_COMPLETION, "/v2/completions")
    add("lone_surrogate", b'{"prompt": "\\ud800 x", "max_tokens": 4}')
    add("lone_surrogate_chat", b'{"messages": [{"role": "user", "content": "\\udfff"}]}', "/v1/chat/completions")
    # 6. Nesting: past Python's parser (RecursionError), and past our bound but parseable.
    add("nested_5000", b'{"prompt": "x", "user": ' + b"[" * 5000 + b"]" * 5000 + b"}")
    add("nested_5000_chat", b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}", "/v1/chat/completions")
    add("nested_150", b'{"prompt": "x", "user": ' + b'{"a": ' * 150 + b"1" + b"}" * 150 + b"}")
    return cases


def send(url: str, path: str, body, headers: dict) -> httpx.Response:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with httpx.Client(timeout=60) as h:
        return h.post(url + path, content=raw, headers={"content-type": "application/json", **headers})


def test_malformed_corpus_gets_4xx_json_errors_and_the_server_keeps_serving(served):
    server, url = served
    corpus = malformed_corpus(server.model_name, server.vocab_size)
    assert len(corpus) >= 100
    rejected_before = metric(url, "jaxspec_requests_total", {"status": "rejected"})
    failures = []
    for name, path, body, headers in corpus:
        try:
            r = send(url, path, body, headers)
        except httpx.HTTPError as e:
            failures.append(f"{name}: transport error {e!r}")
            continue
        err = r.json().get("error") if r.headers.get("content-type", "").startswith("application/json") else None
        if not 400 <= r.status_code < 500 or not isinstance(err, dict) or not err.get("message"):
            failures.append(f"{name}: {r.status_code} {r.text[:120]}")
    assert not failures, "\n".join(failures)
    assert metric(url, "jaxspec_requests_total", {"status": "rejected"}) > rejected_before
    # Still serving, and nothing leaked.
    r = client(url).completions.create(model=server.model_name, prompt="still alive?", max_tokens=5, temperature=0)
    assert r.usage.completion_tokens == 5
    assert wait_for_idle(server)
    # /health names the background warm-up (off in the tests' config; running/done: test_serve_structured)
    assert httpx.get(url + "/health").json() == {"status": "ok", "model": server.model_name, "warmup": "off"}


def test_errors_name_the_field(served):
    server, url = served
    r = send(url, "/v1/completions", {**OK_COMPLETION, "temperature": "hot"}, {})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    r = send(url, "/v1/completions", {"prompt": [7] * 100, "max_tokens": 200}, {})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert "context" in r.json()["error"]["message"]
    r = send(url, "/v1/completions", {"prompt": "x" * 70000}, {})
    assert r.status_code == 413
    r = send(url, "/v1/completions", b"\xff\xfe", {})
    assert r.status_code == 400 and "UTF-8" in r.json()["error"]["message"]
    r = send(url, "/v1/completions", {**OK_COMPLETION, "seed": 2**32 + 7}, {})  # would alias seed 7
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed"
    r = send(url, "/v1/completions", b'{"prompt": "x", "user": ' + b"[" * 5000 + b"]" * 5000 + b"}", {})
    assert r.status_code == 400 and "deeper than 100 levels" in r.json()["error"]["message"]
    # Unknown fields are ignored, as OpenAI does.
    r = send(url, "/v1/completions", {**OK_COMPLETION, "user": "me", "frobnicate": [1, {"x": None}]}, {})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


@pytest.fixture(scope="module")
def keyed(served):
    """A second front end on the same engine, with --api-key set."""
    from jaxspec.serve.app import create_app

    server, _ = served
    cfg = dataclasses.replace(server.cfg, serve=dataclasses.replace(server.cfg.serve, api_key="s3cret"))
    thread = ServerThread(create_app(dataclasses.replace(server, cfg=cfg))).start()
    yield server, thread.url
    thread.stop()


def test_api_key_is_required_when_set(keyed):
    server, url = keyed
    for key in ("wrong", "s3cre", "s3cret2"):
        with pytest.raises(openai.AuthenticationError):
            client(url, api_key=key).completions.create(model=server.model_name, prompt="x", max_tokens=2)
    for headers in ({}, {"authorization": "s3cret"}, {"authorization": "Basic s3cret"}):
        r = send(url, "/v1/chat/completions", OK_CHAT, headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(url + "/v1/models").status_code == 401
    r = client(url, api_key="s3cret").completions.create(model=server.model_name, prompt="x", max_tokens=2)
    assert r.usage.completion_tokens == 2
    assert httpx.get(url + "/health").status_code == 200  # probes need no key


def test_only_loopback_is_bound_by_default():
    from jaxspec.serve.launch import build_parser, config_from_args

    cfg = config_from_args(build_parser().parse_args([]))
    assert cfg.serve.host == "127.0.0.1"
    assert cfg.spec.algorithm == "ngram" and cfg.serve.adaptive  # speculation on by default
    cfg = config_from_args(build_parser().parse_args(["--host", "0.0.0.0", "--spec", "none", "--no-adaptive"]))
    assert cfg.serve.host == "0.0.0.0" and cfg.spec.algorithm == "none" and not cfg.serve.adaptive


def test_health_and_requests_wait_for_compilation(chat_model_dir):
    from jaxspec.serve.app import create_app
    from jaxspec.serve.server import build_server

    server = build_server(serve_config(chat_model_dir), progress=False)
    thread = ServerThread(create_app(server)).start()
    try:
        r = httpx.get(thread.url + "/health")
        assert r.status_code == 503 and r.json()["status"] == "starting"
        r = send(thread.url, "/v1/completions", OK_COMPLETION, {})
        assert r.status_code == 503 and "compiling" in r.json()["error"]["message"]
        assert server.runner.allocator.num_used == 0
        # The page gauges hold the pool's state from start-up, not 0 until a first request.
        assert metric(thread.url, "jaxspec_kv_pages_free") == server.runner.allocator.total > 0
        models = httpx.get(thread.url + "/v1/models").json()
        assert models["data"][0]["id"] == server.model_name
    finally:
        thread.stop()
        server.shutdown()


def test_kv_memory_fraction_sizes_the_page_pool(chat_model_dir):
    import os

    from jaxspec.models.loading import load_model
    from jaxspec.engine.assemble import num_pages_from_memory as _num_pages_from_memory

    cfg = serve_config(chat_model_dir, **{"serve.kv_memory_fraction": 0.01})
    mc = load_model(chat_model_dir, progress=False).config
    pages = _num_pages_from_memory(cfg, mc)
    per_page = 2 * mc.num_layers * cfg.engine.page_size * mc.num_kv_heads * mc.head_dim * 4
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")  # CPU: host memory
    assert 2 < pages and pages * per_page <= 0.0101 * free * 1.1  # free memory moves a little meanwhile



def test_default_max_tokens_fits_the_tightest_prompt(served):
    """No max_tokens sent: each prompt of a batch gets the default capped by the room the
    longest one leaves, and a prompt that leaves none is blamed, not max_tokens."""
    server, url = served
    cap = server.scheduler.max_sequence_tokens
    r = send(url, "/v1/completions", {"prompt": [[7] * 10, [7] * (cap - 5)], "temperature": 0}, {})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 2 * 5
    r = send(url, "/v1/completions", {"prompt": [[7] * 10, [7] * cap]}, {})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "prompt" and "prompt 1 has" in err["message"]
    assert "max_tokens" not in err["message"]
    assert wait_for_idle(server)


def raw_http(url: str, data: bytes, timeout: float = 20.0) -> bytes:
    """Send raw bytes, read until the server closes the connection (bounded by `timeout`)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(data)
        out = b""
        while chunk := sock.recv(65536):
            out += chunk
    return out


@pytest.fixture(scope="module")
def impatient(served):
    """A second front end on the same engine that waits 0.5 s for a request body."""
    from jaxspec.serve.app import create_app

    server, _ = served
    thread = ServerThread(create_app(server, body_timeout_s=0.5)).start()
    yield server, thread.url
    thread.stop()


def test_body_shorter_than_its_content_length_gets_408_and_a_closed_connection(impatient):
    server, url = impatient
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    reply = raw_http(url, head + b"Content-Length: 100\r\n\r\n" + b'{"prompt": "x"')  # 14 of 100 bytes
    status, _, body = reply.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 408") and b"connection: close" in status.lower()
    assert "14 bytes received of a Content-Length of 100" in json.loads(body)["error"]["message"]
    r = send(url, "/v1/completions", OK_COMPLETION, {})
    assert r.status_code == 200 and wait_for_idle(server)


@pytest.mark.parametrize("framing", [b"Content-Length: abc\r\n\r\n{}", b"Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
                                     b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n"])
def test_malformed_framing_gets_400_and_the_server_keeps_serving(served, framing):
    """uvicorn's HTTP parser (h11) refuses these before the app sees a request;
    jaxspec.serve.http makes that 400 carry the same JSON error body as every
    other refusal. And no hang, no 500: the server keeps serving."""
    server, url = served
    reply = raw_http(url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + framing)
    assert reply.startswith(b"HTTP/1.1 400")
    head, _, body = reply.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower()
    err = json.loads(body)["error"]
    assert err["type"] == "invalid_request_error" and err["message"].startswith("malformed HTTP request")
    r = send(url, "/v1/completions", OK_COMPLETION, {})
    assert r.status_code == 200 and wait_for_idle(server)
