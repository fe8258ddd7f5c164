"""`python -m jaxspec.serve` as a user starts it: a subprocess, its log line, real HTTP."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.serve_util import NUM_PAGES, SERVE_CFG, free_port, metric, wait_until_healthy

ROOT = Path(__file__).resolve().parent.parent
# These tests are about the command line, not the buckets: one batch bucket and one draft length
# compile 8 programs, not SERVE_CFG's 14 (the in-process tests keep those): the first start took 42 s
# against 86 s (2 busy cores).
CLI_CFG = {**SERVE_CFG, "engine.batch_buckets": "8", "serve.adaptive_steps": "3"}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """Both servers share one XLA cache (their configurations are the same), so the second start loads
    what the first compiled: the no-recompile checks live in-process (tests/test_serve.py), these test
    the command line."""
    return {**os.environ, "PYTHONPATH": str(ROOT), "JAX_COMPILATION_CACHE_DIR": str(tmp_path_factory.mktemp("xla")),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}


def listening_addresses(port: int) -> set[str]:
    """Local addresses with a TCP socket listening on `port`, from the kernel's table (Linux)."""
    out = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, p = local.split(":")
            if int(p, 16) == port and state == "0A":  # 0A = LISTEN
                if width == 8:
                    out.add(socket.inet_ntoa(bytes.fromhex(addr)[::-1]))
                else:
                    out.add(addr)
    return out


def test_cli_compiles_logs_the_url_and_serves(chat_model_dir, env):
    port = free_port()
    sets = [a for k, v in CLI_CFG.items() if not k.startswith("engine.num_pages") for a in ("--set", f"{k}={v}")]
    cmd = [sys.executable, "-m", "jaxspec.serve", "--model", str(chat_model_dir), "--port", str(port),
           "--api-key", "k3y", "--served-model-name", "tiny", "--num-pages", str(NUM_PAGES), *sets]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = []
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        saw_starting = False
        while time.monotonic() < deadline:  # /health: 503 while compiling, then 200
            try:
                r = httpx.get(url + "/health", timeout=2)
                saw_starting |= r.status_code == 503
                if r.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, "server exited early"
            time.sleep(0.2)
        assert r.status_code == 200 and r.json()["model"] == "tiny"
        assert saw_starting
        assert listening_addresses(port) == {"127.0.0.1"}  # loopback only by default
        assert metric(url, "jaxspec_kv_pages_free") == NUM_PAGES - 1  # --num-pages (less the null page)
        h = {"authorization": "Bearer k3y"}
        assert httpx.get(url + "/v1/models", headers=h).json()["data"][0]["id"] == "tiny"
        assert httpx.get(url + "/v1/models").status_code == 401
        r = httpx.post(url + "/v1/completions", headers=h, timeout=60,
                       json={"model": "tiny", "prompt": "Hello", "max_tokens": 5, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        log.append(out)
    text = "".join(log)
    # One line with the URL and the model once every bucket is compiled.
    assert re.search(rf"jaxspec serving tiny at http://127\.0\.0\.1:{port}/v1", text), text[-2000:]
    assert "compiling buckets" in text  # the progress bar
    assert proc.returncode in (0, -signal.SIGINT)


def test_sigterm_drains_open_streams_and_exits_0(chat_model_dir, env):
    """Issue 23: SIGTERM with streams open exited 143 and cut every stream (no finish_reason, no
    error event, no [DONE]). Now: no new requests, running ones get --shutdown-grace (0 here, so
    the running ones are ended), each stream closes with a finish or an error event and [DONE],
    and the process exits 0."""
    import json
    import threading

    port = free_port()
    sets = [a for k, v in CLI_CFG.items() for a in ("--set", f"{k}={v}")]
    cmd = [sys.executable, "-m", "jaxspec.serve", "--model", str(chat_model_dir), "--port", str(port),
           "--served-model-name", "tiny", "--shutdown-grace", "0", *sets]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    results, started = {}, threading.Semaphore(0)

    def stream(k):
        lines = []
        try:
            with httpx.stream("POST", url + "/v1/completions", timeout=60,
                              json={"model": "tiny", "prompt": f"Story {k}:", "max_tokens": 180, "temperature": 1.0,
                                    "stream": True, "ignore_eos": True}) as r:
                if r.status_code != 200:
                    r.read()
                    lines.append(f"STATUS {r.status_code} {r.text[:200]}")
                    started.release()
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        if not lines:
                            started.release()
                        lines.append(line[6:])
        except httpx.HTTPError as e:
            lines.append(f"TRANSPORT {type(e).__name__}")
            started.release()
        results[k] = lines

    try:
        assert wait_until_healthy(url, [proc], 300), "server exited early"
        threads = [threading.Thread(target=stream, args=(k,)) for k in range(24)]
        for t in threads:
            t.start()
        for _ in range(4):
            started.acquire(timeout=60)
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(timeout=60)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-2000:]
    assert len(results) == 24
    aborted = 0
    for k, lines in results.items():
        assert lines, k
        if lines[0].startswith(("TRANSPORT", "STATUS 503")):
            continue  # refused while draining, or not connected before the listener closed: no stream was cut
        assert not lines[0].startswith("STATUS"), lines[0]
        assert lines[-1] == "[DONE]", (k, lines[-3:])
        last = json.loads(lines[-2])
        assert "error" in last or last["choices"][0]["finish_reason"] is not None, (k, lines[-3:])
        aborted += "error" in last
    assert aborted > 0, (out[-3000:], {k: v[-2:] for k, v in results.items()})  # grace 0: running streams ended, not cut
