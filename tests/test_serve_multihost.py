"""Multi-host serving: two CPU processes x 2 host devices form one 2x2 mesh (gloo collectives).

Process 0 serves HTTP and schedules; process 1 replays its device calls
(`jaxspec.serve.multihost`). Greedy answers must equal single-device
`Engine.generate`, and stopping process 0 must release process 1.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import httpx

from tests.serve_util import SERVE_CFG, free_port, wait_until_healthy
from tests.xla_env import subprocess_env

ROOT = Path(__file__).resolve().parent.parent


def test_two_processes_serve_one_mesh(chat_model_dir):
    from jaxspec.config import EngineSection
    from jaxspec.engine import Engine, Request
    from jaxspec.sampling_params import SamplingParams
    from jaxspec.models.loading import load_model

    m = load_model(chat_model_dir, progress=False)
    prompts = [m.tokenizer.encode(t, add_special_tokens=False) for t in ("The sea and the sky", "One two three one two")]
    engine = Engine(m.params, m.config, EngineSection(max_batch_size=2, max_context=256, length_buckets=(64, 256)),
                    progress=False)
    want = [m.tokenizer.decode(r.output_ids, skip_special_tokens=True)
            for r in engine.generate([Request(p, SamplingParams(max_tokens=12)) for p in prompts])]

    http_port, coord_port = free_port(), free_port()
    # One batch bucket (both processes compile every program; the adaptive pair k = 0 / 3 stays, so
    # the follower's calibration still replays the leader's calls).
    cfg = {**SERVE_CFG, "engine.max_batch_size": 2, "engine.batch_buckets": "2"}
    sets = [a for k, v in cfg.items() for a in ("--set", f"{k}={v}")]
    env = subprocess_env(2, PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen(
        [sys.executable, "-m", "jaxspec.serve", "--model", str(chat_model_dir), "--port", str(http_port),
         "--served-model-name", "tiny", "--mesh", "2x2", "--coordinator", f"localhost:{coord_port}",
         "--num-processes", "2", "--process-id", str(i), *sets],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    try:
        url = f"http://127.0.0.1:{http_port}"
        if not wait_until_healthy(url, procs, 600, interval=0.5):
            for p in procs:
                if p.poll() is None:
                    p.kill()
            raise AssertionError("a server process exited early:\n" + "\n---\n".join(
                p.communicate()[0][-3000:] for p in procs))
        got = []
        for p in prompts:  # concurrent rows would also work; one at a time keeps the check simple
            r = httpx.post(url + "/v1/completions", timeout=120,
                           json={"model": "tiny", "prompt": p, "max_tokens": 12, "temperature": 0})
            assert r.status_code == 200, r.text
            got.append(r.json()["choices"][0]["text"])
        assert got == want
        procs[0].send_signal(signal.SIGINT)  # the leader stops -> the follower is released
        logs = [p.communicate(timeout=60)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert procs[1].returncode == 0, logs[1][-3000:]
    assert "leader stopped after" in logs[1]
