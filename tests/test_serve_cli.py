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

from tests.serve_util import SERVE_CFG, free_port

ROOT = Path(__file__).resolve().parent.parent


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


def test_cli_compiles_logs_the_url_and_serves(chat_model_dir):
    port = free_port()
    sets = [a for k, v in SERVE_CFG.items() if not k.startswith("engine.num_pages") for a in ("--set", f"{k}={v}")]
    cmd = [sys.executable, "-m", "jaxspec.serve", "--model", str(chat_model_dir), "--port", str(port),
           "--api-key", "k3y", "--served-model-name", "tiny", "--num-pages", "40", *sets]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
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
