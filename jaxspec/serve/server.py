"""Assembles a serving stack from a Config: model, Engine, ModelRunner, Scheduler, metrics."""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import threading
import time
from pathlib import Path

import numpy as np

from jaxspec.config import Config
from jaxspec.engine.adaptive import AdaptiveSteps
from jaxspec.serve.metrics import ServerMetrics
from jaxspec.serve.protocol import APIError, GenParams
from jaxspec.serve.runner import ModelRunner
from jaxspec.serve.scheduler import Scheduler, Seq, SeqParams
from jaxspec.speculative.algorithm import check_request_sampling

log = logging.getLogger("jaxspec.serve")


@dataclasses.dataclass
class Server:
    cfg: Config
    runner: ModelRunner
    scheduler: Scheduler
    tokenizer: object
    model_name: str
    stop_ids: tuple[int, ...]
    metrics: ServerMetrics
    ready: threading.Event = dataclasses.field(default_factory=threading.Event)
    startup_error: str | None = None
    # Request fields a body leaves out take these (the model's generation_config.json under
    # serve.generation_config = "auto", as vLLM does) before the OpenAI defaults.
    sampling_defaults: dict = dataclasses.field(default_factory=dict)

    @property
    def vocab_size(self) -> int:
        return self.runner.cfg.vocab_size

    @property
    def max_context(self) -> int:
        return self.runner.engine.max_context - self.runner.reserve

    def warm_up(self, progress: bool = False) -> None:
        """Compile every bucket, time the decode buckets for the adaptive policy, start scheduling."""
        t0 = time.perf_counter()
        try:
            self.runner.compile(self.runner.all_keys(), progress=progress)
            if self.scheduler.adaptive is not None:
                self.runner.calibrate()
                self.scheduler.adaptive.cost.update(self.runner.decode_seconds)
        except Exception as e:
            self.startup_error = f"{type(e).__name__}: {e}"
            log.exception("start-up failed")
            raise
        self.scheduler.start()
        self.ready.set()
        log.info("compiled %d buckets in %.1fs", self.runner.num_compiles, time.perf_counter() - t0)

    def submit(self, prompt_ids: list[int], params: GenParams, seed: int, on_event, param_name: str) -> Seq:
        if self.draining:
            raise APIError(503, "the server is shutting down", type_="server_error")
        stop_ids = () if params.ignore_eos else self.stop_ids
        sp = SeqParams(max_new_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
                       top_k=params.top_k, seed=seed, stop_ids=stop_ids, stop_strings=params.stop)
        if len(prompt_ids) >= self.max_context:
            raise APIError(400, f"{param_name}: the prompt has {len(prompt_ids)} tokens; the context is "
                                f"{self.max_context}", param_name)
        try:  # the server's --verify greedy would decode a sampled request greedily
            check_request_sampling(self.runner.base_plan.verify, params.temperature)
        except ValueError as e:
            raise APIError(400, f"temperature: {e}", "temperature") from None
        why = self.scheduler.check(len(prompt_ids), sp)
        if why is not None:
            raise APIError(400, f"max_tokens: {why}", "max_tokens")
        seq = Seq(list(prompt_ids), sp, on_event)
        self.metrics.admitted(len(prompt_ids))
        self.scheduler.submit(seq)
        return seq

    def random_seed(self) -> int:
        return secrets.randbits(32)

    draining = False

    def drain(self, grace_s: float) -> int:
        """Stop admitting; give running and queued requests `grace_s` seconds; abort the rest (their
        clients get an error event and [DONE]). Returns how many were aborted."""
        self.draining = True
        sched = self.scheduler
        deadline = time.monotonic() + max(grace_s, 0.0)
        while time.monotonic() < deadline and (sched.num_active or sched.waiting or not sched._inbox.empty()):
            time.sleep(0.05)
        left = sched.num_active + len(sched.waiting)
        if left:
            log.warning("shutdown: %d request(s) still running after %.0f s; ending them", left, grace_s)
            sched.abort_all("the server is shutting down")
            end = time.monotonic() + 10
            while time.monotonic() < end and (sched.num_active or sched.waiting):
                time.sleep(0.05)
        time.sleep(0.2)  # let the streams flush their last events
        return left

    def shutdown(self) -> None:
        self.scheduler.shutdown()


def _num_pages_from_memory(cfg: Config, model_cfg, data_shards: int = 1) -> int:
    """Pages that fit in `kv_memory_fraction` of free device memory (host RAM on CPU). With pages
    split over `data_shards` each accelerator holds 1/data_shards of them (CPU devices share one RAM)."""
    import jax

    dev = jax.devices()[0]
    stats = dev.memory_stats() or {}
    if "bytes_limit" in stats:
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    itemsize = 4 if cfg.model.dtype == "float32" else 2
    per_page = 2 * model_cfg.num_layers * cfg.engine.page_size * model_cfg.num_kv_heads * model_cfg.head_dim * itemsize
    pages = max(2, int(free * cfg.serve.kv_memory_fraction // per_page))
    if dev.platform != "cpu":
        pages *= data_shards
    if jax.process_count() > 1:  # every process must build the same cache shape: process 0's count
        from jax.experimental import multihost_utils

        pages = int(multihost_utils.broadcast_one_to_all(np.int32(pages)))
    return pages


def _run_config(model_cfg, mesh):
    """The config the engine runs: heads padded for the mesh's TP size (`models.padding`), so pages are sized right."""
    if mesh is None:
        return model_cfg
    from jaxspec.models.padding import padded_config

    return padded_config(model_cfg, mesh.shape["model"])[0]


def enable_compilation_cache(cfg: Config) -> None:
    from jaxspec.paths import enable_compilation_cache as enable

    enable(cfg.serve.compilation_cache, cfg.model.cache_dir or None)


def build_server(cfg: Config, *, mesh=None, progress: bool = True, model=None,
                 split_pages: bool | None = None) -> Server:
    """Load the model and build the (not yet compiled) serving stack. `model`: a
    LoadedModel to reuse instead of loading cfg.model.path (tests). `split_pages`: under a mesh
    with data > 1, one page pool per data shard (each sequence pinned to a shard) rather than one
    replicated pool; None = `cfg.serve.split_pages` where the config has it, else on."""
    import jax.numpy as jnp

    from jaxspec.engine import Engine
    from jaxspec.api import build_draft, stop_token_ids
    from jaxspec.models.loading import load_model

    dtype = jnp.float32 if cfg.model.dtype == "float32" else jnp.bfloat16
    enable_compilation_cache(cfg)
    if model is None:
        model = load_model(cfg.model.path, dtype=dtype, cache_dir=cfg.model.cache_dir or None, progress=progress)
    spec = cfg.spec
    s = cfg.serve
    if spec.algorithm.lower() == "none":
        # Plain decoding is the k = 0 plan of the speculative loop (one token per iteration).
        spec, candidates = dataclasses.replace(spec, algorithm="ngram", topk=1, num_draft_tokens=2), (0,)
    elif s.adaptive:
        candidates = s.adaptive_steps
    else:
        candidates = (spec.num_draft_tokens - 1,)
    if split_pages is None:
        split_pages = bool(getattr(s, "split_pages", True))
    data_shards = mesh.shape["data"] if split_pages and mesh is not None else 1
    engine_cfg = cfg.engine
    if s.kv_memory_fraction > 0:
        pages = _num_pages_from_memory(cfg, _run_config(model.config, mesh), data_shards)
        engine_cfg = dataclasses.replace(engine_cfg, num_pages=pages)
    draft = build_draft(dataclasses.replace(cfg, spec=spec), model, dtype, progress)
    corpus = None
    if spec.ngram_corpus:
        from jaxspec.speculative.drafters.ngram import corpus_token_array

        corpus = corpus_token_array(spec.ngram_corpus, model.tokenizer, vocab_size=model.config.vocab_size)
    if s.adaptive and candidates != (0,):
        # The engine's own plan is the deepest candidate (page reserve and buffers size to it).
        spec = dataclasses.replace(spec, topk=1, num_draft_tokens=max(candidates) + 1,
                                   num_steps=max(max(candidates), 1))
    # Split pages: a page pool per data shard; the scheduler pins each sequence to one
    # (`Engine(split_pages=...)`, `Scheduler`). Off: one pool, replicated over "data".
    engine = Engine(model.params, model.config, engine_cfg, progress=progress, spec=spec, draft=draft,
                    ngram_corpus=corpus, mesh=mesh, split_pages=split_pages)
    runner = ModelRunner(engine, steps_candidates=candidates, steps_per_call=s.steps_per_call,
                         context_buckets=s.context_buckets, prefill_chunk=s.prefill_chunk,
                         max_prefill_batch=s.max_prefill_batch)
    metrics = ServerMetrics(max_accept_length=runner.max_depth + 1)
    adaptive = None
    if len(runner.candidates) > 1:
        adaptive = AdaptiveSteps(runner.candidates, {}, hysteresis=s.adaptive_hysteresis)
    scheduler = Scheduler(runner, model.tokenizer, max_batch_size=engine_cfg.max_batch_size, adaptive=adaptive,
                          metrics=metrics)
    name = s.served_model_name or (
        "SmolLM2-135M-Instruct" if cfg.model.path == "default" else Path(cfg.model.path).name)
    defaults = {}
    if s.generation_config == "auto":
        from jaxspec.models.loading import generation_defaults

        defaults = generation_defaults(model.path)
        if defaults:
            log.info("sampling defaults from %s/generation_config.json: %s", model.path,
                     ", ".join(f"{k}={v}" for k, v in defaults.items()))
    return Server(cfg=cfg, runner=runner, scheduler=scheduler, tokenizer=model.tokenizer, model_name=name,
                  stop_ids=stop_token_ids(model), metrics=metrics, sampling_defaults=defaults)
