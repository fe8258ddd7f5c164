"""The one executor: weights, paged caches, drafter state and the compiled programs per bucket.

The offline engine (`jaxspec.engine.Engine`, under the CLI and `jaxspec.LLM`)
and the server's scheduler both drive a `ModelRunner`; nothing else touches
its caches. Plain decoding is its k = 0 plan (`drafters.plain.PlainDrafter`
under `spec.algorithm = "none"`), so there is one prefill, one loop and one
sampler whether speculation is on or off.

The caller owns every sequence's tokens on the host and hands each call the
small per-call arrays (page table, history, lengths, sampling), so a sequence
can join or leave the batch between any two calls and the batch can move
between buckets freely. On device across calls live the paged caches and the
drafter's per-sequence state (a feature drafter's pending target feature, a
draft model's cached length): a slot store with one row per batch slot
(`RowInput.slot`, stable while a sequence is active), gathered into the
call's rows and scattered back inside the same executable. All of them are
donated to every call.

Pages over "data" (`split_pages`, under a mesh with data > 1): each data
shard has its own page pool and its own slice of the slot store, and both
executables run once per data shard (`mesh.per_data_shard`). A batch of b
rows gives shard d rows d*(b/data) .. (d+1)*(b/data)-1 (`place`); a
sequence's page-table row holds its shard's local page ids and its slot is a
row of that shard's store. A `None` row is padding.

Two executables per bucket:

* `("prefill", b, chunk, ctx)`: one chunk of up to `chunk` prompt tokens per
  row at cache slot `q_start` (target and drafter), and the token sampled at
  the chunk's end (what a chunk that finishes the prompt emits), attending
  over a page table `ctx` tokens wide (the context bucket of the call's
  furthest chunk end, `prefill_context`);
* `("decode", k, b, ctx)`: draft -> verify -> commit iterations inside one
  `lax.while_loop` (the `SpecState` carry of `jaxspec.speculative.loop`) with
  draft length k, for at most `steps_per_call` iterations (the server, so
  requests can join between calls) or until every row is done (None: the
  offline engine's whole generation as one program).

A batch holding a structured-output row runs the "+grammar" build of either ("prefill+grammar",
...), whose verify fetches grammar masks from the host each iteration (`speculative.grammar`):
compiled on first use and never stored (an executable with a host callback cannot be).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import sys
import threading
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import aot
from jaxspec import mesh as shd
from jaxspec.cache.paged import ShardedPageAllocator, check_cache_fits
from jaxspec.cache.prefix import PrefixCachingAllocator
from jaxspec.config import EngineSection
from jaxspec.engine.core import (decode_adapter, make_chunk_prefill_fn, prefill_adapter, row_state, spec_state,
                                 stateless, with_slots)
from jaxspec.engine import host_io, mappings
from jaxspec.engine.host_io import GRAMMAR
from jaxspec.engine.device_sampling import DeviceSampling
from jaxspec.engine.types import RequestError, RowInput, bucket_for
from jaxspec.models.config import ModelConfig
from jaxspec.models.llama import prepare_params
from jaxspec.native.build import use_native_kernels
from jaxspec.speculative.drafters import algorithm_info, build_drafter, registration, reserve_tokens
from jaxspec.speculative.drafters.plain import PlainDrafter
from jaxspec.speculative.loop import SpecPlan, SpecState, make_spec_decode_fn


def plan_for_steps(base: SpecPlan, k: int) -> SpecPlan:
    """The plan drafting k tokens per iteration: the configured shape at its own depth, else a
    chain of k (k = 0: nothing drafted)."""
    if k == base.max_depth:
        return base
    return dataclasses.replace(base, num_draft_tokens=k + 1, topk=1, num_steps=max(k, 1))


class ModelRunner:
    """Params, caches, allocator and slot store of one model, and its compiled programs.

    `params` / `draft` params as loaded (Hugging Face layout); the runner keeps the runtime
    layout (`prepare_params`). `spec`: a SpecSection (None or algorithm "none": plain
    decoding); `draft`: the drafter's (params, config); `ngram_corpus`: token ids [K] the
    n-gram drafter also matches against. `mesh`: a ("data", "model") mesh to shard over;
    heads and MLP columns its TP size does not divide are zero-padded (exact), so `cfg` may
    have more heads than `model_cfg`. `split_pages`: with a "data" axis > 1, a page pool and
    store slice per data shard. `steps_candidates`: the draft lengths k compiled (default:
    the configured shape's depth); `adaptive_lengths` (the offline policy's candidates): adds
    k = 0 and these shorter chains; `steps_per_call`: iterations per decode call (None: until
    every row is done)."""

    def __init__(self, params: dict, cfg: ModelConfig, engine_cfg: EngineSection, *, spec=None,
                 draft: tuple | None = None, ngram_corpus=None, mesh: jax.sharding.Mesh | None = None,
                 split_pages: bool = True, benchmark: bool = False, progress: bool = True,
                 steps_candidates: Sequence[int] | None = None, steps_per_call: int | None = None,
                 context_buckets: Sequence[int] | None = None, prefill_chunk: int | None = None,
                 max_prefill_batch: int | None = None, prefill_tokens: int | None = None,
                 prefill_piece: int = 0, adaptive_lengths: Sequence[int] | None = None):
        # 1. Mesh and weights.
        self.mesh = mesh
        self.split_pages = bool(split_pages and mesh is not None and mesh.shape["data"] > 1)
        self.num_shards = mesh.shape["data"] if self.split_pages else 1
        self.progress = progress
        self.model_cfg = cfg  # as loaded; self.cfg is what runs (heads padded for the mesh)
        params, cfg, _ = shd.pad_for_mesh(params, cfg, mesh, "model", progress)
        self._unstack = None if engine_cfg.layer_loop == "auto" else engine_cfg.layer_loop == "unrolled"
        self.native_kernels = use_native_kernels(engine_cfg.cpu_kernels, params["embed"].dtype, mesh)
        runtime = prepare_params(params, cfg, unstack=self._unstack, native=self.native_kernels,
                                 quantize=engine_cfg.quantize)
        self.params = shd.shard_params(runtime, cfg, mesh)
        if engine_cfg.quantize != "none" and progress:  # what runs, said once at start-up
            kinds: dict[str, list[str]] = {}
            for key, kind in params.get("gguf", {}).get("types", {}).items():
                kinds.setdefault(kind, []).append("LM head" if key in ("embed", "lm_head") else key)
            what = ("the GGUF's own blocks (" + ", ".join(f"{k} {'/'.join(v)}" for k, v in kinds.items()) + ")"
                    if engine_cfg.quantize == "gguf" else "int8 (weight-only, a float32 scale per output column)")
            print(f"jaxspec: target weights {what}, {'native CPU kernels' if self.native_kernels else 'XLA dot'}: "
                  f"{sum(x.nbytes for x in jax.tree.leaves(runtime)) / 2**20:.0f} MiB", file=sys.stderr)
        self.cfg, self.ecfg = cfg, engine_cfg
        self.max_context = min(engine_cfg.max_context, cfg.max_position_embeddings)
        self.page_size = engine_cfg.page_size
        # 2. The plan and a drafter per draft length.
        self.speculative = spec is not None and algorithm_info(spec.algorithm).speculative
        self.corpus = None
        self.base_plan = self._plan(spec, benchmark, ngram_corpus)
        depth = self.base_plan.max_depth
        candidates = (depth,) if steps_candidates is None else tuple(steps_candidates)
        if adaptive_lengths is not None and self.speculative:
            if any(k > depth for k in adaptive_lengths):
                raise RequestError(f"spec.adaptive_lengths {tuple(adaptive_lengths)}: the policy's shorter chains "
                                   f"must be at most the configured shape's depth, {depth}")
            candidates += (0, *adaptive_lengths)
        self.candidates = tuple(sorted(set(candidates)))
        self.plans = {k: plan_for_steps(self.base_plan, k) for k in self.candidates}
        self.max_depth = max(p.max_depth for p in self.plans.values())
        self.steps_per_call = steps_per_call
        dparams, dcfg = draft if draft is not None else (None, None)
        if isinstance(dcfg, ModelConfig):
            dparams, dcfg, _ = shd.pad_for_mesh(dparams, dcfg, self.mesh, "draft model", self.progress)
        self.draft_cfg = dcfg
        self.drafters = {k: self._build_drafter(plan, k) for k, plan in self.plans.items()}
        # Every plan's drafter keeps the main drafter's state layout (they differ in draft length
        # only), so one store and one prefill serve all of them.
        self.drafter = self.drafters[self.candidates[-1]]
        # Plain decoding writes only committed tokens' K/V: no slots past prompt + max_new.
        self.reserve = (max(reserve_tokens(self.plans[k], d) for k, d in self.drafters.items())
                        if self.speculative else 0)
        self.draft_params = self._draft_params(self.drafter, dparams, dcfg)
        # 3. Caches, pages, buckets.
        self._init_caches(engine_cfg)
        n = self.num_shards  # buckets round up to whole rows per data shard
        up = lambda b: -(-b // n) * n  # noqa: E731
        buckets = [b for b in sorted(engine_cfg.batch_buckets) if b < engine_cfg.max_batch_size]
        self.batch_buckets = tuple(sorted({up(b) for b in buckets + [engine_cfg.max_batch_size]}))
        lengths = sorted(engine_cfg.length_buckets)
        max_prefill_batch = engine_cfg.max_batch_size if max_prefill_batch is None else max_prefill_batch
        self.prefill_batches = tuple(b for b in self.batch_buckets if b <= up(max_prefill_batch)) or (n,)
        # Never wider than the context: a prompt chunk padded past it (max_context 384 under a 512
        # length bucket) would need a context bucket the engine does not have.
        self.prefill_chunk = prefill_chunk or min(bucket_for(self.max_context, lengths, "max_context"),
                                                  self.max_context)
        self.chunk_buckets = tuple(c for c in lengths if c < self.prefill_chunk) + (self.prefill_chunk,)
        # The (rows, chunk) prefill programs: rows x chunk within the token budget (a call's cost, and
        # the decode stall it causes), so more rows only when their chunks are short; one row takes any.
        budget = prefill_tokens or self.prefill_batches[-1] * self.prefill_chunk
        self.prefill_shapes = tuple((b, c) for b in self.prefill_batches for c in self.chunk_buckets
                                    if b == self.prefill_batches[0] or b * c <= budget)
        ctx = [c for c in sorted(context_buckets or lengths) if c < self.max_context] + [self.max_context]
        self.context_buckets = tuple(ctx)
        # Slots per store (split pages: per data shard, shard-local ids); `num_slots` is the spare.
        self.num_slots = self.batch_buckets[-1] // n if self.split_pages else engine_cfg.max_batch_size
        self.store = self._new_store()
        # Packed prefill (`serve/prefill_plan.py`): with no drafter state per sequence (plain decoding,
        # n-gram), a sequence may take several rows of one call, `piece` tokens each, in row buckets
        # up to the token budget; the rows of one call then pad under one piece per sequence.
        stateless = self.store[0] is None and not jax.tree.leaves(self.store[1])
        # Committed tokens whose drafter state may still be behind when a sequence leaves (a draft
        # model catches up at its next step): the prefix cache leaves them out. Without drafter
        # state (plain decoding, n-gram) nothing is behind, and the next turn of a chat hits all
        # of the answer (the multi-turn replay's cache-hit turns prefilled 42 tokens at the median,
        # ~8 of them this lag's).
        self.prefix_lag = 0 if stateless else max(8, self.max_depth + 1)
        self.prefill_piece = min(prefill_piece, self.max_context) if stateless else 0
        if self.prefill_piece:  # at most the tokens a one-row-per-sequence call could take
            most = max(min(budget, self.prefill_batches[-1] * self.prefill_chunk) // self.prefill_piece, 1)
            rows = {r for r in (1, 2, 4, *range(8, most + 1, 4)) if r <= most} or {1}
            self.prefill_batches = tuple(sorted({up(r) for r in rows}))
            self.prefill_shapes = tuple((b, self.prefill_piece) for b in self.prefill_batches)
        # 4. The jitted programs; `pinned`: outputs keep the mesh layout, so each accepts its own outputs.
        self._decode = {k: self._decode_fn(k) for k in self.candidates}
        self._prefill = self._prefill_fn()
        self._compiled: dict[tuple, object] = {}
        self._last_used: collections.OrderedDict[tuple, None] = collections.OrderedDict()  # least recent first
        self.map_budget = mappings.MapBudget()
        self._compile_lock = threading.Lock()
        self.num_compiles = 0
        self.decode_seconds: dict[tuple, float] = {}  # (k, (batch, context)) -> seconds per iteration

    # ---- construction --------------------------------------------------------------

    def _plan(self, spec, benchmark: bool, ngram_corpus) -> SpecPlan:
        """The plan of a loaded (validated) spec; only the benchmark-only mode is a front end's choice."""
        from jaxspec.config import SpecSection
        from jaxspec.speculative.algorithm import check_benchmark_only

        mode = dict(logprobs_mode=self.ecfg.logprobs_mode)
        if not self.speculative:  # plain decoding: the k = 0 plan, any sampling allowed
            self.spec = SpecSection()
            plain = SpecSection(algorithm="none", num_draft_tokens=1, topk=1, num_steps=1)
            return dataclasses.replace(SpecPlan.from_config(plain), **mode)
        self.spec = spec
        check_benchmark_only(spec, benchmark)
        plan = dataclasses.replace(SpecPlan.from_config(spec), **mode)
        if ngram_corpus is not None:
            if "ngram_corpus" not in registration(plan.algorithm).reads:
                raise RequestError(f"an n-gram corpus is read by drafters that read spec.ngram_corpus; "
                                   f"{plan.algorithm} does not")
            self.corpus = shd.shard_batch(np.asarray(ngram_corpus, np.int32).reshape(1, -1), self.mesh)
        return plan

    def _build_drafter(self, plan: SpecPlan, k: int):
        if k == 0 and self.steps_per_call is None:
            # Run to completion: no later call reads this call's drafter state, so k = 0 is plain decoding.
            return PlainDrafter()
        try:
            return build_drafter(plan, self.spec, draft_cfg=self.draft_cfg, target_cfg=self.cfg,
                                 catch_up_width=self.max_depth + 1)
        except ValueError as e:
            raise RequestError(str(e)) from None

    def _draft_params(self, drafter, dparams, dcfg) -> dict:
        """{"own": the drafter's runtime params, "target": the target params it shares}.

        The shared leaves are the target's own device arrays: passing them again
        as jit arguments copies nothing."""
        own = None
        if dparams is not None:
            if isinstance(dcfg, ModelConfig) and dcfg.vocab_size != self.cfg.vocab_size:
                raise RequestError(
                    f"draft vocabulary {dcfg.vocab_size} differs from the target's {self.cfg.vocab_size}: "
                    "the draft model must share the target's tokenizer")
            own = drafter.prepare_params(dparams, native=self.native_kernels, unstack=self._unstack)
            if isinstance(dcfg, ModelConfig):
                own = shd.shard_params(own, dcfg, self.mesh)
            elif self.mesh is not None:
                own = shd.replicate(own, self.mesh)
        return {"own": own, "target": {k: self.params[k] for k in drafter.shares_target}}

    def set_draft_params(self, dparams) -> None:
        """Swap in new weights of the same drafter (a training run's evaluation): same shapes,
        so every compiled program stays valid. Cached prefixes hold the old drafter's state: dropped."""
        self.draft_params = self._draft_params(self.drafter, dparams, self.draft_cfg)
        self.allocator.drop_cached()

    def _init_caches(self, ecfg: EngineSection) -> None:
        cfg, n = self.cfg, self.num_shards
        pages_per_seq = -(-bucket_for(self.max_context, ecfg.length_buckets, "max_context") // self.page_size)
        # One page pool per data shard, each with its own null page.
        per_shard = ecfg.num_pages // n if ecfg.num_pages else -(-ecfg.max_batch_size // n) * pages_per_seq + 1
        num_pages = n * per_shard
        self.dtype = dtype = self.params["embed"].dtype
        self._cache_shapes = {"cache": (cfg.num_layers, num_pages, self.page_size, cfg.num_kv_heads, cfg.head_dim)}
        ccfg = self.drafter.draft_cache_cfg
        if ccfg is not None:
            self._cache_shapes["draft_cache"] = (ccfg.num_layers, num_pages, self.page_size, ccfg.num_kv_heads,
                                                 ccfg.head_dim)
        for name, shape in self._cache_shapes.items():
            check_cache_fits(shape, dtype, self.mesh, "KV cache" if name == "cache" else "draft KV cache")
        self.cache = self._zeros("cache")
        self.draft_cache = self._zeros("draft_cache") if ccfg is not None else None
        # The prefix cache's namespace: what makes K/V and drafter state differ for equal tokens.
        pool = functools.partial(PrefixCachingAllocator, enabled=ecfg.prefix_cache, namespace=repr(
            (cfg, self.draft_cfg, repr(self.drafter), str(dtype), ecfg.quantize, self.page_size)))
        self.allocator = (ShardedPageAllocator(n, per_shard, self.page_size, pool=pool) if self.split_pages
                          else pool(num_pages, self.page_size))

    def _zeros(self, name: str):
        return shd.zeros_cache(self._cache_shapes[name], self.dtype, self.mesh, self.split_pages)

    def _prefill_fn(self, constrained: bool = False):
        chunk = make_chunk_prefill_fn(self.cfg, self.drafter, self.ecfg.logprobs_mode, constrained=constrained)
        return self.pinned(with_slots(prefill_adapter(chunk), self.drafter), replicated=(0, 1))

    def _decode_fn(self, k: int, constrained: bool = False):
        drafter = self.drafters[k]
        plan = dataclasses.replace(self.plans[k], constrained=constrained)
        decode = make_spec_decode_fn(plan, self.cfg, drafter, max_iters=self.steps_per_call)
        if isinstance(drafter, PlainDrafter) and drafter is not self.drafter:
            return self.pinned(stateless(decode), replicated=(0, 1))
        return self.pinned(with_slots(decode_adapter(decode), drafter), replicated=(0, 1))

    def _jit(self, fn, key: tuple):
        """`fn` jitted for one bucket, named after it and this runner's configuration
        ("decode_3_8_512_1f2e3d4c"): XLA:CPU resolves a stored executable's functions by the
        program's name, and two loaded programs of one name ran each other's fusions ("Function
        ... not found"). Caches and store are donated."""

        def program(*args):
            return fn(*args)

        tag = hashlib.sha256(repr(self.aot_parts()).encode()).hexdigest()[:8]
        program.__name__ = program.__qualname__ = "_".join(map(str, key + (tag,)))
        return jax.jit(program, donate_argnums=(2, 4))

    # ---- mesh --------------------------------------------------------------------

    def pinned(self, fn, replicated: tuple[int, ...] = (), static: tuple[int, ...] = ()):
        """`fn` with its output state pinned to the mesh layout (identity without a mesh).

        With split pages `fn` also runs per data shard; `replicated` / `static` name
        its params and Python-value positional args (`mesh.per_data_shard`)."""
        if self.mesh is None:
            return fn
        if self.split_pages:
            fn = shd.per_data_shard(fn, self.mesh, replicated, static)
        return lambda *args: shd.constrain_state(fn(*args), self.mesh, self.split_pages)

    def mesh_context(self):
        """Trace/lower jitted code under this, so kernels run per shard on the mesh."""
        return shd.mesh_context(self.mesh)

    # ---- buckets -----------------------------------------------------------------

    @property
    def max_pages(self) -> int:
        return self.table_width(self.context_buckets[-1])

    def table_width(self, ctx: int) -> int:
        """Page-table columns of a call over a `ctx`-token context bucket (prefill and decode alike)."""
        return -(-ctx // self.page_size)

    def context_bucket(self, num_tokens: int) -> int:
        return bucket_for(num_tokens, self.context_buckets, "context")

    def place(self, shards: Sequence[int], buckets: Sequence[int]) -> list[int | None]:
        """Split pages: the batch layout for items pinned to `shards` (one per item): a list as
        long as the smallest bucket that gives every shard room, holding each batch position's
        item index, or None (a padding row). Shard d's items fill positions d*(b/data) on, in order.
        One pool: the items in order (the bucket pads them)."""
        if not self.split_pages:
            return list(range(len(shards)))
        n, counts = self.num_shards, [0] * self.num_shards
        for d in shards:
            counts[d] += 1
        b = next((x for x in sorted(buckets) if x // n >= max(counts)), None)
        if b is None:
            raise ValueError(f"{max(counts)} rows on one data shard exceed the largest bucket {max(buckets)} / {n}")
        out, used = [None] * b, [0] * n
        for i, d in enumerate(shards):
            out[d * (b // n) + used[d]] = i
            used[d] += 1
        return out

    def prefill_context(self, end: int, chunk: int) -> int:
        """The page-table width of a prefill call whose furthest chunk ends at `end`, in a `chunk` bucket.
        Where the jnp reference runs, it scores the whole table, so a short chunk late in a long context
        pays for what it reads, not for max_context; the GPU and TPU kernels and CPU's blocked prefill
        attention stop at kv_len, but still take the table as an input. At least the chunk's own bucket,
        so `all_keys` holds every key."""
        return self.context_bucket(max(end, chunk))

    def all_keys(self, suffix: str = "") -> list[tuple]:
        """Every bucket's key; suffix GRAMMAR: their constrained builds."""
        keys = [("prefill" + suffix, b, c, ctx) for b, c in self.prefill_shapes for ctx in self.context_buckets
                if ctx >= self.context_bucket(c)]
        keys += [("decode" + suffix, k, b, ctx) for k in self.candidates for b in self.batch_buckets
                 for ctx in self.context_buckets]
        return keys

    # ---- compilation -------------------------------------------------------------

    @functools.cached_property
    def _parts(self) -> tuple:
        # The prefix cache is host-side bookkeeping: both settings run the same programs.
        return (repr(self.cfg), repr(dataclasses.replace(self.ecfg, prefix_cache=True)), repr(self.plans), repr(self.drafters),
                aot.code_of(self.drafter), self.native_kernels, repr(self.mesh), self.split_pages,
                self.steps_per_call, self.max_pages, self.num_slots)

    def aot_parts(self) -> tuple:
        """What shapes these programs besides source and inputs (`aot` keys); computed once per runner."""
        return self._parts

    def before_load(self) -> None:
        """Register the native kernels' FFI targets a stored executable calls (a trace would)."""
        if self.native_kernels:
            from jaxspec.native.build import ensure_registered

            ensure_registered()

    def _new_store(self):
        """(draft cache, per-row drafter state [num_slots + 1, ...]); the last row is the padding rows' spare.
        Split pages: [data * (num_slots + 1), ...], split over "data" (each shard its own rows and spare)."""
        rows = row_state(self.drafter.init_state(self.draft_cache, (self.num_slots + 1) * self.num_shards))
        return (self.draft_cache, shd.shard_batch(rows, self.mesh))

    def accept_width(self, ctx: int) -> int:
        """Columns of accept_lens: a call's iterations (each commits at least one token)."""
        return self.steps_per_call or ctx

    def _state_struct(self, b: int, ctx: int) -> SpecState:
        """The decode call's state without the drafter's (that comes from the store)."""
        i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
        return spec_state(
            cache=self.cache, draft=None, page_table=i32(b, self.table_width(ctx)), history=i32(b, ctx),
            hist_len=i32(b), prompt_lens=i32(b), done=jax.ShapeDtypeStruct((b,), jnp.bool_),
            sampling=DeviceSampling.abstract(b), accept_width=self.accept_width(ctx), corpus=self.corpus,
            iter_budget=i32(b) if self.steps_per_call else None, zeros=jax.ShapeDtypeStruct,
        )

    def compile(self, keys: Sequence[tuple], progress: bool = False) -> None:
        from tqdm.auto import tqdm

        todo = [k for k in dict.fromkeys(keys) if k not in self._compiled]
        for i, key in enumerate(tqdm(todo, desc="compiling buckets", disable=not progress or not todo)):
            with self._compile_lock:  # the server's background warm-up compiles beside the scheduler
                if key not in self._compiled:
                    self._make_room(key, len(todo) - i)
                    before = mappings.count()
                    self._compile_one(key)
                    self.map_budget.observe(before, mappings.count())
                    self._last_used[key] = None

    def _make_room(self, key: tuple, pending: int) -> None:
        """Before compiling `key` (`mappings.make_room`): a structured-output build may evict the least
        recently used builds; a bucket needs room for itself, the `pending` ones after it and one build,
        which a serving runner refuses without (at start-up, where all its buckets compile) and an
        offline one makes by evicting its least recently used programs (compiled again when needed)."""
        grammar = key[0].endswith(GRAMMAR)
        offline = self.steps_per_call is None and not grammar
        mappings.make_room(self.map_budget, self._last_used, self._compiled, 1 if grammar else pending + 1,
                           lambda old: old[0].endswith(GRAMMAR) or offline)

    def has_room(self, n: int) -> bool:
        """Whether `n` more programs fit without evicting any (the structured-output warm-up)."""
        return self.map_budget.room_for(n)

    def _compile_one(self, key: tuple) -> None:
        fn, args = self._trace_args(key)
        if key[0].endswith(GRAMMAR):  # a host callback lives in it: no stored executable can hold one
            self._compiled[key] = self._lower(fn, args).compile()
        else:
            self._compiled[key] = aot.compile_cached(("runner", key, self.aot_parts(), aot.abstract_signature(args)),
                                                     lambda: self._lower(fn, args), self.before_load)
        self.num_compiles += 1

    def _lower(self, fn, args):
        with self.mesh_context():  # shard_map'd kernels lower against the mesh in context
            return fn.trace(*args).lower()

    def trace(self, key: tuple) -> jax.stages.Traced:
        """The traced executable of a key of `all_keys`; `.lower(lowering_platforms=...)`
        lowers it for another platform (`jaxspec.bench.lower`)."""
        fn, args = self._trace_args(key)
        with self.mesh_context():
            return fn.trace(*args)

    def _trace_args(self, key: tuple) -> tuple:
        """(the jitted function, its abstract arguments) of a bucket key."""
        constrained = key[0].endswith(GRAMMAR)
        with self.mesh_context():
            if key[0].startswith("prefill"):
                _, b, c, ctx = key
                i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
                batch = shd.abstract_state((i32(b), i32(b, c), i32(b), i32(b), i32(b, self.table_width(ctx)),
                                            DeviceSampling.abstract(b), i32(b, self.max_context), i32(b),
                                            jax.ShapeDtypeStruct((b,), jnp.bool_)),
                                           self.mesh, self.split_pages)
                fn = self._prefill_fn(True) if constrained else self._prefill
                return self._jit(fn, key), (self.params, self.draft_params, self.store, batch[0], self.cache,
                                            *batch[1:])
            _, k, b, ctx = key
            slots, state = shd.abstract_state((jax.ShapeDtypeStruct((b,), jnp.int32), self._state_struct(b, ctx)),
                                              self.mesh, self.split_pages)
            fn = self._decode_fn(k, True) if constrained else self._decode[k]
            return self._jit(fn, key), (self.params, self.draft_params, self.store, slots, state)

    def reset_caches(self) -> None:
        """Fresh zeroed caches after a failed call (whose outputs may be poisoned); no cached prefix
        survives them."""
        self.allocator.drop_cached()
        self.cache = self._zeros("cache")
        if self.draft_cache is not None:
            self.draft_cache = self._zeros("draft_cache")
        self.store = self._new_store()

    def _restore(self) -> None:
        """After a failed call the donated buffers are gone: fresh caches and store (their
        contents are dead anyway: the caller frees the call's pages)."""
        lost_store = any(x.is_deleted() for x in jax.tree.leaves(self.store))
        lost_cache = self.cache.k.is_deleted()
        lost_draft = self.draft_cache is not None and self.draft_cache.k.is_deleted()
        if lost_cache:
            self.cache = self._zeros("cache")
        if lost_draft:
            self.draft_cache = self._zeros("draft_cache")
        if lost_store:
            self.store = self._new_store()
        if lost_cache or lost_draft:  # the cached prefixes' K/V went with them
            self.allocator.drop_cached()

    # ---- calls -------------------------------------------------------------------

    # Each call is split in two: the host inputs of a bucket (`host_io`: plain numpy,
    # so a multi-host leader can broadcast them) and running that bucket on them
    # (what every process does, `jaxspec.serve.multihost`).

    def _check_shard(self, i: int, b: int, row: RowInput) -> None:
        if self.split_pages and row.shard is not None and row.shard != i // (b // self.num_shards):
            raise ValueError(f"batch row {i} of {b} runs on data shard {i // (b // self.num_shards)}, but its "
                             f"sequence is pinned to shard {row.shard}")

    def prefill_inputs(self, chunks: Sequence[tuple[RowInput, int, int]]) -> tuple[tuple, dict]:
        b = bucket_for(len(chunks), self.prefill_batches, "prefill batch")
        longest = max(ch[2] for ch in chunks if ch is not None)
        if self.prefill_piece and longest > self.prefill_piece:
            raise ValueError(f"a packed prefill row takes at most {self.prefill_piece} tokens (serve.prefill_piece), "
                             f"got a chunk of {longest}")
        c = self.prefill_piece or bucket_for(longest, self.chunk_buckets, "prefill chunk")
        ctx = self.prefill_context(max(ch[1] + ch[2] for ch in chunks if ch is not None), c)
        return host_io.pack_prefill(chunks, b=b, c=c, ctx=ctx, width=self.table_width(ctx), num_slots=self.num_slots,
                                    max_context=self.max_context, check=self._check_shard)

    def run_prefill(self, key: tuple, inputs: dict) -> tuple[np.ndarray, tuple | None]:
        """(the token sampled at each row's chunk end [b], its logprob entries when a row asked, or None)."""
        self.compile([key])
        self._last_used.move_to_end(key)
        try:
            x = shd.shard_batch(inputs, self.mesh)
            self.store, self.cache, first, lp = self._compiled[key](
                self.params, self.draft_params, self.store, x["slots"], self.cache, x["tokens"], x["q_start"],
                x["lens"], x["table"], x["sampling"], x["history"], x["prompt_lens"], x["resume"])
            self.draft_cache = self.store[0]
            return shd.to_host((first, lp if inputs["sampling"].logprobs.any() else None))
        finally:
            self._restore()

    def prefill(self, chunks: Sequence[tuple[RowInput, int, int]]) -> list[int]:
        """chunks: (row, q_start, chunk_len) each, or None (padding); returns the token sampled at each
        chunk's end (a padding row's is meaningless)."""
        return self.prefill_scored(chunks)[0]

    def prefill_scored(self, chunks: Sequence[tuple[RowInput, int, int]]):
        """`prefill`'s tokens, and each one's TokenScores (one token; None unless its row asked)."""
        key, inputs = self.prefill_inputs(chunks)
        return self.prefill_outputs(chunks, self.run_prefill(key, inputs))

    prefill_outputs = staticmethod(host_io.prefill_outputs)

    def decode_inputs(self, k: int, rows: Sequence[RowInput], ctx: int, iters: int | None = None) -> tuple[tuple, dict]:
        """(key, host inputs) of a decode call; `iters`: at most this many iterations (None or more
        than `steps_per_call`: steps_per_call), a runtime input of the same program."""
        b = bucket_for(len(rows), self.batch_buckets, "batch size")
        key, inputs = host_io.pack_decode(k, rows, b=b, ctx=ctx, width=self.table_width(ctx),
                                          num_slots=self.num_slots, check=self._check_shard)
        if self.steps_per_call:
            if iters is not None and iters < 1:
                raise ValueError(f"a decode call runs at least one iteration, not {iters}")
            inputs["iter_budget"] = np.full((b,), min(iters or self.steps_per_call, self.steps_per_call), np.int32)
        return key, inputs

    def _state(self, x: dict, ctx: int) -> SpecState:
        """The loop carry of a call from its (device) inputs, drafter state aside."""
        return spec_state(
            cache=self.cache, draft=None, page_table=x["table"], history=x["history"], hist_len=x["hist_len"],
            prompt_lens=x["prompt_lens"], done=x["done"], sampling=x["sampling"], accept_width=self.accept_width(ctx),
            corpus=self.corpus, iter_budget=x.get("iter_budget"),
            zeros=lambda shape, dtype: shd.shard_batch(np.zeros(shape, dtype), self.mesh),
        )

    def run_decode(self, key: tuple, inputs: dict) -> tuple[np.ndarray, ...]:
        """`fetch` of the state after the call."""
        state = self._state(shd.shard_batch(inputs, self.mesh), key[-1])
        self.compile([key])
        self._last_used.move_to_end(key)
        try:
            self.store, state = self._compiled[key](self.params, self.draft_params, self.store,
                                                    shd.shard_batch(inputs["slots"], self.mesh), state)
            self.cache, self.draft_cache = state.cache, self.store[0]
            return self.fetch(state, inputs["sampling"].logprobs.any())
        finally:
            self._restore()

    @staticmethod
    def fetch(state: SpecState, logprobs: bool) -> tuple:
        """(history, hist_len, done, accept_lens, num_verify, the logprob entries or None) on the host;
        the entries only when a row asked (`logprobs`): a call without them moves no [B, W, 20] buffers."""
        entries = state.logprobs.entries() if logprobs and state.logprobs is not None else None
        return shd.to_host((state.history, state.hist_len, state.done, state.accept_lens, state.num_verify, entries))

    def decode(self, k: int, rows: Sequence[RowInput], ctx: int, iters: int | None = None):
        """Up to steps_per_call iterations (or `iters`, when fewer) with draft length k; returns ([RowOutput |
        None per row], iterations run); a None row (padding) gets None."""
        key, inputs = self.decode_inputs(k, rows, ctx, iters)
        return self.decode_outputs(rows, self.run_decode(key, inputs))

    decode_outputs = staticmethod(host_io.decode_outputs)
