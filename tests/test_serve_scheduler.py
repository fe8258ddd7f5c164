"""The scheduler without HTTP: served tree plans, a standalone draft model through preemption.

Reference: plain greedy `Engine.generate` of the same tiny target.
"""

from __future__ import annotations

import pytest

from jaxspec.config import EngineSection, apply_overrides, load_config
from jaxspec.engine import Engine, Request
from jaxspec.sampling_params import SamplingParams
from jaxspec.models.loading import load_model
from jaxspec.serve.scheduler import Seq, Status
from jaxspec.serve.server import build_server

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57,
                                             58, 59, 60, 61], [100, 3, 100, 3, 100], [9], [77, 78, 77, 78, 77, 78, 77]]
NEW = 40


def run_all(server, prompts, new, after_step=None):
    """Submit everything at once and step the scheduler until all finish: tokens per prompt, and the
    sequences. `after_step(scheduler)` runs after every step (state probes)."""
    sched, got, seqs = server.scheduler, {}, []
    for i, p in enumerate(prompts):
        seqs.append(Seq(list(p), SamplingParams(max_tokens=new),
                        lambda e, i=i: got.setdefault(i, []).extend(e.token_ids)))
        sched.submit(seqs[-1])
    for _ in range(10_000):
        if all(s.status == Status.FINISHED for s in seqs):
            break
        sched.step()
        if after_step is not None:
            after_step(sched)
    assert all(s.finish_reason == "length" for s in seqs)
    assert server.runner.allocator.num_used == 0  # every page back
    return [got[i] for i in range(len(prompts))], seqs


def submitter(sched, got):
    """submit(i, new, params=None, key=None): PROMPTS[i] for `new` tokens (or `params`, which a
    request's samples share), its tokens collected under got[key] (default i); returns the Seq."""

    def submit(i, new, params=None, key=None):
        key = i if key is None else key
        seq = Seq(list(PROMPTS[i]), params or SamplingParams(max_tokens=new),
                  lambda e: got.setdefault(key, []).extend(e.token_ids))
        sched.submit(seq)
        return seq

    return submit


def step_until(sched, cond, limit=200):
    for _ in range(limit):
        if cond():
            return
        sched.step()
    raise AssertionError("the scheduler did not get there")


@pytest.fixture(scope="module")
def reference(tiny_dirs):
    path, _ = tiny_dirs["llama"]
    m = load_model(path, progress=False)
    engine = Engine(m.params, m.config, EngineSection(max_batch_size=8, max_context=128, length_buckets=(32, 64, 128)),
                    progress=False)
    return [r.output_ids for r in engine.generate([Request(p, SamplingParams(max_tokens=NEW)) for p in PROMPTS])]


def config(path, **extra):
    return apply_overrides(load_config(None), {
        "model.path": str(path), "engine.max_batch_size": 4, "engine.batch_buckets": "4",
        "engine.max_context": 128, "engine.page_size": 4, "engine.length_buckets": "16,32,128",
        "serve.context_buckets": "64", "serve.prefill_chunk": 16, "serve.max_prefill_batch": 2,
        "serve.steps_per_call": 3, "serve.compilation_cache": "off", "spec.verify": "rejection", **extra})


def test_served_ngram_tree_plan_is_exact(tiny_dirs, reference):
    path, _ = tiny_dirs["llama"]
    # Four prefill rows of 8 or 16 tokens (budget 32): the planner's partial chunks, several per call.
    server = build_server(config(path, **{"spec.algorithm": "ngram", "spec.topk": 2, "spec.num_steps": 3,
                                          "spec.num_draft_tokens": 8, "serve.adaptive": False,
                                          "engine.length_buckets": "8,16,32,128", "serve.max_prefill_batch": 4,
                                          "serve.prefill_tokens": 32, "serve.context_buckets": "16,64",
                                          "serve.prefill_piece": 0}),
                          progress=False)
    assert server.runner.prefill_shapes == ((4, 8), (4, 16))
    assert not server.runner.plans[7].chain  # the fixed tree is served as configured
    # Prefill calls attend over the context bucket of their furthest chunk end: 16 for the first
    # chunks, 64 for the 22-token prompt's second; the reference engine's table is 128 wide.
    run_prefill, widths, padded = server.runner.run_prefill, [], []
    server.runner.run_prefill = lambda key, x: (widths.append((key[3], x["table"].shape[1])),
                                                padded.append(x["tokens"].size))[0] or run_prefill(key, x)
    got, _ = run_all(server, PROMPTS, NEW)
    assert got == reference
    assert set(widths) == {(16, 4), (64, 16)}
    # /metrics counts what the calls ran: rows (padding rows included) x chunk bucket.
    from prometheus_client.parser import text_string_to_metric_families

    values = {m.name: m.value for f in text_string_to_metric_families(server.metrics.render().decode())
              for m in f.samples}
    assert values["jaxspec_prefill_padded_tokens_total"] == sum(padded)
    assert values["jaxspec_prefill_calls_total"] == len(padded)
    text = server.metrics.render().decode()
    assert "jaxspec_spec_position_acceptance" in text and server.runner.allocator.num_used == 0


@pytest.mark.parametrize("algorithm", ["none", "ngram"])
def test_packed_prefill_is_exact(tiny_dirs, reference, algorithm):
    """Packed prefill: the 22-token prompt takes several 4-token rows of one call (pieces of one
    sequence over one page table, the later ones attending to the earlier ones' K/V written in the
    same layer), short prompts share the call; greedy output equals plain `Engine.generate`, with
    speculation off and with n-gram drafts (a drafter without per-sequence state). Positive control:
    the same run with the rows' page tables cleared for all but each sequence's first piece
    (a later piece then reads another page) must differ."""
    path, _ = tiny_dirs["llama"]
    overrides = {"spec.algorithm": algorithm, "serve.prefill_piece": 4, "serve.prefill_tokens": 24,
                 "serve.adaptive": False}
    server = build_server(config(path, **overrides), progress=False)
    r = server.runner
    assert r.prefill_piece == 4 and r.prefill_batches == (1, 2, 4) and r.prefill_shapes == ((1, 4), (2, 4), (4, 4))
    run_prefill, calls = r.run_prefill, []

    def spy(key, x):
        calls.append((x["slots"].tolist(), x["q_start"].tolist(), x["lens"].tolist()))
        return run_prefill(key, x)

    r.run_prefill = spy
    got, _ = run_all(server, PROMPTS, NEW)
    assert got == reference
    # Some call gave one sequence several rows (its slot twice, consecutive starts).
    assert any(len({s for s, n in zip(slots, lens) if n}) < sum(1 for n in lens if n) for slots, _, lens in calls)
    assert all(max(lens) <= 4 for _, _, lens in calls)
    if algorithm != "none":  # one positive control is enough
        return

    def broken(key, x):  # positive control: later pieces lose their page table
        first = {}
        for i, (slot, start) in enumerate(zip(x["slots"].tolist(), x["q_start"].tolist())):
            if x["lens"][i] and first.setdefault(slot, start) != start:
                x["table"][i] = 0
        return run_prefill(key, x)

    server = build_server(config(path, **overrides), progress=False)
    run_prefill = server.runner.run_prefill
    server.runner.run_prefill = broken
    bad, _ = run_all(server, PROMPTS, NEW)
    assert bad != reference


def test_standalone_drafter_through_preemption_is_exact(tiny_dirs, reference):
    """A pool of 24 pages x 4 slots cannot hold five 50-token sequences with their lookahead:
    sequences get preempted, recomputed (target and draft caches), and still match."""
    path, _ = tiny_dirs["llama"]
    server = build_server(config(path, **{"spec.algorithm": "standalone", "spec.draft_layers": 1,
                                          "spec.num_draft_tokens": 4, "serve.adaptive_steps": "0,3",
                                          "engine.num_pages": 25}), progress=False)
    from jaxspec.engine.adaptive import calibrate

    calibrate(server.runner)
    server.scheduler.adaptive.cost.update(server.runner.decode_seconds)
    got, seqs = run_all(server, PROMPTS, NEW)
    assert got == reference
    assert sum(s.num_preemptions for s in seqs) > 0
    assert server.runner.allocator.num_used == 0


def test_abort_all_ends_every_request_and_any_that_arrives_after_it(tiny_dirs):
    """Shutdown (issue 23), seen once in a clean-clone `make test` as a stream cut mid-way:
    abort_all raised (deque + list) on the scheduler thread, whose error handler ended only the
    running requests, so a waiting one was admitted later and cut by the exit; and a request that
    passed the server's draining check but reached the inbox after abort_all was started too. Now
    every waiting, running and later request ends with "abort" (an error event and [DONE])."""
    path, _ = tiny_dirs["llama"]
    server = build_server(config(path), progress=False)
    sched, events = server.scheduler, {}

    def seq(name):
        return Seq([5, 6, 7], SamplingParams(max_tokens=40),
                   lambda e: events.setdefault(name, []).append(e.finish_reason))

    running = seq("running")
    sched.submit(running)
    sched.step()  # control: an open scheduler admits it (its prefill runs)
    assert running.status != Status.FINISHED and running not in sched.waiting and not sched.closed
    queued = seq("queued")
    sched.submit(queued)  # in the inbox ahead of abort_all: waiting when it is processed
    sched.abort_all("the server is shutting down")
    late = seq("late")
    sched.submit(late)
    sched.step()
    assert sched.closed and sched.last_error == "the server is shutting down"
    assert [s.finish_reason for s in (running, queued, late)] == ["abort"] * 3
    assert events["queued"] == ["abort"] and events["late"] == ["abort"]
    assert late.tokens == late.prompt_ids and queued.tokens == queued.prompt_ids  # neither prefilled
    assert not sched.waiting and sched.num_active == 0 and server.runner.allocator.num_used == 0


@pytest.mark.parametrize("calls", [3, 1], ids=["prefill-first", "control-alternate"])
def test_prefill_calls_per_step_prefill_arrivals_before_the_decode_call(tiny_dirs, reference, calls):
    """serve.prefill_calls_per_step: a step runs up to that many prefill calls back to back, and a
    request that arrives during one is admitted and prefilled before the step's decode call. The
    control (1, the default) alternates: one prefill call, then the decode call. Output is exact."""
    path, _ = tiny_dirs["llama"]
    # One row per sequence (not packed): the prompts need more calls than the step allows.
    server = build_server(config(path, **{"serve.prefill_calls_per_step": calls, "serve.adaptive": False,
                                          "serve.prefill_piece": 0}), progress=False)
    sched, r, log = server.scheduler, server.runner, []
    run_prefill, run_decode = r.run_prefill, r.run_decode
    got, late = {}, []

    def prefill(key, x):
        log.append("p")
        if len(log) == 1:  # the last prompt arrives while the first prefill call runs
            late.append(Seq(list(PROMPTS[-1]), SamplingParams(max_tokens=NEW),
                            lambda e: got.setdefault(4, []).extend(e.token_ids)))
            sched.submit(late[0])
        return run_prefill(key, x)

    r.run_prefill = prefill
    first_decode = []  # the arrival's state at the first decode call

    def decode(key, x):
        if "d" not in log:
            first_decode.append(late[0].status)
        log.append("d")
        return run_decode(key, x)

    r.run_decode = decode
    for i, p in enumerate(PROMPTS[2:4]):
        sched.submit(Seq(list(p), SamplingParams(max_tokens=NEW),
                         lambda e, i=i: got.setdefault(i, []).extend(e.token_ids)))
    for _ in range(10_000):  # bounded: a stuck scheduler fails the test instead of hanging it
        if late and late[0].status == Status.FINISHED and not sched.busy():
            break
        sched.step()
        log.append("|")
    assert [got[0], got[1], got[4]] == [reference[2], reference[3], reference[4]]
    steps = "".join(log).split("|")
    assert max(s.count("p") for s in steps) == calls
    # Prefill-first: the arrival is running by the first decode call; alternating, it waits for it.
    assert first_decode == [Status.RUNNING if calls > 1 else Status.WAITING]
    assert r.allocator.num_used == 0


@pytest.mark.parametrize("yield_steps", [1, 0], ids=["yield", "control-full-calls"])
def test_decode_calls_shorten_while_a_prefill_waits(tiny_dirs, reference, yield_steps):
    """serve.yield_steps: while a prompt has prefill chunks left (or a request waits), the running
    batch's decode call runs that many iterations (a runtime input of the same program), so the
    next prefill call comes sooner; with nothing waiting it runs all steps_per_call (3). The control
    (0) runs full calls throughout, so some call made while a prefill waited ran more than one
    iteration. Output is exact either way."""
    path, _ = tiny_dirs["llama"]
    # One 16-token row per sequence and call: the 22-token prompt needs two calls, the 10-token one
    # arrives once the first two decode.
    server = build_server(config(path, **{"serve.yield_steps": yield_steps, "serve.adaptive": False,
                                          "serve.prefill_piece": 0, "serve.max_prefill_batch": 1,
                                          "serve.follow_up_window": 0}), progress=False)
    sched, r = server.scheduler, server.runner
    assert sched.yield_steps == yield_steps
    run_decode, calls = r.run_decode, []

    def decode(key, x):
        waits = sched._prefill_waits()  # what the scheduler saw choosing this call's length
        out = run_decode(key, x)
        calls.append((waits, int(x["iter_budget"].max()), int(out[4].max())))
        return out

    r.run_decode = decode
    got, _ = run_all(server, PROMPTS, NEW)
    assert got == reference
    waited = [(budget, ran) for waits, budget, ran in calls if waits]
    free = [(budget, ran) for waits, budget, ran in calls if not waits]
    assert waited and free
    assert all(budget == 3 for budget, _ in free) and max(ran for _, ran in free) == 3
    if yield_steps:
        assert all(budget == ran == 1 for budget, ran in waited)
    else:
        assert all(budget == 3 for budget, _ in waited) and max(ran for _, ran in waited) > 1


def test_only_a_request_admission_can_take_shortens_decode_calls(tiny_dirs, reference):
    """serve.yield_steps under page pressure (24 pages cannot hold five 50-token rows): a waiting
    request with a batch slot free but no pages cannot be admitted until rows finish or pages free,
    so the running batch's calls stay full (3 iterations); one-iteration calls there only multiplied
    the calls. Controls: such page-starved waits occur here (preemptions put rows back in the
    queue), so the old slot-only rule would have shortened them; and a request that admission can
    take does shorten them: the second sample of a prompt, held back until the first's prefill
    publishes the shared pages, is admissible at the first's first decode call."""
    path, _ = tiny_dirs["llama"]
    server = build_server(config(path, **{"serve.yield_steps": 1, "serve.adaptive": False, "engine.num_pages": 25,
                                          "serve.prefill_piece": 0, "serve.follow_up_window": 0}), progress=False)
    sched, r = server.scheduler, server.runner
    run_decode, calls = r.run_decode, []

    def decode(key, x):
        slot_free = bool(sched.waiting) and sched.num_active < sched.max_batch_size
        admissible = slot_free and sched._admission(sched.waiting[0])[1] is not None
        calls.append((slot_free and not sched.prefilling, admissible, int(x["iter_budget"].max())))
        return run_decode(key, x)

    r.run_decode = decode
    got, _ = run_all(server, [PROMPTS[0]] * 2, NEW)
    assert got == [reference[0]] * 2
    assert calls[0] == (True, True, 1)
    calls.clear()
    got, seqs = run_all(server, PROMPTS, NEW)
    assert got == reference
    assert sum(s.num_preemptions for s in seqs) > 0
    starved = [budget for waits, admissible, budget in calls if waits and not admissible]
    assert starved, "control: no call saw a request waiting for pages with a slot free"
    assert all(budget == 3 for budget in starved)


@pytest.mark.parametrize("window", [60.0, 0.0], ids=["window", "control-off"])
def test_decode_calls_stay_short_until_the_follow_ups_arrive(tiny_dirs, reference, window):
    """serve.follow_up_window: after decode calls end requests, the next calls run yield_steps (1)
    iterations until as many new requests have arrived (a client at a fixed concurrency sends its
    next one at once), then full calls again (3). Here two short requests end beside a long one,
    one of them with two samples (n = 2: one request, one follow-up due, not two); one follow-up
    arrives two calls later, the other never, so calls stay short until the window closes (60 s,
    so wall time cannot close it early; the test then closes it and waits it out). Control:
    window 0 runs full calls after the ends. Output is exact throughout."""
    import time

    path, _ = tiny_dirs["llama"]
    server = build_server(config(path, **{"serve.yield_steps": 1, "serve.adaptive": False, "spec.algorithm": "none",
                                          "serve.follow_up_window": window}), progress=False)
    sched, r = server.scheduler, server.runner
    run_decode, budgets = r.run_decode, []

    def decode(key, x):
        budgets.append(int(x["iter_budget"].max()))
        return run_decode(key, x)

    r.run_decode = decode
    got = {}
    submit = submitter(sched, got)

    # 1. Two 7-token requests end, b with two samples (the server shares one params object between
    #    a request's samples); the 40-token one runs on.
    long = submit(1, NEW)
    pair = SamplingParams(max_tokens=7)
    a, b, b2 = submit(0, 7), submit(3, 7, pair), submit(3, 7, pair, key="b2")
    step_until(sched, lambda: a.status == b.status == b2.status == Status.FINISHED)
    assert long.status == Status.RUNNING
    assert sched.follow_ups.expected == (2 if window else 0)
    # 2. Two calls with both follow-ups outstanding, then one arrives.
    budgets.clear()
    sched.step(), sched.step()
    assert budgets == [1 if window else 3] * 2
    d = submit(4, 4)
    step_until(sched, lambda: d.status == Status.FINISHED)
    assert long.status == Status.RUNNING
    # 3. b's follow-up and d's are outstanding: short calls until the window closes.
    assert sched.follow_ups.expected == (2 if window else 0)
    budgets.clear()
    sched.step()
    assert budgets == [1 if window else 3]
    sched.follow_ups.until = min(sched.follow_ups.until, time.perf_counter() + 0.05)
    time.sleep(0.1)
    budgets.clear()
    sched.step()
    assert budgets == [3]
    step_until(sched, lambda: long.status == Status.FINISHED)
    assert got == {1: reference[1], 0: reference[0][:7], 3: reference[3][:7], "b2": reference[3][:7],
                   4: reference[4][:4]}
    assert r.allocator.num_used == 0


@pytest.mark.parametrize("grace", [30.0, 0.0], ids=["grace", "control-off"])
def test_the_next_call_waits_for_a_follow_up_to_join_it(tiny_dirs, reference, grace, tmp_path):
    """serve.follow_up_grace: after a request ends, the next step holds (up to the grace) until its
    follow-up reaches the inbox, so the follow-up is prefilled in that step instead of after it.
    The follow-up is sent 50 ms after the end from another thread (as an HTTP client would); a
    30 s grace cannot run out first. Control: grace 0 starts the step at once, without it. Output
    is exact either way. The run is traced (serve.trace): the timeline accounts for every token the
    requests received and for the held step, and `bench trace` splits each time to first token
    into parts that add up to it."""
    import threading

    path, _ = tiny_dirs["llama"]
    server = build_server(config(path, **{"serve.yield_steps": 1, "serve.adaptive": False, "spec.algorithm": "none",
                                          "serve.follow_up_window": 60.0, "serve.follow_up_grace": grace,
                                          "serve.trace": str(tmp_path)}),
                          progress=False)
    sched = server.scheduler
    got = {}
    submit = submitter(sched, got)
    long, a = submit(1, NEW), submit(0, 5)
    step_until(sched, lambda: a.status == Status.FINISHED)
    assert long.status == Status.RUNNING
    box = {}
    sender = threading.Timer(0.05, lambda: box.setdefault("seq", submit(4, 4)))
    sender.start()
    sched.step()
    sender.join()
    follow = box["seq"]
    assert (follow.first_token_time is not None) == bool(grace)
    assert sched.follow_ups.num_waits == (1 if grace else 0)
    sched.follow_ups.grace = 0.0  # the follow-up's own follow-up never comes: do not wait 30 s for it
    step_until(sched, lambda: long.status == follow.status == Status.FINISHED)
    assert got == {1: reference[1], 0: reference[0][:5], 4: reference[4][:4]}
    assert server.runner.allocator.num_used == 0
    check_trace(sched.trace.path, {long: 1, a: 0, follow: 4}, got, held=bool(grace))


def check_trace(path, seqs, got, held):
    """The trace file against what the requests received: each request's first token from one
    prefill call and the rest from decode calls that list it, a held step iff `held`."""
    from jaxspec.bench import trace as bench_trace

    settings, calls, requests = bench_trace.read(path)
    assert settings["prefix_cache"] is True and settings["spec"] == "none"
    assert sum(c["ev"] == "wait" for c in calls) == int(held)
    assert {r["id"] for r in requests} == {s.seq_id for s in seqs}
    starts = [c["t0"] for c in calls]
    for r in requests:
        seq = next(s for s in seqs if s.seq_id == r["id"])
        assert r["arrival"] <= r["admitted"] <= r["first_token"] <= r["end"]
        assert r["generated"] == len(got[seqs[seq]]) and r["reason"] == "length"
        decoded = sum(c["tokens"][c["seqs"].index(r["id"])] for c in calls if c["ev"] == "decode" and r["id"] in c["seqs"])
        assert 1 + decoded == r["generated"]  # the first token is the prefill's
        assert sum(r["id"] in c["seqs"] for c in calls if c["ev"] == "prefill") >= 1
        parts = bench_trace.ttft_parts(r, calls, starts)
        assert parts["own prefill"] > 0 and min(parts.values()) > -1e-9
        assert abs(sum(parts.values()) - (r["first_token"] - r["arrival"])) < 1e-9
    assert "server TTFT over 3 requests" in bench_trace.summarize(path)


def test_one_iteration_calls_cross_a_history_bucket_exactly(tiny_dirs, monkeypatch):
    """steps_per_call = 1 without a drafter: a 60-token prompt reaches 64 tokens, the smallest
    history bucket's edge, where the cache needs 64 slots but the history 65 tokens. The call
    takes the next bucket and the output equals `Engine.generate`. Control: sizing the history by
    the cache slots alone drops the token on the device, and the scheduler refuses the call that
    committed nothing instead of repeating it forever."""
    from jaxspec.serve.scheduler import Scheduler

    path, _ = tiny_dirs["llama"]
    prompt = [3 + (7 * i) % 90 for i in range(60)]
    m = load_model(path, progress=False)
    engine = Engine(m.params, m.config, EngineSection(max_batch_size=4, max_context=128, length_buckets=(32, 64, 128)),
                    progress=False)
    want = engine.generate([Request(prompt, SamplingParams(max_tokens=10))])[0].output_ids

    def run():
        server = build_server(config(path, **{"serve.steps_per_call": 1, "spec.algorithm": "none",
                                              "serve.adaptive": False}), progress=False)
        got, seq = [], Seq(list(prompt), SamplingParams(max_tokens=10), lambda e: got.extend(e.token_ids))
        server.scheduler.submit(seq)
        for _ in range(100):
            if seq.status == Status.FINISHED:
                break
            server.scheduler.step()
        return got, seq

    got, seq = run()
    assert seq.finish_reason == "length" and got == want
    monkeypatch.setattr(Scheduler, "_history_need", lambda self, s: 0)
    with pytest.raises(RuntimeError, match="committed no token"):
        run()


def _tree_shapes(inputs: dict) -> dict:
    import jax

    return jax.tree.map(lambda x: (x.shape, x.dtype), inputs)


def test_multihost_templates_match_every_call_the_leader_makes(tiny_dirs, reference):
    """A multi-host follower receives each call's inputs into `multihost.input_template` (a broadcast
    needs the same tree on every process). Every prefill and decode call of a served run (packed
    prefill, yielded decode calls) has exactly the template's keys, shapes and dtypes; the control, a
    template missing the decode call's iteration budget (as a hand-kept template could), differs."""
    from jaxspec.serve.multihost import input_template

    path, _ = tiny_dirs["llama"]
    server = build_server(config(path, **{"serve.adaptive": False}), progress=False)
    r, seen = server.runner, []
    for name in ("run_prefill", "run_decode"):
        def spy(key, x, run=getattr(r, name)):
            seen.append((key, _tree_shapes(x)))
            return run(key, x)
        setattr(r, name, spy)
    got, _ = run_all(server, PROMPTS, NEW)
    assert got == reference
    assert {key[0] for key, _ in seen} == {"prefill", "decode"}
    for key, shapes in seen:
        assert _tree_shapes(input_template(r, key)) == shapes, key
    key, shapes = next((key, s) for key, s in seen if key[0] == "decode")
    partial = {k: v for k, v in input_template(r, key).items() if k != "iter_budget"}
    assert _tree_shapes(partial) != shapes
