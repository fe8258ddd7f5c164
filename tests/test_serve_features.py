"""Feature drafters (EAGLE-3, Medusa) served: the scheduler without HTTP, and one HTTP smoke test.

References: plain greedy `Engine.generate` of the same tiny target (answers), and an
independent target forward over each finished sequence (the drafter state).

Greedy verification is lossless whatever the drafts are, so equal answers alone cannot
show that the per-slot drafter store (`ModelRunner.store`: the pending target feature
of each sequence) follows its sequence: with random heads acceptance is ~0 and a state
leak would not even move the acceptance numbers. `StateProbe` checks the store
directly: after every scheduler step, each running sequence's slot must hold the target
feature of its newest cached token (position len(tokens) - 2), which a plain forward of
the finished sequence gives (causal: the feature at p depends on tokens[:p + 1] only).
Positive control: a scheduler handing every row slot 0 still answers exactly, and the
probe reports the leak.
"""

from __future__ import annotations

import httpx
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.cache.paged import KVCache
from jaxspec.config import EngineSection
from jaxspec.engine import Engine, Request
from jaxspec.sampling_params import SamplingParams
from jaxspec.models.llama import forward, prepare_params
from jaxspec.models.loading import load_model
from jaxspec.serve.server import build_server
from tests.heads_fixtures import write_block_head, write_eagle3_head, write_frozen_kv_head, write_medusa_head
from tests.test_serve_scheduler import NEW, PROMPTS, config, run_all


@pytest.fixture(scope="module")
def world(tiny_dirs, tmp_path_factory):
    path, hf = tiny_dirs["llama"]
    tmp = tmp_path_factory.mktemp("serve_heads")
    model = load_model(path, progress=False)
    engine = Engine(model.params, model.config, EngineSection(max_batch_size=8, max_context=128,
                                                              length_buckets=(32, 64, 128)), progress=False)
    reference = [r.output_ids for r in engine.generate([Request(p, SamplingParams(max_tokens=NEW)) for p in PROMPTS])]
    return dict(path=path, model=model, reference=reference,
                eagle3=write_eagle3_head(tmp / "eagle3", hf, layer_ids=[0, 1, 2], convention="input"),
                medusa=write_medusa_head(tmp / "medusa", hf, num_heads=3),
                dflash=write_block_head(tmp / "dflash", hf, kind="dflash", layer_ids=(0,)),
                dspark=write_block_head(tmp / "dspark", hf, kind="dspark", block_size=5, layer_ids=(0,)),
                frozen_kv=write_frozen_kv_head(tmp / "frozen_kv", hf, draft_vocab_size=64))


EAGLE3 = lambda w: {"spec.algorithm": "eagle3", "spec.draft_model": str(w["eagle3"]),  # noqa: E731
                    "spec.eagle3_layer_ids": "input"}
MEDUSA = lambda w: {"spec.algorithm": "medusa", "spec.draft_model": str(w["medusa"])}  # noqa: E731
FROZEN_KV = lambda w: {"spec.algorithm": "nextn", "spec.draft_model": str(w["frozen_kv"])}  # noqa: E731


class StateProbe:
    """Snapshots (seq, slot, tokens so far, its slot's pending feature) after each step; `mismatches`
    compares them with the target's own features of the finished sequences."""

    def __init__(self, server, model):
        self.runner, self.model = server.runner, model
        self.snaps = []

    def __call__(self, sched):
        pending = np.asarray(self.runner.store[1].pending)
        for s in sched.running:
            self.snaps.append((s, s.slot, len(s.tokens), pending[s.slot].copy()))

    def features(self, seqs):
        """The target's features at every position of each sequence: one jitted forward over all of
        them, padded to one shape (causal, so padding after a sequence does not change its features)."""
        cfg, want = self.model.config, self.runner.drafter.target_features
        target = prepare_params(self.model.params, cfg, unstack=False)
        b, t = len(seqs), 128
        tokens = np.zeros((b, t), np.int32)
        for i, s in enumerate(seqs):
            tokens[i, : len(s.tokens)] = s.tokens
        cache = KVCache.zeros(cfg.num_layers, b * t // 16 + 1, 16, cfg.num_kv_heads, cfg.head_dim)
        table = np.arange(1, b * t // 16 + 1, dtype=np.int32).reshape(b, t // 16)
        out = forward(target, cfg, jnp.asarray(tokens), jnp.broadcast_to(jnp.arange(t), (b, t)), cache,
                      jnp.asarray(table), q_start=jnp.zeros((b,), jnp.int32), kv_len=jnp.full((b,), t),
                      capture_layers=want.layers, capture_final=want.final_norm)
        return {id(s): f for s, f in zip(seqs, np.asarray(out.features))}

    def mismatches(self):
        feats = self.features(list({id(s): s for s, _, _, _ in self.snaps}.values()))
        bad = [(s.seq_id, n) for s, _, n, got in self.snaps
               if not np.allclose(got, feats[id(s)][n - 2], rtol=1e-4, atol=1e-5)]
        return bad, len(self.snaps)


# 5 prompts of 1..22 tokens, 4 batch slots: rows join and leave between calls and slots are reused;
# 25 pages x 4 tokens cannot hold them all with their lookahead: rows get preempted and recomputed.
# FROZEN_KV_MTP (selected from --spec nextn by its head, as SGLang promotes): its seed is the probed
# pending feature, and the target K/V it reads are the verify's own pages through the same page table,
# so a re-prefilled row whose pages were wrong would already fail the answers.
@pytest.mark.parametrize("head, spec", [
    ("eagle3", {"spec.num_draft_tokens": 4}),  # chain of 3
    ("medusa", {"spec.topk": 2, "spec.num_steps": 2, "spec.num_draft_tokens": 5}),  # fixed tree
    ("frozen_kv", {"spec.topk": 2, "spec.num_steps": 2, "spec.num_draft_tokens": 4}),  # EAGLE-2 tree
])
def test_feature_drafter_through_preemption_is_exact(world, head, spec):
    extra = {**{"eagle3": EAGLE3, "medusa": MEDUSA, "frozen_kv": FROZEN_KV}[head](world), **spec,
             "serve.adaptive": False, "engine.num_pages": 25}
    server = build_server(config(world["path"], **extra), model=world["model"], progress=False)
    assert server.runner.drafter.target_kv_layers == ((0, 1) if head == "frozen_kv" else ())
    probe = StateProbe(server, world["model"])
    got, seqs = run_all(server, PROMPTS, NEW, probe)
    assert got == world["reference"]
    assert sum(s.num_preemptions for s in seqs) > 0
    owners = {}
    for seq, slot, _, _ in probe.snaps:
        owners.setdefault(slot, set()).add(seq.seq_id)
    assert len(owners) >= 3 and max(len(o) for o in owners.values()) >= 2  # slots get reused
    bad, n = probe.mismatches()
    assert n > 50 and not bad, bad


# DSPARK only: the block path is DFLASH's plus the Markov head and the planner (ragged rows).
@pytest.mark.parametrize("alg", ["dspark"])
def test_block_drafter_through_preemption_is_exact(world, tmp_path, alg):
    """A block drafter's only state is its context cache, which follows each sequence's pages (no
    per-slot row): served through preemption and recompute, answers equal plain greedy. DSPARK runs
    with a falling SPS table, so its rows are ragged."""
    from tests.test_block_drafters import falling_table

    extra = {"spec.algorithm": alg, "spec.draft_model": str(world[alg]), "spec.num_draft_tokens": 6,
             "spec.sps_table": str(falling_table(tmp_path / "sps.json")) if alg == "dspark" else "default",
             "serve.adaptive": False, "engine.num_pages": 25}
    server = build_server(config(world["path"], **extra), model=world["model"], progress=False)
    got, seqs = run_all(server, PROMPTS, NEW)
    assert got == world["reference"]
    assert sum(s.num_preemptions for s in seqs) > 0


def test_block_drafter_serves_with_the_default_adaptive_policy(world, tmp_path):
    """Issue 23: `serve --spec dspark` exited at start-up under the default adaptive steps (its
    k = 0 plan asked the block drafter for one token). Built with the defaults, the policy pinned
    to switch between k = 0 and k > 0 mid-request, answers equal plain greedy."""
    from tests.test_block_drafters import falling_table

    extra = {"spec.algorithm": "dspark", "spec.draft_model": str(world["dspark"]),
             "spec.sps_table": str(falling_table(tmp_path / "sps.json"))}
    server = build_server(config(world["path"], **extra), model=world["model"], progress=False)
    sched = server.scheduler
    assert sched.adaptive is not None and 0 in server.runner.candidates and max(server.runner.candidates) > 1
    schedule, used = [0, max(server.runner.candidates), 0, 0, 1], []

    def choose(bucket):
        used.append(schedule[len(used) % len(schedule)])
        return used[-1]

    sched.adaptive.choose = choose
    got, _ = run_all(server, PROMPTS, NEW)
    assert got == world["reference"]
    assert len(used) > len(schedule)


def test_adaptive_k0_calls_keep_the_drafter_state(world):
    """serve.adaptive with draft lengths (0, 1, 3); the policy is pinned to a schedule with
    runs of k = 0 calls between k > 0 ones, so a k > 0 call always follows k = 0 calls."""
    extra = {**EAGLE3(world), "serve.adaptive": True, "serve.adaptive_steps": "0,1,3", "engine.num_pages": 25}
    server = build_server(config(world["path"], **extra), model=world["model"], progress=False)
    sched = server.scheduler
    assert server.runner.candidates == (0, 1, 3) and sched.adaptive is not None
    schedule, used = [0, 0, 3, 0, 1, 0, 0, 0, 3, 3], []

    def choose(bucket):
        used.append(schedule[len(used) % len(schedule)])
        return used[-1]

    sched.adaptive.choose = choose
    probe = StateProbe(server, world["model"])
    got, seqs = run_all(server, PROMPTS, NEW, probe)
    assert got == world["reference"]
    assert {0, 1, 3} <= set(used) and len(used) > len(schedule)
    assert sched.adaptive.observed[0]  # the k > 0 calls' acceptance reached the policy
    bad, n = probe.mismatches()
    assert n > 50 and not bad, bad


def _run_sampled(server, prompts, params, schedule):
    """Step the scheduler over `prompts` with (SamplingParams, seed) `params` and the adaptive policy pinned to
    cycle through `schedule` (draft lengths): the tokens per prompt."""
    from jaxspec.serve.scheduler import Seq, Status

    sched, got = server.scheduler, {}
    used = []

    def choose(bucket):
        used.append(schedule[len(used) % len(schedule)])
        return used[-1]

    sched.adaptive.choose = choose
    seqs = [Seq(list(p), sp, lambda e, i=i: got.setdefault(i, []).extend(e.token_ids), seed=seed)
            for i, (p, (sp, seed)) in enumerate(zip(prompts, params))]
    for q in seqs:
        sched.submit(q)
    for _ in range(10_000):
        if all(q.status == Status.FINISHED for q in seqs):
            break
        sched.step()
    assert len(set(used)) > 1
    return [got[i] for i in range(len(prompts))]


SAMPLED_SPECS = {
    "eagle3": lambda w, t: EAGLE3(w),
    "dspark": lambda w, t: {"spec.algorithm": "dspark", "spec.draft_model": str(w["dspark"]),
                            "spec.sps_table": str(falling_table_at(t))},
    "ngram": lambda w, t: {"spec.algorithm": "ngram"},
}


def falling_table_at(tmp_path):
    from tests.test_block_drafters import falling_table

    return falling_table(tmp_path / "sps.json")


# The two cases (EAGLE-3: adaptive steps; DSPARK: the planner too). Every drafter's
# coupled output equals plain sampling in tests/test_coupled.py; the server adds the policy.
@pytest.mark.parametrize("alg", ["eagle3", "dspark"])
def test_seeded_sampling_reproduces_under_adaptive_speculation(world, tmp_path, alg):
    """Issue 23: under the adaptive policy (and DSPARK's planner) a seeded request got other tokens
    on a second try, among other rows, and as choice j vs seed + j. Under the default (coupled)
    rule every seeded row gets plain sampling's tokens for its seed: the first pass (all sampled,
    k cycling 0 / max / 1), a second pass on the same server (its policy history differs) with the
    sampled rows in other slots among greedy ones, and seeds shifted by one slot (choice j = seed + j)."""
    model = world["model"]
    plain = Engine(model.params, model.config, EngineSection(max_batch_size=8, max_context=128,
                                                             length_buckets=(32, 64, 128)), progress=False)
    kw = dict(temperature=1.0, top_k=40)
    seeds = [1234 + i for i in range(len(PROMPTS))]
    want = {s: r.output_ids for s, r in zip(seeds, plain.generate(
        [Request(p, SamplingParams(max_tokens=NEW, **kw), seed=s) for p, s in zip(PROMPTS, seeds)]))}
    shifted = {s + 1: r.output_ids for s, r in zip(seeds, plain.generate(
        [Request(p, SamplingParams(max_tokens=NEW, **kw), seed=s + 1) for p, s in zip(PROMPTS, seeds)]))}
    server = build_server(config(world["path"], **SAMPLED_SPECS[alg](world, tmp_path), **{"spec.verify": "auto"}),
                          model=world["model"], progress=False)
    top = max(server.runner.candidates)
    assert server.scheduler.adaptive is not None and top > 1
    sp = lambda s: (SamplingParams(max_tokens=NEW, **kw), s)  # noqa: E731
    got = _run_sampled(server, PROMPTS, [sp(s) for s in seeds], [0, top, top, 1, top])
    assert got == [want[s] for s in seeds]
    # 2. Reversed, sampled rows between greedy copies, another schedule.
    prompts = [p for p in PROMPTS[::-1] for _ in (0, 1)]
    params = [sp(s) if j == 0 else (SamplingParams(max_tokens=NEW), 0) for s in seeds[::-1] for j in (0, 1)]
    got = _run_sampled(server, prompts, params, [top, 1, 0, top])
    assert got[::2] == [want[s] for s in seeds[::-1]]
    # 3. Seeds + 1 (what choice 1 of an n = 2 request gets).
    got = _run_sampled(server, PROMPTS, [sp(s + 1) for s in seeds], [top, 0])
    assert got == [shifted[s + 1] for s in seeds]
    assert server.runner.allocator.num_used == 0


def test_rejection_under_adaptive_speculation_is_not_reproducible_positive_control(world, tmp_path):
    """The same first pass under --verify rejection: exact in distribution only, other tokens."""
    model = world["model"]
    plain = Engine(model.params, model.config, EngineSection(max_batch_size=8, max_context=128,
                                                             length_buckets=(32, 64, 128)), progress=False)
    kw = dict(temperature=1.0, top_k=40)
    seeds = [1234 + i for i in range(len(PROMPTS))]
    want = [r.output_ids for r in plain.generate([Request(p, SamplingParams(max_tokens=NEW, **kw), seed=s)
                                                  for p, s in zip(PROMPTS, seeds)])]
    server = build_server(config(world["path"], **SAMPLED_SPECS["ngram"](world, tmp_path),
                                 **{"spec.verify": "rejection"}), model=world["model"], progress=False)
    top = max(server.runner.candidates)
    got = _run_sampled(server, PROMPTS, [(SamplingParams(max_tokens=NEW, **kw), s) for s in seeds],
                       [0, top, top, 1, top])
    assert got != want


def test_state_probe_detects_rows_sharing_one_slot(world):
    """Positive control: every row gets slot 0. Answers stay exact (greedy verify is lossless),
    so only the state probe can see the leak, and it does."""

    class OneSlot(list):
        def pop(self, *_):
            return 0

        def append(self, _):
            pass

    server = build_server(config(world["path"], **EAGLE3(world), **{"serve.adaptive": False}),
                          model=world["model"], progress=False)
    server.scheduler._free_slots = OneSlot()
    probe = StateProbe(server, world["model"])
    got, _ = run_all(server, PROMPTS, NEW, probe)
    assert got == world["reference"]
    bad, n = probe.mismatches()
    assert len(bad) > n // 4, (len(bad), n)


# ---- HTTP -------------------------------------------------------------------------------------------


def test_http_eagle3_answer_and_acceptance_metrics(chat_model_dir, tmp_path):
    from jaxspec.serve.app import create_app
    from tests.serve_util import ServerThread, client, metric, serve_config

    model = load_model(chat_model_dir, progress=False)
    head = write_eagle3_head(tmp_path / "eagle3", model.config, layer_ids=[0, 1, 2], convention="input")
    cfg = serve_config(chat_model_dir, **{
        "spec.algorithm": "eagle3", "spec.draft_model": str(head), "spec.eagle3_layer_ids": "input",
        "spec.num_draft_tokens": 4, "serve.adaptive": False, "engine.batch_buckets": "1",
        "engine.max_batch_size": 1, "serve.context_buckets": "128"})
    server = build_server(cfg, model=model, progress=False)
    thread = ServerThread(create_app(server)).start()
    try:
        server.warm_up()
        messages = [{"role": "user", "content": "Name three colours."}]
        r = client(thread.url).chat.completions.create(model=server.model_name, messages=messages, max_tokens=16,
                                                       temperature=0)
        ids = server.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        engine = Engine(model.params, model.config, EngineSection(max_batch_size=1, max_context=256,
                                                                  length_buckets=(64, 256)), progress=False)
        want = engine.generate([Request(ids, SamplingParams(max_tokens=16), stop_token_ids=server.stop_ids)])[0]
        assert r.choices[0].message.content == model.tokenizer.decode(want.output_ids, skip_special_tokens=True)
        assert r.usage.completion_tokens == len(want.output_ids)
        # Every token after prefill's was committed by a verify step; one observation per step.
        n_verify = metric(thread.url, "jaxspec_spec_verify_calls_total")
        assert metric(thread.url, "jaxspec_spec_accept_length_sum") == len(want.output_ids) - 1
        assert metric(thread.url, "jaxspec_spec_accept_length_count") == n_verify > 0
        text = httpx.get(thread.url + "/metrics").text
        for pos in ("1", "2", "3"):  # per-position acceptance of the 3-token chain
            assert f'jaxspec_spec_position_acceptance{{position="{pos}"}}' in text
        assert 'jaxspec_spec_position_acceptance{position="4"}' not in text
        assert metric(thread.url, "jaxspec_spec_num_draft_tokens") == 3
    finally:
        thread.stop()
        server.shutdown()
