"""Generation: bucketed, AOT-compiled prefill and an on-device decode loop.

Two pure functions per shape bucket, compiled ahead of time and cached:

* `prefill_fn(params, cache, tokens [B, L], prompt_lens [B], page_table, sampling)`
  writes the prompts' K/V and samples each sequence's first new token;
* `decode_fn(params, state)` runs a `lax.while_loop` until every sequence is
  done: single-token steps with the `DecodeState` carry, or, with speculation
  on, draft -> verify -> commit iterations with the `SpecState` carry
  (`jaxspec.speculative.loop`; the spec prefill also prefills the draft model).

The cache is donated to both, so it is updated in place. Buckets are
(batch, prompt length, context) for prefill and (batch, context) for decode;
calls go straight to the compiled executables, so an already-compiled bucket
can never retrace.

With a device mesh (`Engine(..., mesh=...)`, see `jaxspec.mesh`)
params and caches are placed on it once, batch inputs are put on it per call,
and both functions pin their output state to the same layout
(`constrain_state`): an executable's outputs are then valid inputs of the next
call as compiled, and the donated cache keeps its buffers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import typing
import sys
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import aot
from jaxspec.cache.paged import KVCache, PageAllocator, ShardedPageAllocator, check_cache_fits
from jaxspec.config import EngineSection
from jaxspec import mesh as shd
from jaxspec.models.config import ModelConfig
from jaxspec.models.llama import prepare_params
from jaxspec.native.build import use_native_kernels
from jaxspec.engine.device_sampling import MAX_STOP_IDS, DeviceSampling
from jaxspec.engine.programs import make_decode_fn, make_prefill_fn, make_spec_prefill_fn

class RequestError(ValueError):
    """A request the engine cannot serve; the message names the problem."""


class _Row(typing.NamedTuple):
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop_ids: tuple
    max_new: int


@dataclasses.dataclass
class Request:
    prompt_ids: list[int]
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()

    def row(self):
        """The request as a `DeviceSampling.pack` row."""
        return _Row(self.temperature, self.top_p, self.top_k, self.seed, self.stop_token_ids, self.max_new_tokens)


@dataclasses.dataclass
class Result:
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: str  # "stop" (a stop token) or "length"
    accept_lengths: list[int] | None = None  # speculative: committed tokens per verify step


def bucket_for(n: int, buckets: Sequence[int], what: str) -> int:
    for b in sorted(buckets):
        if n <= b:
            return b
    raise RequestError(f"{what} {n} exceeds the largest bucket {max(buckets)}")


class Engine:
    """Owns params, the paged cache and the compiled executables of one model."""

    def __init__(
        self, params: dict, cfg: ModelConfig, engine_cfg: EngineSection, *, progress: bool = True,
        spec=None, draft: tuple[dict, ModelConfig] | None = None, ngram_corpus=None,
        mesh: jax.sharding.Mesh | None = None, benchmark: bool = False, split_pages: bool = True,
        adaptive: bool = False,
    ):
        """`params`/`draft` params as loaded (Hugging Face layout); the engine keeps
        the runtime layout (`prepare_params`). `spec`: a SpecSection (algorithm !=
        "none" turns speculation on); `draft`: (params, config) of the STANDALONE
        draft model; `ngram_corpus`: token ids [K] (`corpus_token_array`) the
        n-gram drafter also matches against, on device. `mesh`: a ("data", "model")
        mesh (`sharding.make_mesh`) to shard params, caches and batches over; heads
        and MLP columns its TP size does not divide are zero-padded (exact), so
        `self.cfg` may have more heads than `self.model_cfg`. `split_pages`: with a
        "data" axis > 1, give each data shard its own slice of the cache's pages and
        run prefill / decode per data shard (`sharding.per_data_shard`). `adaptive` (with speculation):
        each batch bucket runs plain decoding or the configured draft shape, whichever the policy
        (`engine.adaptive.EngineAdaptive`) expects to commit more tokens per second."""
        self.mesh = mesh
        self.split_pages = bool(split_pages and mesh is not None and mesh.shape["data"] > 1)
        self.num_shards = mesh.shape["data"] if self.split_pages else 1
        self.progress = progress
        self.draft_padding = None
        self.model_cfg = cfg  # as loaded; self.cfg is what runs (heads padded for the mesh)
        params, cfg, self.padding = self._pad_for_mesh(params, cfg, "model")
        loop = engine_cfg.layer_loop
        self._unstack = None if loop == "auto" else loop == "unrolled"
        self.native_kernels = use_native_kernels(engine_cfg.cpu_kernels, params["embed"].dtype, mesh)
        runtime = prepare_params(params, cfg, unstack=self._unstack, native=self.native_kernels)
        self.params = shd.shard_params(runtime, cfg, mesh)
        self.cfg = cfg
        self.ecfg = engine_cfg
        self.max_context = min(engine_cfg.max_context, cfg.max_position_embeddings)
        self.page_size = engine_cfg.page_size
        ctx_bucket = bucket_for(self.max_context, engine_cfg.length_buckets, "max_context")
        pages_per_seq = -(-ctx_bucket // self.page_size)
        n = self.num_shards  # one page pool per data shard, each with its own null page
        per_shard = (engine_cfg.num_pages // n if engine_cfg.num_pages
                     else -(-engine_cfg.max_batch_size // n) * pages_per_seq + 1)
        num_pages = n * per_shard
        dtype = params["embed"].dtype
        check_cache_fits((cfg.num_layers, num_pages, self.page_size, cfg.num_kv_heads, cfg.head_dim), dtype, mesh)
        self.cache = shd.zeros_cache(
            (cfg.num_layers, num_pages, self.page_size, cfg.num_kv_heads, cfg.head_dim), dtype, mesh,
            self.split_pages)
        self.allocator = (ShardedPageAllocator(n, per_shard, self.page_size) if self.split_pages
                          else PageAllocator(num_pages, self.page_size))
        self.spec_plan = None
        self.drafter = None
        self.draft_params = None
        self.draft_cfg = None  # the draft model's config, for drafters that have one
        self.draft_cache = None
        self.corpus = None
        self.adaptive = None
        spec_on = spec is not None and spec.algorithm.lower() != "none"
        if spec_on:
            self._init_spec(spec, draft, num_pages, ngram_corpus, benchmark)
        if not spec_on or adaptive:  # plain decoding: the engine's program, or the policy's k = 0
            plain = (jax.jit(self.pinned(make_prefill_fn(cfg), replicated=(0,), static=(6,)),
                             donate_argnums=(1,), static_argnums=(6,)),
                     jax.jit(self.pinned(make_decode_fn(cfg), replicated=(0,)), donate_argnums=(1,)))
            if spec_on:
                from jaxspec.engine.adaptive import EngineAdaptive

                self._plain = plain
                self.adaptive = EngineAdaptive(self.spec_plan.max_depth)
            else:
                self._prefill, self._decode = plain
        self._compiled: dict[tuple, object] = {}
        self.last_timing: dict[str, float] = {}

    def _init_spec(self, spec, draft, num_pages: int, ngram_corpus, benchmark: bool) -> None:
        from jaxspec.speculative.algorithm import validate_spec_config
        from jaxspec.speculative.drafters import build_drafter, reserve_tokens
        from jaxspec.speculative.loop import SpecPlan, make_spec_decode_fn

        plan = SpecPlan.from_config(validate_spec_config(spec, benchmark=benchmark, draft_given=draft is not None))
        if ngram_corpus is not None:
            if plan.algorithm != "ngram":
                raise RequestError("an n-gram corpus needs spec.algorithm = ngram")
            self.corpus = shd.shard_batch(np.asarray(ngram_corpus, np.int32).reshape(1, -1), self.mesh)
        dparams, dcfg = draft if draft is not None else (None, None)
        if isinstance(dcfg, ModelConfig):
            dparams, dcfg, self.draft_padding = self._pad_for_mesh(dparams, dcfg, "draft model")
        try:
            drafter = build_drafter(plan, draft_cfg=dcfg, target_cfg=self.cfg)
        except ValueError as e:
            raise RequestError(str(e)) from None
        self.draft_params = self._draft_params(drafter, dparams, dcfg)
        ccfg = drafter.draft_cache_cfg
        if ccfg is not None:
            dtype = self.params["embed"].dtype
            shape = (ccfg.num_layers, num_pages, self.page_size, ccfg.num_kv_heads, ccfg.head_dim)
            check_cache_fits(shape, dtype, self.mesh, "draft KV cache")
            self.draft_cache = shd.zeros_cache(shape, dtype, self.mesh, self.split_pages)
        self._reserve = reserve_tokens(plan, drafter)
        self.draft_cfg = dcfg
        self.spec_plan = plan
        self.drafter = drafter
        self._prefill = jax.jit(self.pinned(make_spec_prefill_fn(self.cfg, drafter), replicated=(0, 1), static=(9,)),
                                donate_argnums=(2, 3), static_argnums=(9,))
        self._decode = jax.jit(self.pinned(make_spec_decode_fn(plan, self.cfg, drafter), replicated=(0, 1)),
                               donate_argnums=(2,))

    def _draft_params(self, drafter, dparams, dcfg) -> dict:
        """{"own": the drafter's runtime params, "target": the target params it shares}.

        The shared leaves are the target's own device arrays: passing them again
        as jit arguments copies nothing."""
        own = None
        if dparams is not None:
            if isinstance(dcfg, ModelConfig):
                if dcfg.vocab_size != self.cfg.vocab_size:
                    raise RequestError(
                        f"draft vocabulary {dcfg.vocab_size} differs from the target's {self.cfg.vocab_size}: "
                        "the draft model must share the target's tokenizer")
            own = drafter.prepare_params(dparams, native=self.native_kernels, unstack=self._unstack)
            if isinstance(dcfg, ModelConfig):
                own = shd.shard_params(own, dcfg, self.mesh)
            elif self.mesh is not None:
                own = shd.replicate(own, self.mesh)
        return {"own": own, "target": {k: self.params[k] for k in drafter.shares_target}}

    # ---- mesh --------------------------------------------------------------------

    def _pad_for_mesh(self, params, cfg: ModelConfig, what: str):
        """Zero-pad heads / MLP columns so the mesh's TP size divides them (exact; `models.padding`).

        Reported on stderr at start-up, since padding costs memory and FLOPs."""
        from jaxspec.models.padding import padded_config, pad_params

        if self.mesh is None:
            return params, cfg, None
        padded, info = padded_config(cfg, self.mesh.shape["model"])
        if not info.none:
            if params is not None and "head" in params:
                raise shd.MeshError(f"{what}: padding heads for tensor-parallel size {info.tp} needs the loaded "
                                    "(Hugging Face) params layout, not runtime params (prepare_params)")
            params = pad_params(params, cfg, padded) if params is not None else None
            if self.progress:
                print(f"jaxspec: {info.summary(what)}", file=sys.stderr)
        shd.validate_for_model(self.mesh, padded, what)
        return params, padded, info

    def pinned(self, fn, replicated: tuple[int, ...] = (), static: tuple[int, ...] = ()):
        """`fn` with its output state pinned to the mesh layout (identity without a mesh).

        With split pages `fn` also runs per data shard; `replicated` / `static` name
        its params and Python-value positional args (`sharding.per_data_shard`)."""
        if self.mesh is None:
            return fn
        if self.split_pages:
            fn = shd.per_data_shard(fn, self.mesh, replicated, static)
        return lambda *args: shd.constrain_state(fn(*args), self.mesh, self.split_pages)

    def constrain_cache(self, cache: KVCache) -> KVCache:
        """For jitted code that returns a donated cache: same sharding out as in."""
        return shd.constrain_cache(cache, self.mesh, self.split_pages)

    def mesh_context(self):
        """Trace/lower jitted code under this, so kernels run per shard on the mesh."""
        return shd.mesh_context(self.mesh)

    @property
    def reserve_tokens(self) -> int:
        """Cache slots a sequence needs beyond prompt + max_new: the verify tree
        and the drafter's own scratch (`drafter.scratch_tokens`)."""
        return self._reserve if self.spec_plan else 0

    # ---- buckets and compilation -------------------------------------------------

    def batch_bucket(self, n: int) -> int:
        b = bucket_for(min(n, self.ecfg.max_batch_size), self.ecfg.batch_buckets, "batch size")
        return -(-b // self.num_shards) * self.num_shards  # split pages: every data shard gets whole rows

    def buckets_for(self, batch: int, prompt_len: int, total_len: int) -> tuple[int, int, int]:
        if total_len > self.max_context:
            raise RequestError(
                f"prompt of {prompt_len} tokens + max_new_tokens exceeds the context of "
                f"{self.max_context} tokens"
            )
        lb = bucket_for(prompt_len, self.ecfg.length_buckets, "prompt length")
        ctx = bucket_for(max(total_len, lb), self.ecfg.length_buckets, "context")
        return self.batch_bucket(batch), lb, ctx

    def _abstract_inputs(self, b: int, lb: int, ctx: int):
        maxp = -(-ctx // self.page_size)
        i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
        sampling = DeviceSampling.abstract(b)
        # The shardings `shard_batch` gives the real inputs in `_run_batch`.
        return shd.abstract_state((i32(b, lb), i32(b), i32(b, maxp), sampling), self.mesh, self.split_pages)

    def compile(self, buckets: Sequence[tuple[int, int, int]]) -> None:
        """AOT-compile prefill and decode for each (batch, prompt_len, context) bucket."""
        from tqdm.auto import tqdm

        kinds = (("prefill", "decode"), ("plain_prefill", "plain_decode")) if self.adaptive else (("prefill", "decode"),)
        todo = []
        for b, lb, ctx in buckets:
            for pre, dec in kinds:
                todo += [k for k in ((pre, b, lb, ctx), (dec, b, ctx)) if k not in self._compiled]
        todo = list(dict.fromkeys(todo))
        for key in tqdm(todo, desc="compiling buckets", disable=not self.progress or not todo):
            b, ctx = key[1], key[-1]
            # Decode's inputs are prefill's outputs: prefill's input signature keys both.
            plain = key[0].startswith("plain_")
            args = self._prefill_args(*self._abstract_inputs(b, key[2] if key[0].endswith("prefill") else 1, ctx),
                                      plain=plain)
            self._compiled[key] = aot.compile_cached((key, self.aot_parts(), aot.abstract_signature(args)),
                                                     lambda key=key: self.lowered(key), self.before_load)
        for b, lb, ctx in buckets if self.adaptive is not None else ():  # the policy's costs, before generating
            if not self.adaptive.calibrated((b, ctx)):
                self.adaptive.calibrate((b, ctx), self._calibrate((b, lb, ctx)))

    def aot_parts(self) -> tuple:
        """What shapes this engine's programs besides the source and the inputs (`aot` keys)."""
        return (repr(self.cfg), repr(self.ecfg), repr(self.spec_plan), repr(self.drafter), aot.code_of(self.drafter),
                self.native_kernels, repr(self.mesh), self.split_pages)

    def before_load(self) -> None:
        """Register the native kernels' FFI targets a stored executable calls (a trace would)."""
        if self.native_kernels:
            from jaxspec.native.build import ensure_registered

            ensure_registered()

    def lowered(self, key: tuple):
        with self.mesh_context():  # shard_map'd kernels lower against the mesh in context
            return self.trace(key).lower()

    def trace(self, key: tuple) -> jax.stages.Traced:
        """The traced executable of a bucket key: ("prefill", batch, prompt_len, context) or
        ("decode", batch, context). `.lower(lowering_platforms=...)` lowers it for another
        platform (`jaxspec.bench.lower`)."""
        plain = key[0].startswith("plain_")
        prefill, decode = self._jits(plain)
        with self.mesh_context():
            if key[0].endswith("prefill"):
                _, b, lb, ctx = key
                return prefill.trace(*self._prefill_args(*self._abstract_inputs(b, lb, ctx), plain=plain), ctx)
            _, b, ctx = key
            state = jax.eval_shape(
                lambda *a: prefill(*a, ctx), *self._prefill_args(*self._abstract_inputs(b, 1, ctx), plain=plain)
            )
            # Decode's inputs are exactly prefill's (pinned) outputs.
            return decode.trace(*self._decode_args(shd.abstract_state(state, self.mesh, self.split_pages),
                                                   plain=plain))

    def _jits(self, plain: bool) -> tuple:
        """(prefill, decode) jitted: the engine's own, or plain decoding beside speculation (adaptive)."""
        return self._plain if plain and self.spec_plan is not None else (self._prefill, self._decode)

    def _prefill_args(self, tokens, lens, page_table, sampling, plain: bool = False) -> tuple:
        if self.spec_plan is None or plain:
            return (self.params, self.cache, tokens, lens, page_table, sampling)
        return (self.params, self.draft_params, self.cache, self.draft_cache, self.corpus, tokens, lens, page_table,
                sampling)

    def _decode_args(self, state, plain: bool = False) -> tuple:
        if self.spec_plan is None or plain:
            return (self.params, state)
        return (self.params, self.draft_params, state)

    # ---- generation --------------------------------------------------------------

    def validate(self, req: Request) -> None:
        if not req.prompt_ids:
            raise RequestError("empty prompt: at least one prompt token is required")
        bad = [t for t in req.prompt_ids if not 0 <= int(t) < self.cfg.vocab_size]
        if bad:
            raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.cfg.vocab_size})")
        if req.max_new_tokens < 1:
            raise RequestError(f"max_new_tokens must be >= 1, got {req.max_new_tokens}")
        if len(req.prompt_ids) + req.max_new_tokens + self.reserve_tokens > self.max_context:
            raise RequestError(
                f"prompt of {len(req.prompt_ids)} tokens + max_new_tokens {req.max_new_tokens} "
                f"(+{self.reserve_tokens} draft-tree slots) exceeds the context of {self.max_context} tokens"
            )
        if len(req.stop_token_ids) > MAX_STOP_IDS:
            raise RequestError(f"at most {MAX_STOP_IDS} stop token ids are supported")
        if self.spec_plan is not None:
            from jaxspec.speculative.algorithm import check_request_sampling

            try:
                check_request_sampling(self.spec_plan.verify, req.temperature)
            except ValueError as e:
                raise RequestError(str(e)) from None

    def plan(self, requests: Sequence[Request]) -> list[tuple[list[int], tuple[int, int, int]]]:
        """Split requests into batches and choose each batch's bucket."""
        for r in requests:
            self.validate(r)
        step = self.ecfg.max_batch_size
        plans = []
        for start in range(0, len(requests), step):
            idx = list(range(start, min(start + step, len(requests))))
            lp = max(len(requests[i].prompt_ids) for i in idx)
            total = max(len(requests[i].prompt_ids) + requests[i].max_new_tokens for i in idx) + self.reserve_tokens
            plans.append((idx, self.buckets_for(len(idx), lp, total)))
        return plans

    def generate(self, requests: Sequence[Request]) -> list[Result]:
        plans = self.plan(requests)
        self.compile(sorted({bk for _, bk in plans}))
        results: list[Result | None] = [None] * len(requests)
        timing = {"prefill_s": 0.0, "decode_s": 0.0, "new_tokens": 0}
        for idx, bucket in plans:
            batch = [requests[i] for i in idx]
            plain = False
            if self.adaptive is not None:  # 1. the policy picks the program for this bucket (calibrated by compile)
                key = (bucket[0], bucket[2])
                plain = self.adaptive.choose(key) == 0
            for i, res in zip(idx, self._run_batch(batch, bucket, timing, plain=plain)):
                results[i] = res
            if self.adaptive is not None:  # 2. what it cost and what was accepted
                seconds, iters = self._last_call
                accept = [n for i in idx for n in (results[i].accept_lengths or [])]
                self.adaptive.observe(0 if plain else self.adaptive.depth, key, accept,
                                      seconds / iters if iters else None)
        self.last_timing = timing
        return results  # type: ignore[return-value]

    def _calibrate(self, bucket) -> dict[int, float]:
        """Seconds per loop iteration of plain decoding and of speculation in `bucket`: a dummy batch
        of 16 new tokens per row through each compiled program, twice, the second run kept."""
        b, lb, ctx = bucket
        new = max(2, min(16, ctx - 8 - self.reserve_tokens))
        dummy = [Request([1] * 8, max_new_tokens=new)] * b
        out = {}
        for _ in range(2):  # the first call of a fresh executable pays set-up costs
            for plain in (True, False):
                self._run_batch(dummy, bucket, {"prefill_s": 0.0, "decode_s": 0.0, "new_tokens": 0}, plain=plain)
                seconds, iters = self._last_call
                out[0 if plain else self.adaptive.depth] = seconds / max(iters, 1)
        return out

    def profile_phases(self, requests: Sequence[Request]) -> dict:
        """Speculative only: rerun the first batch with draft / verify / commit
        jitted apart and timed on the host (the fused loop has no per-phase
        clock). Same tokens; one host round trip per iteration, so the total is
        a little above the fused loop's. Returns PhaseTimer.to_dict()."""
        from jaxspec.speculative.loop import make_phase_fns
        from jaxspec.speculative.metrics import PhaseTimer

        if self.spec_plan is None:
            raise RequestError("profile_phases needs speculative decoding (spec.algorithm != none)")
        if self.split_pages:  # the phases are jitted apart, not per data shard
            raise RequestError("profile_phases needs one page pool: build the Engine with split_pages=False")
        idx, bucket = self.plan(requests)[0]
        draft, verify, commit, observe = make_phase_fns(self.spec_plan, self.cfg, self.drafter)
        timer = PhaseTimer()

        def decode(params, draft_params, s):
            first = True  # the first iteration compiles the phases: not timed
            while not bool(jax.device_get(jnp.all(s.done))):
                timed = (lambda name: timer.phase(name)) if not first else (lambda name: contextlib.nullcontext())
                with timed("draft"):
                    t, p, q, d = jax.block_until_ready(draft(draft_params, s))
                with timed("verify"):
                    cache, result, feats = jax.block_until_ready(verify(params, s, t, p, q))
                with timed("other"):
                    new = jax.block_until_ready(commit(s, cache, d, t, result, p))
                # The draft-extend is drafting work: it counts as draft time.
                with timed("draft"):
                    s = jax.block_until_ready(observe(draft_params, s, new, t, result, feats))
                first = False
            return s

        with self.mesh_context():  # the phase functions trace on their first call
            self._run_batch([requests[i] for i in idx], bucket, {"prefill_s": 0.0, "decode_s": 0.0, "new_tokens": 0},
                            decode=decode)
        return timer.to_dict()

    def _run_batch(self, reqs: list[Request], bucket, timing, decode=None, plain: bool = False) -> list[Result]:
        b, lb, ctx = bucket
        maxp = -(-ctx // self.page_size)
        tokens = np.zeros((b, lb), np.int32)
        lens = np.zeros((b,), np.int32)
        page_table = np.zeros((b, maxp), np.int32)
        seq_ids = [object() for _ in reqs]
        try:
            # 1. Pages for the whole budget up front: the loop never needs the host.
            rows_per_shard = b // self.num_shards
            for i, (r, sid) in enumerate(zip(reqs, seq_ids)):
                need = len(r.prompt_ids) + r.max_new_tokens + self.reserve_tokens
                if self.split_pages:  # row i runs on data shard i // rows_per_shard: pages from its pool
                    self.allocator.allocate(sid, need, i // rows_per_shard)
                else:
                    self.allocator.allocate(sid, need)
                page_table[i] = self.allocator.page_table_row(sid, maxp)
                tokens[i, : len(r.prompt_ids)] = r.prompt_ids
                lens[i] = len(r.prompt_ids)
            sampling = DeviceSampling.pack([r.row() for r in reqs], b)
            # 2. Prefill, then the on-device decode loop.
            t0 = time.perf_counter()
            pre = "plain_" if plain else ""
            state = self._compiled[(pre + "prefill", b, lb, ctx)](
                *self._prefill_args(*shd.shard_batch((tokens, lens, page_table, sampling), self.mesh), plain=plain)
            )
            jax.block_until_ready(state.done)
            t1 = time.perf_counter()
            state = (decode or self._compiled[(pre + "decode", b, ctx)])(*self._decode_args(state, plain=plain))
            outputs, accept_lens = self._outputs(state, lens, plain)
            t2 = time.perf_counter()
            # Loop iterations run: verify steps, or plain steps after prefill's first token.
            iters = (max(map(len, accept_lens), default=0) if accept_lens is not None
                     else max(map(len, outputs), default=1) - 1)
            self._last_call = (t2 - t1, iters)
            self.cache = state.cache
            if self.draft_cache is not None and not plain:
                from jaxspec.engine.core import draft_cache_of

                self.draft_cache = draft_cache_of(state.draft)
        finally:
            for sid in seq_ids:
                self.allocator.free(sid)
            self._restore_donated_caches()
        timing["prefill_s"] += t1 - t0
        timing["decode_s"] += t2 - t1
        results = []
        for i, r in enumerate(reqs):
            out = outputs[i]
            timing["new_tokens"] += len(out)
            stopped = bool(out) and out[-1] in r.stop_token_ids
            results.append(Result(list(r.prompt_ids), out, "stop" if stopped else "length",
                                  accept_lens[i] if accept_lens else None))
        return results

    def _restore_donated_caches(self) -> None:
        """After a failed device call the donated caches are gone; start fresh ones
        (their contents are dead anyway: every page was just freed)."""
        for name in ("cache", "draft_cache"):
            c = getattr(self, name)
            if c is not None and c.k.is_deleted():
                setattr(self, name, shd.zeros_cache(c.k.shape, c.k.dtype, self.mesh, self.split_pages))

    def _outputs(self, state, prompt_lens, plain: bool = False) -> tuple[list[list[int]], list[list[int]] | None]:
        """Generated tokens per row, and (speculative) committed tokens per verify step."""
        if self.spec_plan is None or plain:
            output, num_gen = shd.to_host((state.output, state.num_generated))
            return [output[i, : num_gen[i]].tolist() for i in range(len(num_gen))], None
        history, hist_len, acc, nv = shd.to_host((state.history, state.hist_len, state.accept_lens, state.num_verify))
        outs = [history[i, prompt_lens[i] : hist_len[i]].tolist() for i in range(len(hist_len))]
        return outs, [acc[i, : nv[i]].tolist() for i in range(len(nv))]
