"""Continuous batching: sequences join and leave the running batch between device calls.

One scheduler step:

0. right after requests end, wait up to `follow_up_grace` for their clients' next requests
   (`serve/follow_ups.py`), so those join this step's prefill call instead of waiting it out;
1. take new sequences and cancellations from the inbox; free cancelled ones;
2. admit waiting sequences (FIFO) while a batch slot and KV pages are free;
3. one chunked-prefill call for sequences still prefilling (`serve/prefill_plan.py`:
   fewest tokens left first, the shape finishing most with least padding; packed
   rows of `prefill_piece` tokens when the drafter keeps no per-sequence state,
   in calls sized to bring the waiting prompts to their first token soonest);
   with `prefill_calls_per_step` > 1, up to that many, admitting between them;
4. one decode call of up to `steps_per_call` speculative iterations for the
   running batch, after giving each row pages for the call (preempting the
   newest sequence when the pool is dry; it is recomputed later); only
   `yield_steps` of them while a prefill waits (a runtime input, not a program),
   and while the follow-ups of requests that just ended are expected
   (`follow_up_window`).

A new request therefore waits at most one decode call before its prefill, and
a cancelled one returns its pages within one call. The scheduler runs on its
own thread (`start`); `submit` and `cancel` are thread-safe, and each
sequence's `on_event` is called on the scheduler thread.

Pages over "data" (the runner's engine has `split_pages`): every data shard
has its own page pool and batch rows. Admission pins a sequence to one shard
(the least loaded one whose pool can take it) until it finishes or is
preempted; its pages come from that shard's pool, its slot from that shard's
store, and every call lays the batch out so its row lands in that shard's
slice (`ModelRunner.place`). Admission headroom, preemption victims (only
rows of the same shard free useful pages) and the request size check are per
shard. A preempted sequence is recomputed from scratch, so it may come back
on another shard.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import itertools
import logging
import queue
import threading
import time
from typing import Callable

from jaxspec.cache.paged import OutOfPagesError
from jaxspec.cache.prefix import page_keys
from jaxspec.engine.adaptive import AdaptiveSteps
from jaxspec.detok import IncrementalDetokenizer, StopStringMatcher
from jaxspec.engine.runner import ModelRunner
from jaxspec.engine.types import RowInput, TokenScores, bucket_for
from jaxspec.sampling_params import SamplingParams
from jaxspec.serve.follow_ups import FollowUps
from jaxspec.serve.prefill_plan import DECODE_GAP_TOKENS, MAX_PREFILL_SKIPS, plan_packed, plan_prefill
from jaxspec.serve.trace import Trace

log = logging.getLogger("jaxspec.serve")


class Status(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass
class Event:
    """What one device call produced for a sequence (tokens committed together go out together)."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort" or None (more to come)
    logprobs: TokenScores | None = None  # token_ids' own, when the request asked


@dataclasses.dataclass(eq=False)
class Seq:
    prompt_ids: list[int]
    params: SamplingParams  # the request's own (by reference): max_tokens, temperature, top_p, top_k, stop
    on_event: Callable[[Event], None]
    seed: int = 0  # this sample's noise key (the request's seed + its index)
    stop_ids: tuple[int, ...] = ()  # token ids that end it (the model's EOS unless ignore_eos)
    seq_id: int = dataclasses.field(default_factory=itertools.count().__next__)
    tokens: list[int] = dataclasses.field(default_factory=list)
    num_cached: int = 0  # target K/V slots filled so far
    prefix_hit: int = 0  # of them, served from the prefix cache at this admission
    cached_tokens: int | None = None  # prompt tokens the first admission found cached (usage)
    slot: int | None = None  # row of the runner's drafter-state store while prefilling or running
    shard: int | None = None  # the data shard it is pinned to while prefilling or running (split pages)
    status: Status = Status.WAITING
    arrival: float = dataclasses.field(default_factory=time.perf_counter)
    admitted_time: float | None = None  # first admission (metrics: queue time, then prefill time)
    prefill_skips: int = 0  # prefill calls that passed it over since it last ran (plan_prefill's urgent)
    first_token_time: float | None = None
    finish_reason: str | None = None
    cancelled: bool = False
    num_preemptions: int = 0
    detok: IncrementalDetokenizer | None = None
    stopper: StopStringMatcher | None = None
    grammar: object = None  # grammar.matcher.Grammar of a structured-output request

    def __post_init__(self):
        self.tokens = list(self.prompt_ids)

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - len(self.prompt_ids)

    @property
    def prefill_target(self) -> int:
        """Tokens to prefill: the whole prompt, or, when recomputing after a
        preemption, everything but the newest token (the decode root)."""
        return len(self.tokens) - (1 if self.num_generated else 0)


class Scheduler:
    def __init__(self, runner: ModelRunner, tokenizer=None, *, max_batch_size: int, adaptive: AdaptiveSteps | None,
                 metrics=None, prefill_calls_per_step: int = 1, yield_steps: int = 0, follow_up_window: float = 0.0,
                 follow_up_grace: float = 0.0, trace: Trace | None = None):
        self.runner = runner
        self.trace = trace or Trace()  # serve.trace: the call-by-call timeline, off by default
        self.prefill_calls_per_step = prefill_calls_per_step
        self.yield_steps = yield_steps  # decode iterations per call while a prefill waits; 0 = steps_per_call
        self.follow_ups = FollowUps(follow_up_window, follow_up_grace)
        self.allocator = runner.allocator
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.adaptive = adaptive
        self.metrics = metrics
        self.fixed_k = max(runner.candidates)
        self.num_shards = runner.num_shards if runner.split_pages else 1
        # Page pools: one per data shard with split pages, else the one allocator.
        self._pools = self.allocator.pools if self.num_shards > 1 else [self.allocator]
        # Drafter-state rows (runner.store), one per active sequence: at most max_batch_size
        # (split pages: runner.num_slots per data shard, shard-local ids).
        self._free_slots = list(range(min(max_batch_size, runner.num_slots)))[::-1]
        self._shard_slots = [list(range(runner.num_slots))[::-1] for _ in range(self.num_shards)]
        self.waiting: collections.deque[Seq] = collections.deque()
        self.prefilling: list[Seq] = []
        self.running: list[Seq] = []
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # Fast tokenizers are not safe to call from two threads at once (request parsing
        # encodes on the event loop while this thread decodes).
        self.tokenizer_lock = threading.Lock()
        self.num_decode_calls = 0
        self.last_error: str | None = None
        if metrics is not None:  # the page gauges read the pool from start-up, not from the first request
            metrics.update_state(self)

    # ---- thread-safe API -----------------------------------------------------------

    @property
    def max_sequence_tokens(self) -> int:
        """Prompt + new tokens one sequence can hold: the context or the whole cache (split pages: one data
        shard's pool), less the draft scratch."""
        slots = min(self.runner.max_context, self._pools[0].total * self.allocator.page_size)
        return slots - self.runner.reserve

    def check(self, prompt_len: int, params: SamplingParams) -> str | None:
        """Why this request can never run (None if it can): the context or the whole cache."""
        total = prompt_len + params.max_tokens + self.runner.reserve
        if total > self.runner.max_context:
            return (f"prompt of {prompt_len} tokens + max_tokens {params.max_tokens} exceeds the context of "
                    f"{self.runner.max_context - self.runner.reserve} tokens")
        pool = self._pools[0]  # every shard's pool has the same size
        if pool.pages_for(total) > pool.total:
            where = "the whole cache has" if self.num_shards == 1 else "a data shard's page pool has"
            return (f"prompt of {prompt_len} tokens + max_tokens {params.max_tokens} needs "
                    f"{pool.pages_for(total)} KV pages; {where} {pool.total}")
        return None

    def submit(self, seq: Seq) -> None:
        self._inbox.put(("add", seq))
        self._wake.set()

    def cancel(self, seq: Seq) -> None:
        self._inbox.put(("cancel", seq))
        self._wake.set()

    # Set once abort_all is processed (shutdown): a request still reaching the inbox afterwards is
    # ended at once, so none starts after the drain has finished waiting and is cut by the exit.
    closed = False

    def abort_all(self, reason: str) -> None:
        """End every queued and running sequence with finish reason "abort" (on the scheduler thread),
        and every one submitted after it."""
        self._inbox.put(("abort_all", reason))
        self._wake.set()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="jaxspec-scheduler", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    @property
    def num_active(self) -> int:
        return len(self.prefilling) + len(self.running)

    def busy(self) -> bool:
        """Work queued or in flight, submissions not yet drained from the inbox included."""
        return bool(self.waiting or self.prefilling or self.running) or not self._inbox.empty()

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self.busy():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                self.step()
            except Exception as e:  # a failed device call must not take the server down
                log.exception("scheduler step failed")
                self.last_error = f"{type(e).__name__}: {e}"
                # The caches may hold a half-finished call: start from zeroed ones, and abort the
                # requests that had K/V there. Waiting requests hold none and keep their place.
                self.runner.reset_caches()
                for seq in self.prefilling + self.running:
                    self._finish(seq, "abort")

    # ---- one step -------------------------------------------------------------------

    def step(self) -> None:
        t0 = time.perf_counter()
        if self.follow_ups.wait(self._inbox.qsize, self._wake, self._stop):
            self.trace.call("wait", t0, time.perf_counter(), ())
        for _ in range(self.prefill_calls_per_step):
            # Before every prefill call: what arrived during the last one is prefilled before the
            # decode call too.
            self._drain_inbox()
            self._admit()
            if not self.prefilling:
                break
            self._prefill_step()
        if self.running:
            self._decode_step()
        if self.metrics is not None:
            self.metrics.update_state(self)

    def _drain_inbox(self) -> None:
        while True:
            try:
                op, seq = self._inbox.get_nowait()
            except queue.Empty:
                return
            if op == "add":
                self.follow_ups.arrived()
                if seq.cancelled:
                    continue
                if self.closed:  # it passed the server's draining check, then reached the inbox after abort_all
                    self._finish(seq, "abort")
                    continue
                if self.tokenizer is not None:
                    seq.detok = IncrementalDetokenizer(self.tokenizer, seq.prompt_ids)  # no tokenizer call
                seq.stopper = StopStringMatcher(seq.params.stop)
                self.waiting.append(seq)
            elif op == "cancel" and seq.status != Status.FINISHED:
                seq.cancelled = True
                if seq in self.waiting:
                    self.waiting.remove(seq)
                self._finish(seq, "abort")
            elif op == "abort_all":  # `seq` carries the reason the clients are told
                self.last_error = seq
                self.closed = True
                for s in [*self.waiting, *self.prefilling, *self.running]:  # waiting is a deque: no `+`
                    self._finish(s, "abort")
                self.waiting.clear()

    def _reach(self, seq: Seq, now: int) -> int:
        """`now` plus what the next decode call may commit, at most the request's last token."""
        r = self.runner
        return min(now + r.steps_per_call * (r.max_depth + 1), len(seq.prompt_ids) + seq.params.max_tokens)

    def _history_need(self, seq: Seq) -> int:
        """Tokens `seq`'s history may hold after the next decode call. One more than the cache slots
        without a reserve: the newest token has no K/V yet. A history bucket one short drops that
        token on the device, and with one iteration per call the row never advances."""
        return self._reach(seq, len(seq.tokens))

    def _lookahead(self, seq: Seq) -> int:
        """Cache slots `seq` may touch during the next decode call (scratch of the last tree included)."""
        return self._reach(seq, max(len(seq.tokens), 1) - 1) + self.runner.reserve

    # ---- pages and slots per data shard (one shard without split pages) -------------------

    def _slots_of(self, shard: int):
        return self._free_slots if self.num_shards == 1 else self._shard_slots[shard]

    def _allocate(self, seq: Seq, num_tokens: int) -> None:
        if self.num_shards == 1:
            self.allocator.allocate(seq.seq_id, num_tokens)
        else:
            self.allocator.allocate(seq.seq_id, num_tokens, seq.shard)

    def _pick_shard(self, seq: Seq, need: int, growth: int) -> int | None:
        """The shard a waiting sequence needing `need` slots joins: a free slot and pages for it with
        one call of growth left for that shard's running rows; the one caching the longest prefix of it
        first, then the fewest active rows (batch buckets follow the fullest shard), then the most free
        pages. None: no shard can take it now."""
        active, running = [0] * self.num_shards, [0] * self.num_shards
        for s in self.prefilling + self.running:
            active[s.shard] += 1
        for s in self.running:
            running[s.shard] += 1
        best = None
        for d, pool in enumerate(self._pools):
            if self.num_shards > 1 and not self._shard_slots[d]:  # one pool: num_active bounds the slots
                continue
            # Leave the running rows one call of growth, so an admission is not
            # undone by a preemption in the same step (prefill work thrown away).
            if pool.pages_for(need) + growth * running[d] > pool.num_free:
                continue
            hit = pool.match(seq.tokens, seq.prefill_target - 1) if self.num_shards > 1 else 0
            key = (-hit, active[d], -pool.num_free, d)
            if best is None or key < best:
                best = key
        return None if best is None else best[-1]

    def _layout(self, seqs: list[Seq], buckets) -> list[Seq | None]:
        """The call's batch rows: with split pages each sequence in its shard's slice (None = padding)."""
        return [None if i is None else seqs[i] for i in self.runner.place([s.shard for s in seqs], buckets)]

    def _admission(self, seq: Seq) -> tuple[int, int | None]:
        """The slots a waiting `seq` is allocated on admission, and the shard that can take it now
        (None: none has the pages)."""
        r = self.runner
        growth = self._pools[0].pages_for(r.steps_per_call * (r.max_depth + 1))
        need = max(self._lookahead(seq), seq.prefill_target + 1)
        return need, self._pick_shard(seq, need, growth)

    def _admit(self) -> None:
        pending = {key for s in self.prefilling for key in self._prefix_keys(s)}
        while self.waiting and self.num_active < self.max_batch_size:
            seq = self.waiting[0]
            if self._awaits_prefix(seq, pending):
                break
            need, shard = self._admission(seq)
            if shard is None:
                break
            seq.shard = shard
            # The longest cached prefix, leaving at least one token to prefill (the chunk that samples).
            hit = self.allocator.adopt(seq.seq_id, seq.tokens, seq.prefill_target - 1,
                                       *((shard,) if self.num_shards > 1 else ()))
            try:  # cannot fail after _pick_shard's check; if it ever did, the adopted pages go back
                self._allocate(seq, need)
            except OutOfPagesError:
                self.allocator.free(seq.seq_id)
                raise
            self.waiting.popleft()
            seq.status, seq.num_cached, seq.slot = Status.PREFILLING, hit, self._slots_of(shard).pop()
            seq.prefill_skips = 0
            seq.prefix_hit = hit
            if seq.cached_tokens is None:
                seq.cached_tokens, seq.admitted_time = hit, time.perf_counter()
                if self.metrics is not None:
                    self.metrics.prefix_lookup(len(seq.prompt_ids), hit)
                    self.metrics.first_admission(seq)
            self.prefilling.append(seq)
            pending.update(self._prefix_keys(seq))

    # ---- the prefix cache ------------------------------------------------------------------

    def _prefix_keys(self, seq: Seq) -> list[bytes]:
        """The page keys `seq`'s prefill will publish (`cache.prefix.page_keys`); none with the cache off."""
        pool = self._pools[0]
        if not getattr(pool, "enabled", False):
            return []
        return page_keys(seq.tokens, pool.page_size, pool.root, seq.prefill_target - 1)

    def _awaits_prefix(self, seq: Seq, pending: set) -> bool:
        """Whether the first page `seq` would miss is being prefilled by an admitted sequence. It then
        waits (FIFO: the queue behind it too) until that prefill publishes the page, instead of
        computing the same K/V beside it: the samples of one prompt (n > 1), and conversations that
        open with the same system prompt and arrive together. A prefill finishes within a few steps,
        so the wait is bounded by the work it saves."""
        keys = self._prefix_keys(seq)
        if not keys or not pending:
            return False
        hit = max(p.match(seq.tokens, seq.prefill_target - 1) for p in self._pools) // self._pools[0].page_size
        return hit < len(keys) and keys[hit] in pending

    def _row(self, seq: Seq) -> RowInput:
        return RowInput(
            tokens=seq.tokens, prompt_len=len(seq.prompt_ids),
            page_row=self.allocator.page_table_row(seq.seq_id, self.runner.max_pages), slot=seq.slot,
            params=seq.params, seed=seq.seed, stop_ids=seq.stop_ids, shard=seq.shard if self.num_shards > 1 else None,
            cached=seq.prefix_hit, grammar=seq.grammar,
        )

    def _prefill_rows(self, shards: list[int]) -> int | None:
        """The prefill row bucket for sequences on these data shards (None: none holds them)."""
        r = self.runner
        try:
            return bucket_for(len(r.place(shards, r.prefill_batches)), r.prefill_batches, "prefill batch")
        except ValueError:
            return None

    def _prefill_step(self) -> None:
        r = self.runner
        pending = [(s.shard or 0, s.prefill_target - s.num_cached) for s in self.prefilling]
        urgent = next((i for i, s in enumerate(self.prefilling) if s.prefill_skips >= MAX_PREFILL_SKIPS), None)
        # 1. The plan: (sequence, prompt tokens taken) each, and the tokens per row.
        if r.prefill_piece:
            # The decode call between two prefill calls: yield_steps iterations, none when nothing runs.
            gap = DECODE_GAP_TOKENS * (self.yield_steps or r.steps_per_call) if self.running else 0
            plan = plan_packed(pending, r.prefill_batches, r.prefill_piece, self._prefill_rows, urgent=urgent, gap=gap)
            c = r.prefill_piece
        else:
            idx, c = plan_prefill(pending, r.prefill_shapes, r.chunk_buckets, self._prefill_rows, r.prefill_chunk,
                                  urgent=urgent)
            plan = [(i, min(c, pending[i][1])) for i in idx]
        taken = dict(plan)
        for i, s in enumerate(self.prefilling):
            s.prefill_skips = 0 if i in taken else s.prefill_skips + 1
        batch = [(self.prefilling[i], n) for i, n in plan]
        # 2. The rows: a sequence's tokens in pieces of c (one piece unless packed), laid out by shard.
        pieces = [(s, s.num_cached + off, min(c, n - off)) for s, n in batch for off in range(0, n, c)]
        layout = [None if j is None else pieces[j] for j in r.place([s.shard for s, _, _ in pieces], r.prefill_batches)]
        inputs = {}  # one RowInput per sequence, shared by its pieces
        chunks = [None if p is None else (inputs.setdefault(p[0].seq_id, self._row(p[0])), p[1], p[2]) for p in layout]
        t0 = time.perf_counter()
        first, first_lp = r.prefill_scored(chunks)
        t1, tokens = time.perf_counter(), sum(n for _, n in plan)
        self.trace.call("prefill", t0, t1, [s for s, _ in batch], rows=len(layout), tokens=tokens)
        if self.metrics is not None:
            b = bucket_for(len(layout), r.prefill_batches, "prefill batch")  # what ran, padding rows too
            self.metrics.prefill_call(t1 - t0, tokens, b * c)
        # 3. Each sequence's sampled token is its last piece's (the one ending at its furthest slot).
        end = {s.seq_id: s.num_cached + n for s, n in batch}
        last = {p[0].seq_id: (tok, lp) for p, tok, lp in zip(layout, first, first_lp)
                if p is not None and p[1] + p[2] == end[p[0].seq_id]}
        for seq, n in batch:
            seq.num_cached += n
            # Every chunk publishes the full pages it completed, so a request waiting for them
            # (_awaits_prefix) waits one chunk, not the whole prompt.
            self.allocator.cache_pages(seq.seq_id, seq.tokens, seq.num_cached)
            if seq.num_cached < seq.prefill_target:
                continue
            self.prefilling.remove(seq)
            seq.status = Status.RUNNING
            self.running.append(seq)
            if not seq.num_generated:  # fresh prompt: the sampled token is the first output
                tok, lp = last[seq.seq_id]
                seq.first_token_time = time.perf_counter()
                if self.metrics is not None:
                    self.metrics.first_token(seq)
                stopped = tok in seq.stop_ids
                self._emit(seq, [tok], stopped or seq.params.max_tokens <= 1, lp)

    def _ensure_pages(self) -> None:
        """Give every running row pages for the next call, preempting the newest on shortage."""
        for seq in sorted(self.running, key=lambda s: s.arrival):
            while seq.status == Status.RUNNING:
                try:
                    self._allocate(seq, self._lookahead(seq))
                    break
                except OutOfPagesError:
                    # Only rows of the same data shard hold pages of its pool.
                    victims = [s for s in self.running + self.prefilling if s is not seq and s.shard == seq.shard]
                    victim = max(victims, key=lambda s: s.arrival) if victims else None
                    if victim is None or victim.arrival < seq.arrival:
                        victim = seq  # the newest gives way
                    self._preempt(victim)

    def _publish(self, seq: Seq) -> None:
        """Offer the pages of a sequence that leaves to the prefix cache: the slots its K/V fills,
        less the newest `runner.prefix_lag` (a drafter may not have caught up with them)."""
        lag = self.runner.prefix_lag if seq.status == Status.RUNNING else 0
        self.allocator.cache_pages(seq.seq_id, seq.tokens, seq.num_cached - lag)

    def _preempt(self, seq: Seq) -> None:
        self._publish(seq)
        self.allocator.free(seq.seq_id)
        for group in (self.running, self.prefilling):
            if seq in group:
                group.remove(seq)
        self._release_slot(seq)
        seq.status, seq.num_cached = Status.WAITING, 0
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        if self.metrics is not None:
            self.metrics.preempted()
        log.info("preempted request %d (%d tokens) for KV pages", seq.seq_id, len(seq.tokens))

    def _prefill_waits(self) -> bool:
        """Whether the next step has a prefill call to make: a prompt with chunks left, a request in the
        inbox, or a waiting one that admission takes now (a batch slot and its pages free). One that
        lacks either waits for rows to finish or pages to free, which a full call brings sooner than
        one-iteration calls would (under page pressure those made ~40% more calls for the same tokens)."""
        if self.prefilling or not self._inbox.empty():
            return True
        if not self.waiting or self.num_active >= self.max_batch_size:
            return False
        return self._admission(self.waiting[0])[1] is not None

    def _decode_step(self) -> None:
        r = self.runner
        self._ensure_pages()
        if not self.running:
            return
        batch = list(self.running)
        layout = self._layout(batch, r.batch_buckets)
        b = next(x for x in r.batch_buckets if x >= len(layout))
        # Independent of k (max_depth of all); wide enough for the page table and for the history.
        ctx = r.context_bucket(max(max(self._lookahead(s), self._history_need(s)) for s in batch))
        k = self.adaptive.choose((b, ctx)) if self.adaptive is not None else self.fixed_k
        # None: steps_per_call. Calls while a follow-up is expected are short too: a chat client (or any
        # client at a fixed concurrency) sends its next request as soon as an answer ends, a few ms into the
        # next call.
        expect = self._prefill_waits() or self.follow_ups.due()
        budget = self.yield_steps if self.yield_steps and expect else None
        t0 = time.perf_counter()
        outs, iters = r.decode(k, [None if s is None else self._row(s) for s in layout], ctx, budget)
        seconds = time.perf_counter() - t0
        self.trace.call("decode", t0, t0 + seconds, [s for s in layout if s is not None], k=k, b=b, ctx=ctx,
                        iters=iters, tokens=[len(o.tokens) for s, o in zip(layout, outs) if s is not None])
        self.num_decode_calls += 1
        accept = [a for o in outs if o is not None for a in o.accept_lens]
        if self.adaptive is not None:
            self.adaptive.observe(k, (b, ctx), accept, seconds / iters if iters else None)
        if self.metrics is not None:
            plan = r.plans[k]
            self.metrics.decode_call(k, (b, ctx), accept, plan.num_draft_tokens - 1, plan.max_depth, self.adaptive,
                                     seconds, sum(len(o.tokens) for o in outs if o is not None))
        for seq, out in zip(layout, outs):
            if seq is None:
                continue
            if not out.tokens and not out.done:  # a call that cannot advance a row would repeat forever
                raise RuntimeError(f"decode call committed no token for request {seq.seq_id} "
                                   f"({len(seq.tokens)} tokens, history bucket {ctx})")
            seq.num_cached = len(seq.tokens) - 1 + len(out.tokens)
            self._emit(seq, out.tokens, out.done, out.logprobs)

    # ---- output -----------------------------------------------------------------------

    def _emit(self, seq: Seq, new: list[int], done: bool, logprobs: TokenScores | None = None) -> None:
        # The tokens before min_tokens pass the stop-string matcher unmatched (vLLM's rule), so they
        # are detokenized apart from the rest.
        quiet = max(0, min(len(new), seq.params.min_tokens - seq.num_generated))
        seq.tokens.extend(new)
        text, hit_stop_string = "", False
        for part, armed in [(new[:quiet], False), (new[quiet:], True)] if quiet else [(new, True)]:
            delta = ""
            if seq.detok is not None:
                with self.tokenizer_lock:
                    delta = seq.detok.add(part, final=done and armed)
            delta, hit_stop_string = seq.stopper.feed(delta, armed)
            text += delta
        if done or hit_stop_string:
            if not hit_stop_string:
                text += seq.stopper.flush()
            stopped = hit_stop_string or (bool(seq.tokens) and seq.tokens[-1] in seq.stop_ids
                                          and seq.num_generated > 0)
            if self.metrics is not None:
                self.metrics.tokens_out(seq, len(new))
            self._finish(seq, "stop" if stopped else "length", Event(text, list(new), logprobs=logprobs))
            return
        if self.metrics is not None:
            self.metrics.tokens_out(seq, len(new))
        if new:
            seq.on_event(Event(text, list(new), logprobs=logprobs))

    def _release_slot(self, seq: Seq) -> None:
        if seq.slot is not None:
            self._slots_of(seq.shard).append(seq.slot)
            seq.slot = None
        seq.shard = None

    def _finish(self, seq: Seq, reason: str, last: Event | None = None) -> None:
        if seq.status == Status.FINISHED:
            return
        if reason != "abort":  # an abort may follow a failed call: its caches are not trusted
            self._publish(seq)
            # One follow-up per request: the n samples (and prompts) of one request share its params.
            live = (*self.waiting, *self.prefilling, *self.running)
            if not any(s.params is seq.params and s is not seq for s in live):
                self.follow_ups.ended()
        self.allocator.free(seq.seq_id)
        self._release_slot(seq)
        for group in (self.running, self.prefilling):
            if seq in group:
                group.remove(seq)
        seq.status, seq.finish_reason = Status.FINISHED, reason
        if seq.grammar is not None:
            seq.grammar.release()
        if self.metrics is not None:
            self.metrics.finished(seq, reason)
        self.trace.finished(seq)
        event = last or Event("", [])
        event.finish_reason = reason
        try:
            seq.on_event(event)
        except Exception:  # a broken consumer must not stop the scheduler
            log.exception("event consumer failed for request %d", seq.seq_id)
