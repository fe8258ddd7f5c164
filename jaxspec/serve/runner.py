"""Device side of the server: chunked prefill and bounded decode calls, AOT-compiled per bucket.

The scheduler owns every sequence's tokens on the host and rebuilds the small
per-call arrays (page table, history, lengths, sampling) from them, so a
sequence can join or leave the batch between any two device calls and the
batch can move between buckets freely. On device across calls live the paged
caches and the drafter's per-sequence state (a feature drafter's pending
target feature, a draft model's cached length): a slot store with one row per
batch slot (`RowInput.slot`, assigned by the scheduler for a sequence's whole
stay), gathered into the call's rows and scattered back inside the same
executable. A recomputed (preempted) sequence is prefilled again, which
rewrites its slot, features included. All of these are donated to every call.

Pages over "data" (`Engine(split_pages=True)`, under a mesh with data > 1):
each data shard has its own page pool and its own slice of the slot store, and
both executables run once per data shard (`sharding.per_data_shard`). A batch
of b rows gives shard d rows d*(b/data) .. (d+1)*(b/data)-1, so the scheduler
lays the batch out (`place`): every sequence is pinned to one shard while it
is active, its page-table row holds that shard's local page ids and its slot
is a row of that shard's store. A `None` row is padding.

Two executables per bucket:

* `prefill(b, chunk)`: one chunk of up to `chunk` prompt tokens per row at
  cache slot `q_start` (target and draft model), and a sampled token at the
  chunk's end (used when the chunk finishes the prompt);
* `decode(k, b, ctx)`: up to `steps_per_call` draft -> verify -> commit
  iterations inside one `lax.while_loop` (the `SpecState` carry of
  `jaxspec.speculative.loop`), with draft length k (k = 0: plain decoding, one
  token per iteration). Adaptive speculation picks k per call.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import aot
from jaxspec.engine import Engine, bucket_for
from jaxspec.engine.device_sampling import DeviceSampling
from jaxspec.engine.core import draft_cache_of, make_chunk_prefill_fn, row_state, spec_state, with_row_state
from jaxspec import mesh as shd
from jaxspec.speculative.drafters import build_drafter, reserve_tokens
from jaxspec.speculative.loop import SpecPlan, SpecState, make_spec_decode_fn


@dataclasses.dataclass
class RowInput:
    """One sequence's slice of a decode call, built by the scheduler."""

    tokens: Sequence[int]  # prompt + committed tokens; the last one's K/V is not cached
    prompt_len: int  # the original prompt (max_new counts from here)
    max_new: int
    page_row: np.ndarray  # [max_pages] int32
    slot: int  # the sequence's row in the drafter-state store (scheduler-assigned, stable while active)
    temperature: float
    top_k: int
    top_p: float
    seed: int
    stop_ids: Sequence[int]
    shard: int | None = None  # split pages: the data shard the sequence is pinned to (checked against its row)


@dataclasses.dataclass
class RowOutput:
    tokens: list[int]  # newly committed tokens, cut at a stop id or max_new
    done: bool
    accept_lens: list[int]  # committed tokens per verify step in this call


def plan_for_steps(base: SpecPlan, k: int) -> SpecPlan:
    """The chain plan drafting k tokens per iteration (k = 0: no speculation)."""
    return dataclasses.replace(base, num_draft_tokens=k + 1, topk=1, num_steps=max(k, 1))


def _prefill_adapter(chunk_prefill):
    """The shared chunked prefill with the drafter state third (what `_with_slots` expects)."""

    def fn(params, draft_params, draft, cache, tokens, q_start, lens, table, sampling):
        cache, draft, first = chunk_prefill(params, draft_params, cache, draft, tokens, q_start, lens, table, sampling)
        return cache, first, draft

    return fn


def _decode_adapter(decode):
    def fn(params, draft_params, draft, state):
        out = decode(params, draft_params, dataclasses.replace(state, draft=draft))
        return dataclasses.replace(out, draft=None), out.draft

    return fn


def _with_slots(fn, drafter):
    """fn(params, draft_params, draft, *args) -> (..., draft) as a function of the
    slot store instead: store = (draft cache, per-row leaves [num_slots + 1, ...]),
    slots [B] int32. The rows are gathered before and scattered back after,
    inside the same executable (padding rows use the spare last slot)."""

    def run(params, draft_params, store, slots, *args):
        cache, rows = store
        b = slots.shape[0]
        draft = with_row_state(drafter.init_state(cache, b), jax.tree.map(lambda x: x[slots], rows), cache)
        *out, draft = fn(params, draft_params, draft, *args)
        new_rows = jax.tree.map(lambda st, r: st.at[slots].set(r), rows, row_state(draft))
        return (*out, (draft_cache_of(draft), new_rows))

    return run


class ModelRunner:
    """Compiled prefill/decode executables over an Engine's params and caches."""

    def __init__(self, engine: Engine, *, steps_candidates: Sequence[int], steps_per_call: int,
                 context_buckets: Sequence[int], prefill_chunk: int, max_prefill_batch: int):
        if engine.spec_plan is None:
            raise ValueError("ModelRunner needs an engine built with a spec plan (k = 0 is plain decoding)")
        self.engine = engine
        # Split pages: rows of shard d sit at d*(b/data) .. in every batch (`place`).
        self.num_shards = engine.num_shards
        self.cfg = engine.cfg
        self.page_size = engine.page_size
        self.steps_per_call = steps_per_call
        self.candidates = tuple(sorted(set(steps_candidates)))
        base = engine.spec_plan
        self.base_plan = base
        # Fixed (non-adaptive) tree plans keep their own shape; chains go through plan_for_steps.
        fixed_tree = len(self.candidates) == 1 and not base.chain
        self.plans = {k: (base if fixed_tree else plan_for_steps(base, k)) for k in self.candidates}
        self.max_depth = max(p.max_depth for p in self.plans.values())
        ecfg = engine.ecfg
        n = self.num_shards  # buckets round up to whole rows per data shard, as the engine's do
        up = lambda b: -(-b // n) * n  # noqa: E731
        buckets = [b for b in sorted(ecfg.batch_buckets) if b < ecfg.max_batch_size] + [ecfg.max_batch_size]
        self.batch_buckets = tuple(sorted({up(b) for b in buckets}))
        self.prefill_batches = tuple(b for b in self.batch_buckets if b <= up(max_prefill_batch)) or (n,)
        self.chunk_buckets = tuple(c for c in sorted(ecfg.length_buckets) if c < prefill_chunk) + (prefill_chunk,)
        self.prefill_chunk = prefill_chunk
        ctx = [c for c in sorted(context_buckets) if c < engine.max_context] + [engine.max_context]
        self.context_buckets = tuple(ctx)
        draft_cfg = engine.draft_cfg
        self._decode = {}
        reserves = []
        for k, plan in self.plans.items():
            drafter = build_drafter(plan, draft_cfg=draft_cfg, target_cfg=self.cfg, catch_up_width=self.max_depth + 1)
            reserves.append(reserve_tokens(plan, drafter))
            self._decode[k] = jax.jit(engine.pinned(_with_slots(_decode_adapter(
                make_spec_decode_fn(plan, self.cfg, drafter, max_iters=steps_per_call)), drafter), replicated=(0, 1)),
                donate_argnums=(2, 4))
        self.reserve = max(reserves)
        # Every plan's drafter keeps the same state layout (they differ in draft length only),
        # so one store and one prefill serve all of them. `pinned`: outputs keep the mesh
        # layout, so each executable accepts its own outputs.
        self._drafter = drafter
        # Slots per store (split pages: per data shard, shard-local ids); `num_slots` is the spare.
        self.num_slots = self.batch_buckets[-1] // n if engine.split_pages else ecfg.max_batch_size
        self._prefill = jax.jit(engine.pinned(_with_slots(_prefill_adapter(make_chunk_prefill_fn(self.cfg, drafter)),
                                                          drafter), replicated=(0, 1)), donate_argnums=(2, 4))
        self.store = self._new_store()
        self._compiled: dict[tuple, object] = {}
        self.num_compiles = 0
        self.decode_seconds: dict[tuple, float] = {}  # (k, (batch, context)) -> seconds per iteration

    # ---- buckets -----------------------------------------------------------------

    @property
    def max_pages(self) -> int:
        return -(-self.context_buckets[-1] // self.page_size)

    def context_bucket(self, num_tokens: int) -> int:
        return bucket_for(num_tokens, self.context_buckets, "context")

    def place(self, shards: Sequence[int], buckets: Sequence[int]) -> list[int | None]:
        """Split pages: the batch layout for items pinned to `shards` (one per item): a list as
        long as the smallest bucket that gives every shard room, holding each batch position's
        item index, or None (a padding row). Shard d's items fill positions d*(b/data) on, in order.
        One pool: the items in order (the bucket pads them)."""
        if not self.engine.split_pages:
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

    def all_keys(self) -> list[tuple]:
        keys = [("prefill", b, c) for b in self.prefill_batches for c in self.chunk_buckets]
        keys += [("decode", k, b, ctx) for k in self.candidates for b in self.batch_buckets
                 for ctx in self.context_buckets]
        return keys

    # ---- compilation -------------------------------------------------------------

    def _sampling_struct(self, b: int) -> DeviceSampling:
        return DeviceSampling.abstract(b)

    def _new_store(self):
        """(draft cache, per-row drafter state [num_slots + 1, ...]); the last row is the padding rows' spare.
        Split pages: [data * (num_slots + 1), ...], split over "data" (each shard its own rows and spare)."""
        e = self.engine
        rows = row_state(self._drafter.init_state(e.draft_cache, (self.num_slots + 1) * self.num_shards))
        return (e.draft_cache, shd.shard_batch(rows, e.mesh))

    def _state_struct(self, b: int, ctx: int) -> SpecState:
        """The decode call's state without the drafter's (that comes from the store)."""
        e = self.engine
        i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
        return spec_state(
            cache=e.cache, draft=None, page_table=i32(b, -(-ctx // self.page_size)), history=i32(b, ctx),
            hist_len=i32(b), prompt_lens=i32(b), done=jax.ShapeDtypeStruct((b,), jnp.bool_),
            sampling=self._sampling_struct(b), accept_width=self.steps_per_call, corpus=e.corpus,
            zeros=jax.ShapeDtypeStruct,
        )

    def _slots_struct(self, b: int):
        return jax.ShapeDtypeStruct((b,), jnp.int32)

    def compile(self, keys: Sequence[tuple], progress: bool = False) -> None:
        from tqdm.auto import tqdm

        todo = [k for k in keys if k not in self._compiled]
        e = self.engine
        parts = (e.aot_parts(), repr(self.plans), self.steps_per_call, self.max_pages, self.num_slots)
        for key in tqdm(todo, desc="compiling buckets", disable=not progress or not todo):
            fn, args = self._trace_args(key)
            self._compiled[key] = aot.compile_cached(("runner", key, parts, aot.abstract_signature(args)),
                                                     lambda fn=fn, args=args: self._lower(fn, args), e.before_load)
            self.num_compiles += 1

    def _lower(self, fn, args):
        with self.engine.mesh_context():  # shard_map'd kernels lower against the mesh in context
            return fn.trace(*args).lower()

    def trace(self, key: tuple) -> jax.stages.Traced:
        """The traced executable of a key of `all_keys`; `.lower(lowering_platforms=...)`
        lowers it for another platform (`jaxspec.bench.lower`)."""
        fn, args = self._trace_args(key)
        with self.engine.mesh_context():
            return fn.trace(*args)

    def _trace_args(self, key: tuple) -> tuple:
        """(the jitted function, its abstract arguments) of a bucket key."""
        e = self.engine
        with e.mesh_context():
            if key[0] == "prefill":
                _, b, c = key
                i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
                batch = shd.abstract_state((i32(b), i32(b, c), i32(b), i32(b), i32(b, self.max_pages),
                                            self._sampling_struct(b)), e.mesh, e.split_pages)
                return self._prefill, (e.params, e.draft_params, self.store, batch[0], e.cache, *batch[1:])
            _, k, b, ctx = key
            slots, state = shd.abstract_state((self._slots_struct(b), self._state_struct(b, ctx)), e.mesh,
                                              e.split_pages)
            return self._decode[k], (e.params, e.draft_params, self.store, slots, state)

    def calibrate(self) -> None:
        """Time a decode call per (k, batch bucket, context bucket) on dummy rows: the
        adaptive policy's prior for draft lengths it has not tried yet in a bucket."""
        for k in self.candidates:
            for b in self.batch_buckets:
                for ctx in self.context_buckets:
                    rows = [RowInput(tokens=[1] * 8, prompt_len=8, max_new=10**6,
                                     page_row=np.zeros(self.max_pages, np.int32), slot=self.num_slots, temperature=0.0,
                                     top_k=0, top_p=1.0, seed=0, stop_ids=()) for _ in range(b)]
                    times = []
                    for _ in range(2):  # the first call warms up
                        t0 = time.perf_counter()
                        _, iters = self.decode(k, rows, ctx)
                        times.append((time.perf_counter() - t0) / max(iters, 1))
                    self.decode_seconds[(k, (b, ctx))] = times[-1]

    def reset_caches(self) -> None:
        """Fresh zeroed caches after a failed call (whose outputs may be poisoned)."""
        e = self.engine
        e.cache = shd.zeros_cache(e.cache.k.shape, e.cache.k.dtype, e.mesh, e.split_pages)
        if e.draft_cache is not None:
            e.draft_cache = shd.zeros_cache(e.draft_cache.k.shape, e.draft_cache.k.dtype, e.mesh, e.split_pages)
        self.store = self._new_store()

    def _restore(self) -> None:
        """After a failed call the donated buffers are gone: fresh caches and store."""
        e = self.engine
        lost_store = any(x.is_deleted() for x in jax.tree.leaves(self.store))
        e._restore_donated_caches()
        if lost_store:
            self.store = self._new_store()

    # ---- calls -------------------------------------------------------------------

    @staticmethod
    def sampling_inputs(rows: Sequence, b: int) -> DeviceSampling:
        return DeviceSampling.pack(rows, b)

    # Each call is split in two: the host inputs of a bucket (plain numpy, so a
    # multi-host leader can broadcast them) and running that bucket on them
    # (what every process does, `jaxspec.serve.multihost`). A None row or chunk is
    # padding (split pages: the scheduler lays rows out by data shard, `place`).

    def _check_shard(self, i: int, b: int, row: RowInput) -> None:
        if self.engine.split_pages and row.shard is not None and row.shard != i // (b // self.num_shards):
            raise ValueError(f"batch row {i} of {b} runs on data shard {i // (b // self.num_shards)}, but its "
                             f"sequence is pinned to shard {row.shard}")

    def prefill_inputs(self, chunks: Sequence[tuple[RowInput, int, int]]) -> tuple[tuple, dict]:
        b = bucket_for(len(chunks), self.prefill_batches, "prefill batch")
        c = bucket_for(max(ch[2] for ch in chunks if ch is not None), self.chunk_buckets, "prefill chunk")
        tokens = np.zeros((b, c), np.int32)
        q_start, lens = np.zeros((b,), np.int32), np.zeros((b,), np.int32)
        table = np.zeros((b, self.max_pages), np.int32)
        slots = np.full((b,), self.num_slots, np.int32)
        for i, chunk in enumerate(chunks):
            if chunk is None:
                continue
            row, start, n = chunk
            self._check_shard(i, b, row)
            tokens[i, :n] = row.tokens[start: start + n]
            q_start[i], lens[i], slots[i] = start, n, row.slot
            table[i, : len(row.page_row)] = row.page_row
        inputs = dict(slots=slots, tokens=tokens, q_start=q_start, lens=lens, table=table,
                      sampling=self.sampling_inputs([ch and ch[0] for ch in chunks], b))
        return ("prefill", b, c), inputs

    def run_prefill(self, key: tuple, inputs: dict) -> np.ndarray:
        """The token sampled at each row's chunk end [b]."""
        e = self.engine
        self.compile([key])
        try:
            x = shd.shard_batch(inputs, e.mesh)
            e.cache, first, self.store = self._compiled[key](
                e.params, e.draft_params, self.store, x["slots"], e.cache, x["tokens"], x["q_start"], x["lens"],
                x["table"], x["sampling"])
            e.draft_cache = self.store[0]
            return np.asarray(shd.to_host(first))
        finally:
            self._restore()

    def prefill(self, chunks: Sequence[tuple[RowInput, int, int]]) -> list[int]:
        """chunks: (row, q_start, chunk_len) each, or None (padding); returns the token sampled at each
        chunk's end (a padding row's is meaningless)."""
        key, inputs = self.prefill_inputs(chunks)
        return self.run_prefill(key, inputs)[: len(chunks)].tolist()

    def decode_inputs(self, k: int, rows: Sequence[RowInput], ctx: int) -> tuple[tuple, dict]:
        b = bucket_for(len(rows), self.batch_buckets, "batch size")
        maxp = -(-ctx // self.page_size)
        history = np.zeros((b, ctx), np.int32)
        hist_len, prompt_lens = np.ones((b,), np.int32), np.zeros((b,), np.int32)
        slots = np.full((b,), self.num_slots, np.int32)
        table = np.zeros((b, maxp), np.int32)
        done = np.ones((b,), bool)
        for i, r in enumerate(rows):
            if r is None:
                continue
            self._check_shard(i, b, r)
            n = len(r.tokens)
            history[i, :n] = r.tokens
            hist_len[i], prompt_lens[i], slots[i] = n, r.prompt_len, r.slot
            m = min(len(r.page_row), maxp)
            table[i, :m] = r.page_row[:m]
            done[i] = False
        # Host arrays only: a jnp.zeros here would compile a fill op per new shape while serving.
        inputs = dict(table=table, history=history, hist_len=hist_len, prompt_lens=prompt_lens, done=done,
                      slots=slots, sampling=self.sampling_inputs(rows, b))
        return ("decode", k, b, ctx), inputs

    def run_decode(self, key: tuple, inputs: dict) -> tuple[np.ndarray, ...]:
        """(history, hist_len, done, accept_lens, num_verify) after the call, on the host."""
        e = self.engine
        x = shd.shard_batch(inputs, e.mesh)
        state = spec_state(
            cache=e.cache, draft=None, page_table=x["table"], history=x["history"], hist_len=x["hist_len"],
            prompt_lens=x["prompt_lens"], done=x["done"], sampling=x["sampling"], accept_width=self.steps_per_call,
            corpus=e.corpus, zeros=lambda shape, dtype: shd.shard_batch(np.zeros(shape, dtype), e.mesh),
        )
        self.compile([key])
        try:
            state, self.store = self._compiled[key](e.params, e.draft_params, self.store, x["slots"], state)
            e.cache, e.draft_cache = state.cache, self.store[0]
            return shd.to_host((state.history, state.hist_len, state.done, state.accept_lens, state.num_verify))
        finally:
            self._restore()

    def decode(self, k: int, rows: Sequence[RowInput], ctx: int):
        """Up to steps_per_call iterations with draft length k; returns ([RowOutput | None per row], iterations
        run); a None row (padding) gets None."""
        key, inputs = self.decode_inputs(k, rows, ctx)
        return self.decode_outputs(rows, self.run_decode(key, inputs))

    @staticmethod
    def decode_outputs(rows: Sequence[RowInput], result: tuple[np.ndarray, ...]):
        hist, new_len, done_out, acc, nv = result
        outs = []
        for i, r in enumerate(rows):
            if r is None:
                outs.append(None)
                continue
            n = len(r.tokens)
            outs.append(RowOutput(tokens=hist[i, n: new_len[i]].tolist(), done=bool(done_out[i]),
                                  accept_lens=acc[i, : nv[i]].tolist()))
        return outs, int(nv[: len(rows)].max(initial=0))
