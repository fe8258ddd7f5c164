"""Assembles a serving stack from a Config: model, Engine, ModelRunner, Scheduler, metrics."""

from __future__ import annotations

import dataclasses
import logging
import secrets
import threading
import time
from pathlib import Path

import jax

from jaxspec.config import Config
from jaxspec.engine.checks import check_token_ids
from jaxspec.engine.adaptive import AdaptiveSteps, calibrate
from jaxspec.serve.metrics import ServerMetrics
from jaxspec.serve.protocol import APIError, GenParams
from jaxspec.engine.runner import ModelRunner
from jaxspec.engine.types import RequestError
from jaxspec.serve.scheduler import Scheduler, Seq
from jaxspec.serve.trace import Trace
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
    _scorer: object = dataclasses.field(default=None, repr=False)
    _grammars: object = dataclasses.field(default=None, repr=False)  # GrammarCompiler, on first use
    _warmup: object = dataclasses.field(default=None, repr=False)  # the "+grammar" compile thread
    _stop_warmup: bool = False

    @property
    def warmup(self) -> str:
        """/health's "warmup": "running" while the "+grammar" builds compile on a background thread
        (they take a core: a benchmark waits for "done" or "off" before it times anything)."""
        if self._warmup is None:
            return "off"
        return "running" if self._warmup.is_alive() else "done"

    @property
    def vocab_size(self) -> int:
        return self.runner.cfg.vocab_size

    @property
    def max_context(self) -> int:
        return self.runner.max_context - self.runner.reserve

    def warm_up(self, progress: bool = False) -> None:
        """Compile every bucket, time the decode buckets for the adaptive policy, start scheduling."""
        t0 = time.perf_counter()
        try:
            self.runner.compile(self.runner.all_keys(), progress=progress)
            if self.scheduler.adaptive is not None:
                calibrate(self.runner)
                self.scheduler.adaptive.cost.update(self.runner.decode_seconds)
        except Exception as e:
            self.startup_error = f"{type(e).__name__}: {e}"
            log.exception("start-up failed")
            raise
        self.scheduler.start()
        log.info("compiled %d buckets in %.1fs", self.runner.num_compiles, time.perf_counter() - t0)
        if self.cfg.serve.grammar_warmup and jax.process_count() == 1:  # started first: /health never reads "off" for it
            self._warmup = threading.Thread(target=self._grammar_warmup, name="jaxspec-grammar-warmup", daemon=True)
            self._warmup.start()
        self.ready.set()

    def _grammar_warmup(self) -> None:
        """Compile the "+grammar" builds (structured output) while serving: they cannot be stored."""
        from jaxspec.engine.host_io import GRAMMAR

        t0 = time.perf_counter()
        try:
            keys = self.runner.all_keys(GRAMMAR)
            for i, key in enumerate(keys):
                if self.draining or self._stop_warmup:
                    return
                if not self.runner.has_room(2):  # leave a request room to compile its own, evicting none
                    log.info("structured-output warm-up stopped after %d of %d builds: the process is near "
                             "vm.max_map_count; the rest compile on first use (jaxspec/engine/mappings.py)", i, len(keys))
                    return
                self.runner.compile([key])
        except Exception:  # a request compiles what it needs anyway
            log.exception("structured-output warm-up failed")
            return
        log.info("compiled the structured-output builds in %.1fs", time.perf_counter() - t0)

    def scorer(self):
        """The prompt scorer over the runner's weights (built on first use; engine/scoring.py)."""
        if self._scorer is None:
            from jaxspec.engine.scoring import PromptScorer

            self._scorer = PromptScorer(self.runner, self.stop_ids)
        return self._scorer

    def submit(self, prompt_ids: list[int], params: GenParams, seed: int, on_event, param_name: str) -> Seq:
        if self.draining:
            raise APIError(503, "the server is shutting down", type_="server_error")
        stop_ids = params.stop_ids(self.stop_ids)
        try:
            check_token_ids(self.runner, params, stop_ids)
        except RequestError as e:
            raise APIError(400, str(e), str(e).split(":")[0]) from None
        if len(prompt_ids) >= self.max_context:
            raise APIError(400, f"{param_name}: the prompt has {len(prompt_ids)} tokens; the context is "
                                f"{self.max_context}", param_name)
        try:  # the server's --verify greedy would decode a sampled request greedily
            check_request_sampling(self.runner.base_plan.verify, params.temperature)
        except ValueError as e:
            raise APIError(400, f"temperature: {e}", "temperature") from None
        why = self.scheduler.check(len(prompt_ids), params)
        if why is not None:
            raise APIError(400, f"max_tokens: {why}", "max_tokens")
        seq = Seq(list(prompt_ids), params, on_event, seed=seed, stop_ids=stop_ids,
                  grammar=self.grammar(params.structured_outputs))
        self.metrics.admitted(len(prompt_ids))
        self.scheduler.submit(seq)
        return seq

    def grammar(self, spec):
        """A fresh matcher for one sequence of a constrained request (grammar/matcher.py), or None."""
        if spec is None:
            return None
        if jax.process_count() > 1:
            raise APIError(400, f"{spec.field}: structured output is not supported on a multi-host server",
                           spec.field)
        if self._grammars is None:
            from jaxspec.grammar.matcher import GrammarCompiler

            self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.stop_ids)
        try:
            return self._grammars.matcher(spec)
        except ValueError as e:
            raise APIError(400, str(e), spec.field) from None

    def random_seed(self) -> int:
        return secrets.randbits(32)

    draining = False

    def drain(self, grace_s: float) -> int:
        """Stop admitting; give running and queued requests `grace_s` seconds; abort the rest (their
        clients get an error event and [DONE]). Returns how many were aborted."""
        self.draining = True
        sched = self.scheduler
        deadline = time.monotonic() + max(grace_s, 0.0)
        while time.monotonic() < deadline and sched.busy():
            time.sleep(0.05)
        left = sched.num_active + len(sched.waiting)
        if left:
            log.warning("shutdown: %d request(s) still running after %.0f s; ending them", left, grace_s)
        # Always, even with none left: it closes the scheduler, so a request that passed the draining
        # check but reaches the inbox only now ends with an error event instead of starting and
        # being cut by the exit.
        sched.abort_all("the server is shutting down")
        end = time.monotonic() + 10
        while time.monotonic() < end and sched.busy():
            time.sleep(0.05)
        time.sleep(0.2)  # let the streams flush their last events
        return left

    def shutdown(self) -> None:
        self._stop_warmup = True
        if self._warmup is not None:  # let a compile in flight finish: no thread inside XLA at exit
            self._warmup.join()
        self.scheduler.shutdown()


def enable_compilation_cache(cfg: Config) -> None:
    from jaxspec.paths import enable_compilation_cache as enable

    enable(cfg.serve.compilation_cache, cfg.model.cache_dir or None)


def build_server(cfg: Config, *, mesh=None, progress: bool = True, model=None,
                 split_pages: bool | None = None) -> Server:
    """Load the model and build the (not yet compiled) serving stack. `model`: a
    LoadedModel to reuse instead of loading cfg.model.path (tests). `split_pages`: under a mesh
    with data > 1, one page pool per data shard (each sequence pinned to a shard) rather than one
    replicated pool; None = `cfg.serve.split_pages` where the config has it, else on."""
    from jaxspec.engine.assemble import assemble, model_dtype, stop_token_ids
    from jaxspec.models.loading import load_model
    from jaxspec.speculative.drafters import validate_config

    cfg = validate_config(cfg)  # before minutes of loading

    dtype = model_dtype(cfg)
    enable_compilation_cache(cfg)
    if model is None:
        model = load_model(cfg.model.path, dtype=dtype, cache_dir=cfg.model.cache_dir or None, progress=progress,
                               gguf_blocks=cfg.engine.quantize == "gguf")
    s = cfg.serve
    # Split pages: a page pool per data shard; the scheduler pins each sequence to one
    # (`ModelRunner(split_pages=...)`, `Scheduler`). Off: one pool, replicated over "data".
    runner = assemble(cfg, model, mesh=mesh, progress=progress, serving=True, split_pages=split_pages)
    metrics = ServerMetrics(max_accept_length=runner.max_depth + 1)
    adaptive = None
    if len(runner.candidates) > 1:
        adaptive = AdaptiveSteps(runner.candidates, {}, hysteresis=s.adaptive_hysteresis, margin=s.adaptive_margin)
    scheduler = Scheduler(runner, model.tokenizer, max_batch_size=cfg.engine.max_batch_size, adaptive=adaptive,
                          metrics=metrics, prefill_calls_per_step=s.prefill_calls_per_step,
                          yield_steps=s.yield_steps, follow_up_window=s.follow_up_window,
                          follow_up_grace=s.follow_up_grace,
                          trace=Trace(s.trace, prefix_cache=cfg.engine.prefix_cache, spec=cfg.spec.algorithm,
                                      adaptive=adaptive is not None, max_batch_size=cfg.engine.max_batch_size))
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
