"""Speculative decoding end to end on tiny random models.

Greedy speculative output must equal Hugging Face greedy token for token
(tie-aware), for every drafter and tree shape, page size and ragged batch.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxspec.cache.attention import gather_pages
from jaxspec.config import EngineSection, SpecSection
from jaxspec.engine import Engine, Request
from jaxspec.sampling_params import SamplingParams
from jaxspec.engine.phases import loop_state
from jaxspec.engine.runner import RowInput
from jaxspec.models.llama import forward
from jaxspec.models.loading import load_model
from jaxspec.speculative.loop import spec_iteration
from jaxspec.speculative.drafters.load import load_draft
from jaxspec.speculative.drafters.standalone import truncate_layers
from tests.reference import assert_greedy_equal, chi_square_pvalue, hf_first_two_marginals, hf_greedy

PROMPTS = [[5, 17, 33, 9, 100, 42, 7], [200, 3], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23], [99]]
NEW = 28


@pytest.fixture(scope="module")
def llama(tiny_dirs):
    path, hf = tiny_dirs["llama"]
    model = load_model(str(path), progress=False)
    refs = [hf_greedy(hf, p, NEW) for p in PROMPTS]
    return model, hf, refs


def spec_engine(model, page_size=16, draft=None, batch=4, **spec_kw):
    ecfg = EngineSection(max_batch_size=batch, max_context=128, length_buckets=(16, 32, 64, 128), page_size=page_size)
    if spec_kw["algorithm"] == "standalone":
        # The [spec] section describes the draft we pass: the target's first N layers.
        draft = draft or (model.params, model.config)
        spec_kw["draft_layers"] = draft[1].num_layers
    spec = SpecSection(**spec_kw)
    return Engine(model.params, model.config, ecfg, progress=False, spec=spec, draft=draft,
                  benchmark=spec.simulate_accept_length > 0)


def _standalone_cases():
    """Every (topk, steps) in {1,2,4} x {1,3,5} with a valid num_draft_tokens, the draft sizes spread
    over {2,4,8,16} (full and cut chains, a wide root cut to 2, the deepest trees); page size and batch
    alternate so both values of each meet chains and trees. The full grid of 23 cost four minutes of
    the 2-core suite for shapes tests/test_tree.py checks against its reference."""
    shapes = [(1, 1, 2), (1, 3, 4), (1, 5, 2), (2, 1, 2), (2, 3, 8), (2, 5, 16), (4, 1, 4), (4, 3, 2),
              (4, 3, 16), (4, 5, 8)]
    return [("standalone", topk, steps, ndt, (1, 16)[i % 2], (4, 1, 4)[i % 3])
            for i, (topk, steps, ndt) in enumerate(shapes)]


CASES = [
    # (algorithm, topk, num_steps, num_draft_tokens, page_size, batch)
    ("ngram", 1, 7, 8, 1, 4),
    ("ngram", 4, 3, 16, 16, 4),
    *_standalone_cases(),
]


@pytest.mark.parametrize("algorithm, topk, steps, ndt, page_size, batch", CASES)
def test_greedy_spec_equals_target_greedy(llama, algorithm, topk, steps, ndt, page_size, batch):
    model, hf, refs = llama
    # A 1-layer truncated draft disagrees with the target often, so rejection paths run.
    draft = truncate_layers(model.params, model.config, 1) if algorithm == "standalone" else None
    engine = spec_engine(model, page_size, draft=draft, algorithm=algorithm, topk=topk,
                         num_steps=steps, num_draft_tokens=ndt)
    prompts = PROMPTS[:batch]
    results = engine.generate([Request(p, SamplingParams(max_tokens=NEW)) for p in prompts])
    for p, res, ref in zip(prompts, results, refs):
        assert_greedy_equal(hf, p, res.output_ids, ref)
        # The first token comes from prefill; every verify then commits num_accepted + 1.
        assert sum(res.accept_lengths) >= NEW - 1
        assert all(1 <= a <= ndt for a in res.accept_lengths)
    assert engine.runner.allocator.num_used == 0


@pytest.mark.parametrize("k", [1, 3, 5])
def test_same_model_oracle_accepts_everything_on_chains(llama, k):
    model, hf, refs = llama
    engine = spec_engine(model, algorithm="standalone", topk=1, num_steps=k, num_draft_tokens=k + 1)
    res = engine.generate([Request(PROMPTS[0], SamplingParams(max_tokens=NEW))])[0]
    assert res.output_ids == refs[0]
    assert res.accept_lengths == [k + 1] * len(res.accept_lengths)  # tau = k + 1


def test_stop_token_inside_an_accepted_run(llama):
    model, hf, refs = llama
    engine = spec_engine(model, algorithm="standalone", topk=1, num_steps=5, num_draft_tokens=6)
    ref = refs[0]
    stop = ref[8]  # the oracle commits 6 tokens per verify, so this lands mid-run
    first = ref.index(stop)
    res = engine.generate([Request(PROMPTS[0], SamplingParams(max_tokens=NEW), stop_token_ids=(stop,)),
                           Request(PROMPTS[1], SamplingParams(max_tokens=NEW))])
    assert res[0].output_ids == ref[: first + 1]
    assert res[0].finish_reason == "stop"
    assert res[1].output_ids == refs[1]


def test_max_new_tokens_cuts_inside_a_run(llama):
    model, hf, refs = llama
    engine = spec_engine(model, algorithm="standalone", topk=1, num_steps=5, num_draft_tokens=6)
    res = engine.generate([Request(PROMPTS[2], SamplingParams(max_tokens=9))])[0]
    assert res.output_ids == refs[2][:9]


@pytest.mark.parametrize("verify", ["rejection", "target-only"])
def test_sampling_verifiers_are_seeded_and_exact_for_greedy_requests(llama, verify):
    model, hf, refs = llama
    draft = truncate_layers(model.params, model.config, 1)
    engine = spec_engine(model, draft=draft, algorithm="standalone", topk=1, num_steps=3,
                         num_draft_tokens=4, verify=verify)
    sampled = Request(PROMPTS[0], SamplingParams(max_tokens=20, temperature=1.0), seed=7)
    alone = engine.generate([sampled])[0].output_ids
    mixed = engine.generate([Request(PROMPTS[1], SamplingParams(max_tokens=NEW)), sampled])
    assert mixed[1].output_ids == alone, "a seeded request must not depend on its batch"
    assert_greedy_equal(hf, PROMPTS[1], mixed[0].output_ids, refs[1])


def test_tree_rejection_sampling_follows_the_target_with_sampled_tree_drafts(llama):
    """Sampled rows (temperature > 0) draft sampled multi-draft trees and run verify_rejection
    on them (an all-greedy batch takes the greedy rule and the top-k tree). 4096 seeded
    requests: the second token, the first one a verify step emits (an accepted
    draft or a residual sample), follows the marginal computed from Hugging Face
    logits of every prefix; the same samples reject two other temperatures. Beside
    them a greedy row (top-k children by logits, one-hot rows) stays exactly greedy."""

    model, hf, refs = llama
    draft = truncate_layers(model.params, model.config, 1)  # disagrees often: rejections and residuals
    engine = spec_engine(model, draft=draft, batch=64, algorithm="standalone", topk=2, num_steps=3,
                         num_draft_tokens=6, verify="rejection")
    prompt, temp, n, new, batch = PROMPTS[0], 0.7, 4096, 3, 64
    max_depth = engine.spec_plan.max_depth

    def run(seeds, extra=()):
        return engine.generate([*extra, *(Request(prompt, SamplingParams(max_tokens=new, temperature=temp), seed=int(s))
                                          for s in seeds)])

    results = [r for start in range(0, n, batch) for r in run(range(start, start + batch))]
    out = np.asarray([r.output_ids for r in results])
    assert out.shape == (n, new) and ((out >= 0) & (out < model.config.vocab_size)).all()
    # Accept lengths agree with the outputs: the prefill emits one token, each verify
    # commits its accept length, and only the last verify may be cut at max_new_tokens.
    for r in results:
        a = r.accept_lengths
        assert a and all(1 <= x <= max_depth + 1 for x in a), a
        assert 1 + sum(a[:-1]) < new <= 1 + sum(a), a
    assert sum(x > 1 for r in results for x in r.accept_lengths) > 0.05 * n  # drafts do get accepted
    # Sampled, not greedy: most seeds leave the greedy path within three tokens.
    assert (out != np.asarray(refs[0][:new])).any(axis=1).mean() > 0.5
    # Same seeds again, now beside a greedy row: identical samples, and the greedy row is exact.
    again = run(range(batch - 1), extra=[Request(PROMPTS[1], SamplingParams(max_tokens=new))])
    assert_greedy_equal(hf, PROMPTS[1], again[0].output_ids, refs[1][:new])
    assert [(r.output_ids, r.accept_lengths) for r in again[1:]] == \
        [(r.output_ids, r.accept_lengths) for r in results[: batch - 1]]

    marginals = hf_first_two_marginals(hf, prompt)
    alpha = 1e-3
    c1, c2 = (np.bincount(out[:, i], minlength=256) for i in range(2))
    p1, p2 = marginals(temp)
    assert chi_square_pvalue(c1, p1) > alpha
    assert chi_square_pvalue(c2, p2) > alpha
    for wrong in (1.0, 0.5):  # positive controls on the same samples
        assert chi_square_pvalue(c2, marginals(wrong)[1]) < alpha, wrong


# (topk, num_draft_tokens, page_size): a chain, trees with page size > 1 and 1.
COMMIT_CONFIGS = [(1, 4, 1), (2, 6, 4), (4, 10, 16)]
_commit_rigs: dict = {}


def _commit_rig(model, topk, ndt, page_size):
    """Engine + jitted iteration per config, built once (hypothesis reuses them)."""
    key = (topk, ndt, page_size)
    if key not in _commit_rigs:
        draft = truncate_layers(model.params, model.config, 1)
        engine = spec_engine(model, page_size, draft=draft, algorithm="standalone", topk=topk, num_steps=3,
                             num_draft_tokens=ndt)
        step = jax.jit(lambda p, dp, s: spec_iteration(engine.spec_plan, model.config, engine.runner.drafter, p, dp, s))
        _commit_rigs[key] = (engine, step)
    return _commit_rigs[key]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    config=st.sampled_from(COMMIT_CONFIGS),
    prompts=st.lists(st.lists(st.integers(0, 255), min_size=1, max_size=16), min_size=2, max_size=2),
    iters=st.integers(1, 4),
)
def test_committed_cache_equals_fresh_prefill(llama, config, prompts, iters):
    """After any number of iterations, committed K/V == a fresh prefill of the committed tokens."""
    model, _, _ = llama
    engine, step = _commit_rig(model, *config)
    b, ctx = 2, 64
    r = engine.runner
    lens = np.array([len(p) for p in prompts], np.int32)
    rows = []
    for i, p in enumerate(prompts):
        r.allocator.allocate(i, ctx)
        rows.append(RowInput(tokens=list(p), prompt_len=len(p), page_row=np.asarray(r.allocator.page_table_row(
            i, r.max_pages)), slot=i, params=SamplingParams(max_tokens=40)))
    for row, first in zip(rows, r.prefill([(row, 0, row.prompt_len) for row in rows])):
        row.tokens.append(first)
    state, _ = loop_state(r, engine.depth, rows, ctx)
    pt = np.asarray(state.page_table)
    for _ in range(iters):
        state = step(r.params, r.draft_params, state)
    r.cache, r.draft_cache = state.cache, state.draft.cache  # keep the runner's caches the live ones
    committed = np.asarray(state.hist_len) - 1  # the root's K/V is not in the cache yet
    history = np.asarray(state.history)
    assert (committed > lens).all() and committed.max() <= 32

    fresh_len = 32  # static: one compile for every example
    fresh_cache = dataclasses.replace(state.cache, k=jnp.zeros_like(state.cache.k), v=jnp.zeros_like(state.cache.v))
    fresh = _fresh_prefill(engine.runner.params, model.config, jnp.asarray(history[:, :fresh_len]), fresh_cache,
                           jnp.asarray(pt), jnp.asarray(committed))
    for name in ("k", "v"):
        got = jax.vmap(lambda layer: gather_pages(layer, jnp.asarray(pt)))(getattr(state.cache, name))
        want = jax.vmap(lambda layer: gather_pages(layer, jnp.asarray(pt)))(getattr(fresh, name))
        for i in range(b):
            np.testing.assert_allclose(np.asarray(got[:, i, : committed[i]]), np.asarray(want[:, i, : committed[i]]),
                                       atol=2e-5, rtol=1e-5)
    for i in range(len(rows)):
        r.allocator.free(i)


@functools.partial(jax.jit, static_argnums=(1,))
def _fresh_prefill(params, cfg, tokens, cache, page_table, kv_len):
    b, t = tokens.shape
    return forward(params, cfg, tokens, jnp.broadcast_to(jnp.arange(t), (b, t)), cache, page_table,
                   q_start=jnp.zeros(b, jnp.int32), kv_len=kv_len).cache


def _whole_cache_copies(hlo_text: str, cache_shape) -> list[str]:
    """Copies of an f32 array of the cache's full shape in compiled HLO text."""
    import re

    return re.findall(rf"= f32\[{','.join(map(str, cache_shape))}\]\S* copy\(", hlo_text)


def test_whole_cache_copy_detector_catches_a_copying_loop(llama):
    """Positive control for the test below: a while loop whose body reads the old
    cache after updating it must keep both, so XLA copies the cache every
    iteration, and the detector sees that; the same loop updating in place has none."""
    engine = spec_engine(llama[0], algorithm="ngram", topk=1, num_steps=3, num_draft_tokens=4)
    shape = engine.runner.cache.k.shape
    cache = jnp.zeros(shape, engine.runner.cache.k.dtype)

    def loop(k, read_old):
        def body(c):
            k, j = c
            new = k.at[:, j].set(1.0)
            return (new + k[0, 0, 0, 0, 0] if read_old else new), j + 1

        return jax.lax.while_loop(lambda c: c[1] < 3, body, (k, 0))[0]

    def compiled(read_old):
        fn = jax.jit(lambda k: loop(k, read_old), donate_argnums=0)
        return fn.lower(cache).compile().as_text()

    assert _whole_cache_copies(compiled(True), shape)
    assert not _whole_cache_copies(compiled(False), shape)


@pytest.mark.parametrize("spec_kw", [
    dict(algorithm="ngram", topk=1, num_steps=3, num_draft_tokens=4),
    dict(algorithm="ngram", topk=2, num_steps=2, num_draft_tokens=5),
    dict(algorithm="standalone", topk=1, num_steps=2, num_draft_tokens=3),
    dict(algorithm="ngram", topk=1, num_steps=3, num_draft_tokens=4, simulate_accept_length=2),
    dict(algorithm="frozen_kv_mtp", topk=2, num_steps=2, num_draft_tokens=4),
], ids=["ngram-chain", "ngram-tree", "standalone-chain", "synthetic", "frozen-kv-tree"])
def test_loop_body_never_copies_the_cache(llama, spec_kw, tmp_path):
    # A whole-cache copy per iteration costs more than the verify forward on a
    # large pool. It crept in once: with forced acceptance the chain's (no-op) KV
    # move did not depend on the forward, so XLA scheduled it beside the last
    # layer's attention and copied the cache to allow that. The compiled loop
    # must update the carry in place. FROZEN_KV_MTP's propose reads the target
    # cache itself (two layers' pools, sliced from the carry) before the verify
    # writes it: still no copy. (Detector: test_whole_cache_copy_detector_catches_a_copying_loop.)
    draft = None
    if spec_kw["algorithm"] == "frozen_kv_mtp":
        from tests.heads_fixtures import write_frozen_kv_head

        spec_kw = dict(spec_kw, draft_model=str(write_frozen_kv_head(tmp_path / "fkv", llama[1])))
        draft = load_draft(SpecSection(**spec_kw), llama[0], jnp.float32, progress=False)
    engine = spec_engine(llama[0], draft=draft, **spec_kw)
    engine.generate([Request([5, 17, 33, 9], SamplingParams(max_tokens=8))])
    decode = [(key, ex) for key, ex in engine.runner._compiled.items() if key[0] == "decode"]
    assert decode, "no decode executable was compiled: nothing would be checked"
    for key, executable in decode:
        copies = _whole_cache_copies(executable.as_text(), engine.runner.cache.k.shape)
        assert not copies, f"{key}: {len(copies)} whole-cache copies in the decode loop"
