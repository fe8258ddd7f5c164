"""Prometheus metrics (`GET /metrics`), fed by the scheduler thread.

Names follow vLLM's where one exists, under the `jaxspec_` prefix. Each server
owns its own registry, so several servers (tests) can live in one process.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

disable_created_metrics()  # the *_created series only add noise to every scrape

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _GrammarCollector:
    """jaxspec_grammar_mask_{calls,masks,seconds}_total, read from grammar.matcher.STATS at scrape time."""

    def __init__(self, prefix: str):
        self.prefix = prefix

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        from jaxspec.grammar.matcher import STATS

        yield CounterMetricFamily(self.prefix + "grammar_mask_calls", "Grammar mask callbacks (one per verify or "
                                  "prefill of a batch with a constrained row)", value=STATS["calls"])
        yield CounterMetricFamily(self.prefix + "grammar_masks", "Token masks computed (one per reachable tree node)",
                                  value=STATS["masks"])
        yield CounterMetricFamily(self.prefix + "grammar_mask_seconds", "Host seconds in grammar mask callbacks",
                                  value=STATS["seconds"])


class ServerMetrics:
    def __init__(self, max_accept_length: int):
        r = self.registry = CollectorRegistry()
        p = "jaxspec_"
        self.requests = Counter(p + "requests", "Finished requests by status (stop, length, abort, rejected)",
                                ["status"], registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Arrival to first token", buckets=_LATENCY_BUCKETS,
                              registry=r)
        self.tpot = Histogram(p + "time_per_output_token_seconds", "Mean gap between output tokens, per request",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.running = Gauge(p + "num_requests_running", "Requests prefilling or decoding", registry=r)
        self.waiting = Gauge(p + "num_requests_waiting", "Requests queued for a batch slot or KV pages", registry=r)
        self.pages_used = Gauge(p + "kv_pages_used", "KV cache pages in use", registry=r)
        self.pages_free = Gauge(p + "kv_pages_free", "KV cache pages free", registry=r)
        self.pages_cached = Gauge(p + "kv_pages_cached", "KV pages in the prefix cache (held or evictable)",
                                  registry=r)
        self.prefix_queries = Counter(p + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      registry=r)
        self.prefix_hits = Counter(p + "prefix_cache_hits", "Prompt tokens served from the prefix cache", registry=r)
        self.prefix_hit_rate = Gauge(p + "prefix_cache_hit_rate", "prefix_cache_hits / prefix_cache_queries",
                                     registry=r)
        self.evicted = Counter(p + "prefix_cache_evicted_pages", "Cached KV pages evicted for new ones", registry=r)
        self._evicted_seen = self._queried = self._hit = 0
        self.preemptions = Counter(p + "preemptions", "Requests preempted (freed and recomputed later)", registry=r)
        self.decode_calls = Counter(p + "decode_calls", "Device decode calls", registry=r)
        # Where TTFT goes (vLLM's request_queue_time / request_prefill_time), and what prefill calls cost:
        # padded tokens are rows x chunk bucket, the work a call pays for; tokens, the prompt it advanced.
        self.queue_time = Histogram(p + "request_queue_time_seconds", "Arrival to first admission",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.prefill_time = Histogram(p + "request_prefill_time_seconds", "First admission to first token",
                                      buckets=_LATENCY_BUCKETS, registry=r)
        self.prefill_calls = Counter(p + "prefill_calls", "Device prefill calls", registry=r)
        self.prefill_seconds = Counter(p + "prefill_seconds", "Seconds in device prefill calls", registry=r)
        self.prefill_tokens = Counter(p + "prefill_tokens", "Prompt tokens prefilled (cache hits excluded)",
                                      registry=r)
        self.prefill_padded = Counter(p + "prefill_padded_tokens", "Rows x chunk bucket of each prefill call",
                                      registry=r)
        # Per draft length and batch bucket: what the adaptive policy ran, what it cost, what it emitted
        # (tokens / seconds is each program's live throughput, the quantity the policy compares).
        by = ["draft_length", "batch_bucket"]
        self.calls_by_length = Counter(p + "spec_calls_by_length", "Decode calls per draft length and batch bucket",
                                       by, registry=r)
        self.seconds_by_length = Counter(p + "spec_seconds_by_length",
                                         "Seconds in decode calls per draft length and batch bucket", by, registry=r)
        self.tokens_by_length = Counter(p + "spec_tokens_by_length",
                                        "Tokens committed by decode calls per draft length and batch bucket", by,
                                        registry=r)
        self.accept_length = Histogram(p + "spec_accept_length", "Tokens committed per verify step (bonus included)",
                                       buckets=tuple(range(1, max_accept_length + 1)), registry=r)
        self.accept_rate = Gauge(p + "spec_accept_rate", "Accepted draft tokens / draft depth, per verify step",
                                 registry=r)
        self.num_draft_tokens = Gauge(p + "spec_num_draft_tokens", "Draft tokens per verify step in the last call",
                                      registry=r)
        self.num_steps = Gauge(p + "spec_num_steps", "Current draft length per decode bucket (batch, context)",
                               ["batch_bucket", "context_bucket"], registry=r)
        self.verify_calls = Counter(p + "spec_verify_calls", "Verify steps (one per row per iteration)", registry=r)
        self.position_acceptance = Gauge(p + "spec_position_acceptance",
                                         "Fraction of verify steps accepting draft position i (1-based)",
                                         ["position"], registry=r)
        # Structured output: the host's mask callbacks (grammar/matcher.py keeps the process-wide counts).
        r.register(_GrammarCollector(p))
        self._accepted = 0
        self._proposed = 0
        self._reached = [0] * max_accept_length  # verify steps drafting position i+1
        self._passed = [0] * max_accept_length  # ... and accepting it

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # ---- scheduler hooks ---------------------------------------------------------------

    def rejected(self) -> None:
        self.requests.labels("rejected").inc()

    def admitted(self, prompt_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)

    def first_admission(self, seq) -> None:
        self.queue_time.observe(seq.admitted_time - seq.arrival)

    def first_token(self, seq) -> None:
        self.ttft.observe(seq.first_token_time - seq.arrival)
        if seq.admitted_time is not None:
            self.prefill_time.observe(seq.first_token_time - seq.admitted_time)

    def prefill_call(self, seconds: float, tokens: int, padded: int) -> None:
        self.prefill_calls.inc()
        self.prefill_seconds.inc(seconds)
        self.prefill_tokens.inc(tokens)
        self.prefill_padded.inc(padded)

    def tokens_out(self, seq, n: int) -> None:
        self.generation_tokens.inc(n)

    def prefix_lookup(self, prompt_tokens: int, hit: int) -> None:
        """A request's first admission: its prompt against the prefix cache."""
        self.prefix_queries.inc(prompt_tokens)
        self.prefix_hits.inc(hit)
        self._queried += prompt_tokens
        self._hit += hit
        self.prefix_hit_rate.set(self._hit / self._queried if self._queried else 0.0)

    def preempted(self) -> None:
        self.preemptions.inc()

    def finished(self, seq, reason: str) -> None:
        self.requests.labels(reason).inc()
        if seq.first_token_time is not None and seq.num_generated > 1:
            self.tpot.observe((time.perf_counter() - seq.first_token_time) / (seq.num_generated - 1))

    def decode_call(self, k: int, bucket: tuple[int, int], accept_lens, drafted: int, depth: int, adaptive,
                    seconds: float = 0.0, tokens: int = 0) -> None:
        """drafted: draft tokens per verify step (tree nodes); depth: positions along one path; seconds
        and tokens: the call's wall time and the tokens it committed."""
        self.decode_calls.inc()
        labels = (str(k), str(bucket[0]))
        self.calls_by_length.labels(*labels).inc()
        self.seconds_by_length.labels(*labels).inc(seconds)
        self.tokens_by_length.labels(*labels).inc(tokens)
        self.num_draft_tokens.set(drafted)
        current = adaptive.current if adaptive is not None else {bucket: k}
        for (b, ctx), steps in current.items():
            self.num_steps.labels(str(b), str(ctx)).set(steps)
        self.verify_calls.inc(len(accept_lens))
        for a in accept_lens:
            self.accept_length.observe(a)
            for i in range(depth):
                self._reached[i] += 1
                self._passed[i] += a - 1 > i
        # Rate along the accepted path (tau - 1) / depth, so chains and trees compare.
        self._accepted += sum(a - 1 for a in accept_lens)
        self._proposed += depth * len(accept_lens)
        if self._proposed:
            self.accept_rate.set(self._accepted / self._proposed)
        for i in range(depth):
            if self._reached[i]:
                self.position_acceptance.labels(str(i + 1)).set(self._passed[i] / self._reached[i])

    def update_state(self, sched) -> None:
        self.running.set(sched.num_active)
        self.waiting.set(len(sched.waiting))
        self.pages_used.set(sched.allocator.num_used)
        self.pages_free.set(sched.allocator.num_free)
        self.pages_cached.set(sum(getattr(p, "num_cached", 0) for p in sched._pools))
        evicted = sum(getattr(p, "evicted_pages", 0) for p in sched._pools)
        self.evicted.inc(evicted - self._evicted_seen)
        self._evicted_seen = evicted
