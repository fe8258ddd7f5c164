"""`python -m jaxspec.serve`: the OpenAI-compatible server's command line, and an in-process launcher.

    python -m jaxspec.serve                      # embedded SmolLM2, n-gram speculation, adaptive
    python -m jaxspec.serve --mesh 4x2 --port 8000 --api-key $KEY
    python -m jaxspec.serve --config configs/serve.toml --spec none

The server listens at once; `/health` answers 503 while every bucket
compiles (progress bar on stderr) and 200 once it is ready, when one line
gives the URL and the model.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
from typing import Any

from jaxspec.serve.http import http_protocol

SERVE_FLAG_KEYS = {
    "host": "serve.host",
    "port": "serve.port",
    "api_key": "serve.api_key",
    "served_model_name": "serve.served_model_name",
    "max_batch_size": "engine.max_batch_size",
    "kv_memory_fraction": "serve.kv_memory_fraction",
    "steps_per_call": "serve.steps_per_call",
    "prefill_chunk": "serve.prefill_chunk",
    "adaptive": "serve.adaptive",
    "adaptive_steps": "serve.adaptive_steps",
    "shutdown_grace": "serve.shutdown_grace",
}
# Speculation is on by default when serving: n-gram drafts cost no extra model,
# verify "auto" keeps sampled requests exact (all-greedy batches take the
# greedy rule), and the adaptive policy turns it off where it loses.
# min match 2: the server's adaptive chains draft at most 3 tokens, so the
# 1-gram cap buys nothing there, and a batched verify pays for every row's width.
SERVE_DEFAULTS = {"spec.algorithm": "ngram", "spec.verify": "auto", "spec.ngram_min_match": 2}


def build_parser() -> argparse.ArgumentParser:
    from jaxspec.generate import add_engine_args, add_model_args, add_spec_args
    from jaxspec.mesh import add_mesh_args

    p = argparse.ArgumentParser(prog="python -m jaxspec.serve", description=__doc__.split("\n")[0])
    add_model_args(p)
    p.add_argument("--host", help="bind address (default 127.0.0.1: loopback only)")
    p.add_argument("--port", type=int, help="default 8000")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/*")
    p.add_argument("--served-model-name", help="the model id clients send (default: the model's name)")
    p.add_argument("--max-batch-size", type=int, help="running sequences at most")
    p.add_argument("--kv-memory-fraction", type=float, help="size the KV page pool from free device memory")
    p.add_argument("--steps-per-call", type=int, help="speculative iterations per device call")
    p.add_argument("--prefill-chunk", type=int, help="prompt tokens per prefill call and row")
    p.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=None,
                   help="choose the draft length per batch bucket from acceptance and cost (default on)")
    p.add_argument("--adaptive-steps", help="candidate draft lengths, e.g. 0,1,3,5 (0 = no speculation)")
    add_engine_args(p)
    add_spec_args(p)
    add_mesh_args(p)
    p.add_argument("--shutdown-grace", type=float,
                   help="seconds running requests get to finish after SIGTERM (default 30)")
    p.add_argument("--log-level", default="info")
    return p


def config_from_args(args) -> Any:
    """Config defaults < SERVE_DEFAULTS < --config file < --set < flags."""
    from jaxspec.config import apply_overrides, load_config
    from jaxspec.generate import config_from_args as generate_config

    return generate_config(args, base=apply_overrides(load_config(None), SERVE_DEFAULTS),
                           extra_keys=SERVE_FLAG_KEYS)


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    from jaxspec.config import ConfigValueError
    from jaxspec.models.config import ConfigError
    from jaxspec.models.loading import LoadError
    from jaxspec.mesh import MeshError, setup_mesh
    from jaxspec.serve.app import create_app
    from jaxspec.serve.server import build_server
    from jaxspec.native.build import NativeKernelError
    from jaxspec.speculative.algorithm import SpecConfigError

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("jaxspec.serve")
    try:
        cfg = config_from_args(args)
        mesh = setup_mesh(args)  # the Engine pads heads the TP size does not divide
        server = build_server(cfg, mesh=mesh, progress=True)
    except (ConfigValueError, SpecConfigError, ConfigError, LoadError, MeshError, NativeKernelError, OSError,
            ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import jax

    if jax.process_count() > 1 and jax.process_index() != 0:
        return follow_leader(server, log)
    leader = None
    if jax.process_count() > 1:  # process 0: HTTP and scheduling; the others replay its device calls
        from jaxspec.serve.multihost import LeaderRunner

        leader = server.scheduler.runner = LeaderRunner(server.runner)
    app = create_app(server)
    s = cfg.serve

    @app.on_event("startup")
    async def _warm_up():  # compile off the event loop, so /health answers while it runs
        def run():
            try:
                server.warm_up(progress=True)
            except Exception:
                return
            log.info("jaxspec serving %s at http://%s:%d/v1 (spec=%s, adaptive=%s, mesh=%s)", server.model_name,
                     s.host, s.port, cfg.spec.algorithm, s.adaptive, args.mesh or "none")

        threading.Thread(target=run, name="warm-up", daemon=True).start()

    class DrainingServer(uvicorn.Server):
        """SIGTERM / SIGINT drain the scheduler before uvicorn closes the connections; a second
        signal exits at once (uvicorn's force exit)."""

        draining = False

        def handle_exit(self, sig, frame):
            if self.draining:
                return super().handle_exit(sig, frame)
            self.draining = True

            def drain():
                server.drain(s.shutdown_grace)
                self.should_exit = True

            threading.Thread(target=drain, name="drain", daemon=True).start()

    try:
        DrainingServer(uvicorn.Config(app, host=s.host, port=s.port, log_level="warning",
                                      timeout_graceful_shutdown=5, http=http_protocol())).run()
    finally:
        server.shutdown()
        if leader is not None:
            leader.stop()
    return 0


def follow_leader(server, log) -> int:
    """Processes other than 0 of a multi-host mesh: compile, then run process 0's device calls."""
    import jax

    from jaxspec.engine.adaptive import calibrate
    from jaxspec.serve.multihost import follow

    server.runner.compile(server.runner.all_keys())
    if server.scheduler.adaptive is not None:
        calibrate(server.runner)  # device calls too: the same ones, in the same order, as the leader's
    log.info("process %d following process 0", jax.process_index())
    calls = follow(server.runner)
    log.info("process %d: leader stopped after %d device calls", jax.process_index(), calls)
    return 0
