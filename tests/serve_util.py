"""Shared by the server tests: the small serving config, an in-process server thread and HTTP helpers."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time

import httpx
import openai

NUM_PAGES = 48  # x page size 8 = 376 usable slots: ~2 long requests at once
SERVE_CFG = {
    "engine.max_batch_size": 8, "engine.batch_buckets": "1,8", "engine.max_context": 256, "engine.page_size": 8,
    "engine.num_pages": NUM_PAGES, "engine.length_buckets": "32,64,256", "serve.context_buckets": "64",
    "serve.prefill_chunk": 64, "serve.max_prefill_batch": 1, "serve.adaptive_steps": "0,3",
    "serve.steps_per_call": 4, "serve.max_body_bytes": 65536,
    "serve.compilation_cache": "off",  # every test compiles for real: the no-recompile checks stay honest
    "serve.grammar_warmup": False,  # no background compiles beside the tests (and their compile counts)
}


def serve_config(model_dir, **extra):
    from jaxspec.config import apply_overrides, load_config
    from jaxspec.serve.launch import SERVE_DEFAULTS

    return apply_overrides(load_config(None), {**SERVE_DEFAULTS, "model.path": str(model_dir), **SERVE_CFG, **extra})


class ServerThread:
    """uvicorn serving `app` on a background thread."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn

        from jaxspec.serve.http import http_protocol

        if port == 0:
            port = free_port(host)
        self.url = f"http://{host}:{port}"
        self._server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                                     timeout_graceful_shutdown=5, http=http_protocol()))
        self._thread = threading.Thread(target=self._server.run, name="uvicorn", daemon=True)

    def start(self) -> "ServerThread":
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"uvicorn did not start on {self.url}")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=15)


def client(url, **kw):
    return openai.OpenAI(base_url=url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0, **kw)


def wait_for_idle(server, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.scheduler.num_active == 0 and not server.scheduler.waiting and server.runner.allocator.num_used == 0:
            return True
        time.sleep(0.05)
    return False


def metric(url, name, labels=None) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in (labels or {}).items()):
                total += s.value
    return total


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_until(predicate, timeout=60.0, interval=0.02) -> bool:
    """Poll `predicate` until it holds; the deadline only bounds a failing test."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


@contextlib.contextmanager
def hold_decode(server, timeout=120.0):
    """Park the scheduler thread at the start of its next decode call until the block
    exits, so a test sees requests in a known state whatever the machine's speed.
    Yields an Event set once the scheduler is parked. (Replaces the runner's bound
    method on the instance; the class is untouched.)"""
    runner = server.runner
    real = runner.decode
    parked, release = threading.Event(), threading.Event()

    def decode(*args, **kwargs):
        parked.set()
        release.wait(timeout)
        return real(*args, **kwargs)

    runner.decode = decode
    try:
        yield parked
    finally:
        release.set()
        runner.__dict__.pop("decode", None)


@contextlib.contextmanager
def record_cancels(server):
    """Yields the list of distinct sequences the request handlers cancel, in order. (A
    stream's generator and its background task may both cancel the same sequence.)"""
    sched = server.scheduler
    real = sched.cancel
    seen = []

    def cancel(seq):
        real(seq)
        if not any(s is seq for s in seen):
            seen.append(seq)

    sched.cancel = cancel
    try:
        yield seen
    finally:
        sched.__dict__.pop("cancel", None)


def post_and_keep_open(url: str, path: str, body: dict) -> socket.socket:
    """Send a POST over a raw socket and return it unread: closing it is the client hanging up."""
    u = httpx.URL(url)
    data = json.dumps(body).encode()
    sock = socket.create_connection((u.host, u.port))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {u.host}:{u.port}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def wait_until_healthy(url: str, procs, timeout: float, interval: float = 0.2) -> bool:
    """Poll `url`/health until it answers 200 (True), or until the deadline passes (True: the
    caller's next request says what is wrong); False as soon as one of `procs` has exited."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return True
        except httpx.TransportError:
            pass
        if any(p.poll() is not None for p in procs):
            return False
        time.sleep(interval)
    return True
