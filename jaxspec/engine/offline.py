"""Offline generation: whole batches, each one prefill and one on-device loop.

`Engine` is a thin loop over the one executor (`jaxspec.engine.runner.ModelRunner`),
the same one the server's scheduler drives. Per batch it allocates every row's pages
for its whole budget (after the longest cached prefix of its prompt, `cache.prefix`),
prefills the rest of the prompts (rows that share a prefix the cache lacks in a second
call, after the first published it), and runs one decode call until every row is done:
many draft -> verify -> commit iterations (or plain steps, the k = 0 plan) as one XLA
program, the paged caches donated to it. Buckets are (batch, prompt length,
context); an already-compiled bucket never retraces.
"""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from jaxspec.cache.prefix import shared_in_batch
from jaxspec.config import EngineSection
from jaxspec.engine.checks import check_request
from jaxspec.engine.phases import decode_phases
from jaxspec.engine.runner import ModelRunner
from jaxspec.engine.types import Request, RequestError, Result, RowInput, TokenScores, bucket_for
from jaxspec.sampling_params import SamplingParams
from jaxspec.speculative.drafters import algorithm_info
from jaxspec.speculative.drafters.plain import PlainDrafter

# Rows of a batch that share a prefix are prefilled in a second call when that saves at least this
# many prompt tokens: a call's fixed cost (its weight reads) is ~32 tokens of prefill on 2 CPU cores.
SHARE_MIN_TOKENS = 64


class Engine:
    """Batches of requests through a `ModelRunner` built for offline use (calls run to completion).

    Arguments as `ModelRunner`'s; `adaptive` (with speculation): each batch bucket runs plain
    decoding, the configured draft shape or a shorter chain (`spec.adaptive_lengths`), whichever
    the policy (`engine.adaptive.EngineAdaptive`) expects to commit more tokens per second."""

    def __init__(self, params: dict, cfg, engine_cfg: EngineSection, *, progress: bool = True, spec=None,
                 draft=None, ngram_corpus=None, mesh=None, benchmark: bool = False, split_pages: bool = True,
                 adaptive: bool = False):
        spec_on = spec is not None and algorithm_info(spec.algorithm).speculative
        self._attach(ModelRunner(params, cfg, engine_cfg, spec=spec if spec_on else None, draft=draft,
                                 ngram_corpus=ngram_corpus, mesh=mesh, split_pages=split_pages, benchmark=benchmark,
                                 progress=progress,
                                 adaptive_lengths=spec.adaptive_lengths if adaptive and spec_on else None))

    @classmethod
    def over(cls, runner: ModelRunner) -> "Engine":
        """The engine over an offline runner (`engine.assemble`); adaptive when it has plain
        decoding beside speculation."""
        self = cls.__new__(cls)
        self._attach(runner)
        return self

    def _attach(self, r: ModelRunner) -> None:
        if r.steps_per_call is not None:
            raise ValueError("the offline engine needs a runner whose calls run to completion (steps_per_call=None)")
        self.runner, self.progress, self.cfg, self.ecfg, self.mesh = r, r.progress, r.cfg, r.ecfg, r.mesh
        self.max_context, self.split_pages, self.num_shards = r.max_context, r.split_pages, r.num_shards
        self.spec_plan = r.base_plan if r.speculative else None
        self.drafter = r.drafter if r.speculative else None
        self.depth = r.base_plan.max_depth
        self.adaptive = None
        if r.speculative and 0 in r.candidates and self.depth > 0:
            from jaxspec.engine.adaptive import EngineAdaptive

            self.adaptive = EngineAdaptive({k: r.plans[k].num_draft_tokens for k in r.candidates})
        self.last_timing: dict[str, float] = {}

    @property
    def reserve_tokens(self) -> int:
        """Cache slots a sequence needs beyond prompt + max_tokens: the verify tree and the drafter's scratch."""
        return self.runner.reserve

    # ---- buckets and compilation -------------------------------------------------

    def buckets_for(self, batch: int, prompt_len: int, total_len: int) -> tuple[int, int, int]:
        r = self.runner
        if total_len > self.max_context:
            raise RequestError(f"prompt of {prompt_len} tokens + max_tokens exceeds the context of "
                               f"{self.max_context} tokens")
        b = bucket_for(min(batch, self.ecfg.max_batch_size), r.batch_buckets, "batch size")
        lb = bucket_for(prompt_len, r.chunk_buckets, "prompt length")
        return b, lb, r.context_bucket(max(total_len, lb))

    def _keys(self, bucket, k: int) -> tuple[tuple, tuple]:
        b, lb, ctx = bucket
        return ("prefill", b, lb, self.runner.prefill_context(lb, lb)), ("decode", k, b, ctx)

    def compile(self, buckets: Sequence[tuple[int, int, int]]) -> None:
        """AOT-compile prefill and decode for each (batch, prompt_len, context) bucket; with the
        adaptive policy, plain decoding and the configured shape (a shorter chain compiles when first
        chosen), and calibrate the policy's costs in a new bucket."""
        r = self.runner
        lengths = self.adaptive.measured if self.adaptive is not None else r.candidates
        r.compile([key for bk in buckets for k in lengths for key in self._keys(bk, k)], progress=self.progress)
        for bucket in buckets if self.adaptive is not None else ():
            b, _, ctx = bucket
            if not self.adaptive.calibrated((b, ctx)):
                self.adaptive.calibrate((b, ctx), self._calibrate(bucket))

    def trace(self, key: tuple):
        """The traced program of ("prefill", batch, prompt_len, context) or ("decode", batch, context),
        at the configured draft shape (`jaxspec.bench.lower`)."""
        if key[0] == "prefill":
            return self.runner.trace(("prefill", key[1], key[2], self.runner.prefill_context(key[2], key[2])))
        return self.runner.trace(("decode", self.depth, key[1], key[2]))

    # ---- generation --------------------------------------------------------------

    def validate(self, req: Request) -> None:
        check_request(self.runner, req.prompt_ids, req.params, req.stop_token_ids)

    def plan(self, requests: Sequence[Request]) -> list[tuple[list[int], tuple[int, int, int]]]:
        """Split requests into batches and choose each batch's bucket."""
        for r in requests:
            self.validate(r)
        step, plans = self.ecfg.max_batch_size, []
        for start in range(0, len(requests), step):
            idx = list(range(start, min(start + step, len(requests))))
            lp = max(len(requests[i].prompt_ids) for i in idx)
            total = max(len(requests[i].prompt_ids) + requests[i].params.max_tokens for i in idx) + self.reserve_tokens
            plans.append((idx, self.buckets_for(len(idx), lp, total)))
        return plans

    def generate(self, requests: Sequence[Request]) -> list[Result]:
        plans = self.plan(requests)
        self.compile(sorted({bk for _, bk in plans}))
        results: list[Result | None] = [None] * len(requests)
        timing = {"prefill_s": 0.0, "decode_s": 0.0, "new_tokens": 0}
        for idx, bucket in plans:
            key = (bucket[0], bucket[2])
            # 1. The policy picks the draft length for this bucket (calibrated by compile).
            k = self.adaptive.choose(key) if self.adaptive is not None else self.depth
            self.runner.compile(self._keys(bucket, k), progress=self.progress)  # not inside the timed call
            out = self._run_batch([requests[i] for i in idx], bucket, timing, k)
            for i, res in zip(idx, out):
                results[i] = res
            if self.adaptive is not None:  # 2. what it cost and what was accepted
                seconds, iters = self._last_call
                self.adaptive.observe(k, key, [n for res in out for n in (res.accept_lengths or [])],
                                      seconds / iters if iters else None)
        self.last_timing = timing
        return results  # type: ignore[return-value]

    def _calibrate(self, bucket) -> dict[int, float]:
        """Seconds per loop iteration of plain decoding and of the configured shape in `bucket`: a dummy
        batch of 16 new tokens per row through each program, twice, the second run kept."""
        b, _, ctx = bucket
        new = max(2, min(16, ctx - 8 - self.reserve_tokens))
        dummy = [Request([1] * 8, SamplingParams(max_tokens=new))] * b
        out = {}
        for _ in range(2):  # the first call of a fresh executable pays set-up costs
            for k in self.adaptive.measured:
                self._run_batch(dummy, bucket, {"prefill_s": 0.0, "decode_s": 0.0, "new_tokens": 0}, k)
                seconds, iters = self._last_call
                out[k] = seconds / max(iters, 1)
        return out

    def profile_phases(self, requests: Sequence[Request]) -> dict:
        """Speculative only: rerun the first batch with draft / verify / commit jitted apart and
        timed on the host (`engine.phases`). Returns PhaseTimer.to_dict()."""
        from jaxspec.speculative.metrics import PhaseTimer

        if self.spec_plan is None:
            raise RequestError("profile_phases needs speculative decoding (spec.algorithm != none)")
        if self.split_pages:  # the phases are jitted apart, not per data shard
            raise RequestError("profile_phases needs one page pool: build the Engine with split_pages=False")
        idx, bucket = self.plan(requests)[0]
        timer = PhaseTimer()
        self._run_batch([requests[i] for i in idx], bucket, {"prefill_s": 0.0, "decode_s": 0.0, "new_tokens": 0},
                        self.depth, timer=timer)
        return timer.to_dict()

    def _run_batch(self, reqs: list[Request], bucket, timing, k: int, timer=None) -> list[Result]:
        r, (b, _, ctx) = self.runner, bucket
        per_shard = b // self.num_shards
        seq_ids = [object() for _ in reqs]
        try:
            # 1. The waves: one prefill call, or two when rows share a prefix the cache lacks (the
            # chat template's system prompt): the later rows then adopt what the first call published.
            pools = r.allocator.pools if self.split_pages else [r.allocator]
            followers, saved = shared_in_batch([q.prompt_ids for q in reqs],
                                               [pools[i // per_shard if self.split_pages else 0] for i in range(len(reqs))])
            if saved < SHARE_MIN_TOKENS:
                followers = []
            waves = [[i for i in range(len(reqs)) if i not in followers], followers] if followers else [range(len(reqs))]
            rows: list[RowInput | None] = [None] * b
            first, first_lp = [None] * b, [None] * b
            t0 = time.perf_counter()
            for wave in waves:
                # 2. Pages for the whole budget up front: the loop never needs the host. Split pages:
                # row i runs on data shard i // per_shard, with pages from its pool and a local slot.
                for i in wave:
                    q, sid = reqs[i], seq_ids[i]
                    shard = () if not self.split_pages else (i // per_shard,)
                    hit = r.allocator.adopt(sid, q.prompt_ids, len(q.prompt_ids) - 1, *shard)
                    r.allocator.allocate(sid, len(q.prompt_ids) + q.params.max_tokens + self.reserve_tokens, *shard)
                    rows[i] = RowInput(
                        tokens=list(q.prompt_ids), prompt_len=len(q.prompt_ids),
                        page_row=np.asarray(r.allocator.page_table_row(sid, r.max_pages)),
                        slot=i % per_shard if self.split_pages else i, params=q.params, seed=q.seed,
                        stop_ids=tuple(q.stop_token_ids), shard=shard[0] if shard else None, cached=hit,
                        grammar=q.grammar)
                # 3. Prefill what the cache did not hold (one chunk per row), its sampled token first.
                got, got_lp = r.prefill_scored([(rows[i], rows[i].cached, rows[i].prompt_len - rows[i].cached)
                                                if i in wave else None for i in range(b)])
                for i in wave:
                    first[i], first_lp[i] = got[i], got_lp[i]
                    r.allocator.cache_pages(seq_ids[i], rows[i].tokens, rows[i].prompt_len)
            t1 = time.perf_counter()
            live = [None] * b
            for i, (q, row) in enumerate(zip(reqs, rows)):
                row.tokens.append(first[i])
                if first[i] not in q.stop_token_ids and q.params.max_tokens > 1:
                    live[i] = row
            # 4. One decode call until every row is done.
            outs, iters = ([None] * b, 0)
            if any(live):
                outs, iters = r.decode(k, live, ctx) if timer is None else decode_phases(r, k, live, ctx, timer)
            t2 = time.perf_counter()
            self._last_call = (t2 - t1, iters)
            # The finished sequences' pages, for later prompts; not after a k = 0 call that ran plain
            # decoding without the drafter, whose state for the generated tokens was never written.
            if not (r.speculative and isinstance(r.drafters[k], PlainDrafter)):
                for sid, row, out in zip(seq_ids, rows, outs):
                    history = row.tokens + (out.tokens if out is not None else [])
                    r.allocator.cache_pages(sid, history, len(history) - 1 - r.prefix_lag)
        finally:
            for sid in seq_ids:
                r.allocator.free(sid)
        timing["prefill_s"] += t1 - t0
        timing["decode_s"] += t2 - t1
        results = []
        for i, q in enumerate(reqs):
            out = [first[i]] + (outs[i].tokens if outs[i] is not None else [])
            timing["new_tokens"] += len(out)
            stopped = out[-1] in q.stop_token_ids
            accept = (outs[i].accept_lens if outs[i] is not None else []) if self.spec_plan and k else None
            lp = first_lp[i]
            if lp is not None and outs[i] is not None:
                lp = TokenScores.concat([lp, outs[i].logprobs])
            results.append(Result(list(q.prompt_ids), out, "stop" if stopped else "length", accept, lp,
                                  rows[i].cached))
        return results
