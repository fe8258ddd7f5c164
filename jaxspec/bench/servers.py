"""The servers the serve benchmarks start: one `python -m jaxspec.serve` process per mode.

Shared by `bench serve` (jaxspec/bench/serve.py) and its multi-turn workload
(jaxspec/bench/multiturn.py).
"""

from __future__ import annotations

import contextlib
import time

MODES = {
    "off": {"spec.algorithm": "none"},
    "on": {"spec.algorithm": "ngram", "serve.adaptive": False},
    "adaptive": {"spec.algorithm": "ngram", "serve.adaptive": True},
    # The shipped drafters (`--modes off,eagle3,dflash,dspark`); block drafters verify their block.
    "eagle3": {"spec.algorithm": "eagle3", "spec.draft_model": "default", "spec.num_draft_tokens": 4,
               "serve.adaptive": False},
    "dflash": {"spec.algorithm": "dflash", "spec.draft_model": "default", "spec.num_draft_tokens": 8,
               "serve.adaptive": False},
    "dspark": {"spec.algorithm": "dspark", "spec.draft_model": "default", "spec.num_draft_tokens": 8,
               "serve.adaptive": False},
}



def mode_overrides(mode: str, levels: list[int], args, extra: dict | None = None) -> dict:
    """A benchmark server's `--set` overrides: the serve defaults, the batch the levels need, the
    context, the mode's own keys, `extra`, then the user's `--set` items on top."""
    from jaxspec.serve.launch import SERVE_DEFAULTS

    overrides = {**SERVE_DEFAULTS, "engine.max_batch_size": max(levels), "engine.max_context": args.max_context,
                 **MODES[mode], **(extra or {})}
    for item in args.set:
        key, _, value = item.partition("=")
        overrides[key] = value
    return overrides


@contextlib.contextmanager
def launched(model: str, overrides: dict, label: str, config: str | None = None, port: int | None = None):
    """`python -m jaxspec.serve --model model` in its own process on loopback (a free port unless
    given) with `--set` overrides, once /health answers and the structured-output warm-up has
    finished (it compiles on a core after /health turns ready, and a wave timed meanwhile shares
    the cores with it): yields (url, served model name); SIGINT stops it on exit. A process
    per server keeps runs apart (one process holding every mode's executables runs out of mappings)."""
    import os
    import signal
    import socket
    import subprocess
    import sys
    import tempfile

    import httpx

    if not port:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "jaxspec.serve", "--model", model, "--port", str(port)]
    if config:
        cmd += ["--config", config]
    for key, value in overrides.items():
        cmd += ["--set", f"{key}={value}"]
    log = tempfile.NamedTemporaryFile("w+", prefix=f"jaxspec-serve-{label}-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    try:
        t0 = time.perf_counter()
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"[{label}] server exited with {proc.returncode}; log: {log.name}")
            with contextlib.suppress(httpx.TransportError):
                if is_ready(url, f"[{label}] server (log: {log.name})"):
                    break
            time.sleep(1)
        print(f"[{label}] server ready in {time.perf_counter() - t0:.0f}s (log: {log.name})", flush=True)
        t1 = time.perf_counter()
        while warmup_state(url) == "running":
            if proc.poll() is not None:
                raise RuntimeError(f"[{label}] server exited with {proc.returncode}; log: {log.name}")
            time.sleep(1)
        if time.perf_counter() - t1 > 1:
            print(f"[{label}] structured-output warm-up done {time.perf_counter() - t1:.0f}s later", flush=True)
        yield url, httpx.get(url + "/v1/models").json()["data"][0]["id"]
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def is_ready(url: str, what: str = "server") -> bool:
    """/health: True when ready, False while compiling; a failed start-up (500, the server keeps
    running to report it) raises with the server's reason instead of waiting forever."""
    import httpx

    r = httpx.get(url + "/health", timeout=2)
    if r.status_code == 500:
        try:
            reason = r.json().get("error", r.text)
        except ValueError:
            reason = r.text
        raise RuntimeError(f"{what} failed to start: {reason}")
    return r.status_code == 200


def warmup_state(url: str) -> str:
    """/health's "warmup" of a ready server: running, done or off (older servers: off)."""
    import httpx

    return httpx.get(url + "/health", timeout=2).json().get("warmup", "off")


def metric_samples(url: str) -> list:
    """The server's /metrics samples, fetched and parsed once."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    return [s for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text) for s in fam.samples]
