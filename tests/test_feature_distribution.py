"""Feature drafters (EAGLE-1, EAGLE-3, Medusa, MLP speculator) keep sampling lossless.

Chain drafters on sampled rows draw each draft from the head's own
temperature / top-k / top-p distribution and hand that q to rejection
verification; EAGLE-3's q lives on a reduced draft vocabulary and is scattered
into the target vocabulary through d2t, zero elsewhere. Trees are the
deterministic top-k tree, verified as one-hot proposals. If q were not exactly
the distribution the drafts were drawn from, rejection sampling would bias the
output; these tests would see it.

1. End to end (prefill, drafter, verify, commit, observe, noise keying) through
   the Engine on the V = 8 tiny target of tests/test_loop_distribution.py, with
   heads written by tests/heads_fixtures.py (EAGLE-3 and FROZEN_KV_MTP with
   draft_vocab_size 5): the sampled multi-draft trees (topk 2) of eagle, eagle3,
   medusa and frozen_kv_mtp and the eagle3 chain at T = 1 and at T = 0.7 /
   top_p = 0.9; the other chains (their q comes from the same `choose_draft`)
   and eagle3's one-hot top-k tree at T = 1. The joint of the first 3 generated tokens over LOOP_SEEDS = 60,000
   seeds per case is chi-square tested (p > ALPHA) against the exact joint from
   Hugging Face logits. Positive controls, on CONTROL_SEEDS = 20,000 seeds, fail
   (p < 1e-6): the eagle3 chain with its drafter's q replaced by a wrong one
   (uniform, or d2t forgotten; drafts still from the head), and the eagle3
   sampled tree with siblings drawn with replacement but verified as distinct,
   or verified with a residual that rejections do not update.
2. One verify step, 100,000 samples: the EAGLE-3 drafter's real propose (its q
   and its noise path, on 100,000 seeds) for a fixed context, then
   `verify_rejection` with the loop's own noise keying against fixed target
   probabilities. The drafts must follow q (so q is what was sampled), and each
   emitted token must follow the target at its node. Positive controls: the same
   drafts verified with wrong proposals (q indexed by draft id, i.e. d2t
   forgotten; uniform q; the q of another context) fail (p < 1e-6).

Significance: each "must match" test asserts p > ALPHA = 1e-3 (seeds fixed, so
deterministic). Runtime ~4 minutes on 2 CPU cores (longer on a cold CI machine).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.cache.paged import KVCache
from jaxspec.config import EngineSection, SpecSection
from jaxspec.engine import Engine
from jaxspec.models.heads.attn_head import draft_to_target
from jaxspec.models.llama import prepare_params
from jaxspec.speculative.drafters import build_drafter
from jaxspec.speculative.drafters.load import load_draft
from jaxspec.speculative.loop import SpecPlan
from jaxspec.speculative.sampling import make_verify_noise, target_probs_from_logits
from jaxspec.speculative.tree import build_chain_tree
from jaxspec.speculative.types import Committed
from jaxspec.speculative.verify import emitted_tokens, verify_rejection
from tests.heads_fixtures import feature_heads_v8
from tests.reference import greedy_rows
from tests.test_feature_drafters import _target_features
from tests.test_loop_distribution import PROMPT, VOCAB, chi_square_p, exact_joint, first_three, joint_counts
from tests.test_loop_distribution import tiny  # noqa: F401  (the module-scoped V = 8 target fixture)

ALPHA = 1e-3
SEEDS = 100_000
# Part 1's samples per case. At 100,000 a case took ~30 s, two thirds of it the 50 engine steps and the
# offline engine's per-row host work; 60,000 keeps ~110 samples per cell of the 8^3 joint on average.
LOOP_SEEDS = 60_000
BATCH = 2000  # seeds per engine step: large batches keep 10^5 end-to-end samples to seconds
CONTROL_SEEDS = 20_000  # the loop's wrong-q controls fail by far (p underflows to 0) on a fifth of the seeds
DRAFT_VOCAB = 5  # EAGLE-3's reduced vocabulary: 3 of the 8 target tokens have q = 0

# name: (algorithm, topk, num_steps, num_draft_tokens, tree_sampling)
CASES = {
    "eagle-tree": ("eagle", 2, 3, 6, "sampled"),
    "eagle3-chain": ("eagle3", 1, 3, 4, "sampled"),
    "eagle3-tree": ("eagle3", 2, 3, 6, "sampled"),
    "eagle3-tree-topk": ("eagle3", 2, 3, 6, "topk"),
    "medusa-tree": ("medusa", 2, 3, 6, "sampled"),
    "mlp_speculator-chain": ("mlp_speculator", 1, 3, 4, "sampled"),
    "frozen_kv-tree": ("frozen_kv_mtp", 2, 3, 6, "sampled"),
}
T1, T07 = (1.0, 1.0), (0.7, 0.9)
# (case, (temperature, top_p)): every drafter's tree (its chain where it has none) at T = 1, EAGLE-3's
# chain and tree at both temperatures. The chains of drafters that also run trees share their q with
# the tree and the chain verify with EAGLE-3's chain; running them too cost two minutes of the suite.
RUNS = [(name, t) for name in CASES for t in (T1, T07)
        if t == T1 or name in ("eagle3-chain", "eagle3-tree", "frozen_kv-tree")]


@pytest.fixture(scope="module")
def heads(tiny, tmp_path_factory):  # noqa: F811
    return feature_heads_v8(tmp_path_factory.mktemp("feature_heads"), tiny[1])


def spec_of(heads, name) -> SpecSection:
    alg, topk, steps, n, tree_sampling = CASES[name]
    return SpecSection(algorithm=alg, draft_model=str(heads[alg]), topk=topk, num_steps=steps, num_draft_tokens=n,
                       verify="rejection", eagle3_layer_ids="input",
                       tree_sampling=tree_sampling if topk > 1 else "sampled")


def build_engine(model, spec) -> Engine:
    ecfg = EngineSection(max_batch_size=BATCH, batch_buckets=(BATCH,), max_context=32, length_buckets=(8, 16, 32),
                         page_size=4)
    return Engine(model.params, model.config, ecfg, progress=False, spec=spec,
                  draft=load_draft(spec, model, jnp.float32, progress=False))


@pytest.fixture(scope="module")
def engines(tiny, heads):  # noqa: F811
    """One engine per case, shared by both temperatures (sampling parameters are runtime arrays)."""
    model, _ = tiny
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = build_engine(model, spec_of(heads, name))
        return cache[name]

    return get


@pytest.fixture(scope="module")
def exact(tiny):  # noqa: F811
    _, hf = tiny
    cache = {}

    def get(temperature, top_p):
        if (temperature, top_p) not in cache:
            cache[temperature, top_p] = exact_joint(hf, temperature, top_p)
        return cache[temperature, top_p]

    return get


def eagle3_draft_ids(heads, alg: str = "eagle3") -> np.ndarray:
    """The target ids of a reduced draft vocabulary (d2t offsets + draft index)."""
    from safetensors.numpy import load_file

    d2t = load_file(str(heads[alg] / "model.safetensors"))["d2t"]
    return np.arange(DRAFT_VOCAB) + d2t


# ---- 1. end to end through the Engine ----------------------------------------------------------------------


@pytest.mark.parametrize("name,temperature,top_p", [(n, *t) for n, t in RUNS],
                         ids=[f"{n}-{'T1' if t == T1 else 'T0.7-p0.9'}" for n, t in RUNS])
def test_loop_with_feature_drafter_samples_the_target(engines, exact, heads, name, temperature, top_p):
    toks, accepts = first_three(engines(name), temperature, top_p, seeds=range(LOOP_SEEDS))
    # The accept paths must be what is tested: many verify steps accept at least one draft.
    assert np.sum(accepts > 1) > 2000, f"{name}: only {np.sum(accepts > 1)} steps accepted a draft"
    if name.startswith(("eagle3", "frozen_kv")):
        # The reduced vocabulary is exercised: the target emits tokens the head can never draft
        # (those come only from the residual), often enough to weigh in the chi-square.
        outside = ~np.isin(toks, eagle3_draft_ids(heads, CASES[name][0]))
        assert outside.mean() > 0.02, f"only {outside.mean():.3f} of tokens are outside the draft vocabulary"
    p = chi_square_p(joint_counts(toks), exact(temperature, top_p))
    assert p > ALPHA, f"{name} at T={temperature}, top_p={top_p}: joint of the first 3 tokens, chi-square p={p:.2e}"


@pytest.mark.parametrize("kind", ["uniform", "d2t-forgotten"])
def test_loop_with_a_wrong_draft_q_fails(tiny, heads, exact, monkeypatch, kind):  # noqa: F811
    """Positive control: the eagle3 chain whose drafter returns a wrong q (drafts still sampled from the
    head) is biased, and the same test sees it. uniform: q = 1/V; d2t-forgotten: the draft-vocabulary
    probabilities at their draft ids instead of their target ids (the reduced-vocabulary mapping bug)."""
    import jaxspec.speculative.drafters.eagle as eagle_mod

    real = eagle_mod.choose_draft

    def wrong_q(logits, s, prev, d2t, vocab, sample, coupled=False):
        tok, q = real(logits, s, prev, d2t, vocab, sample, coupled)
        if kind == "uniform":
            return tok, jnp.full_like(q, 1.0 / vocab)
        return tok, jnp.zeros_like(q).at[:, : d2t.shape[0]].set(q[:, d2t])

    monkeypatch.setattr(eagle_mod, "choose_draft", wrong_q)
    model, _ = tiny
    # A new Engine jits fresh closures, so its trace calls the patched function.
    toks, _ = first_three(build_engine(model, spec_of(heads, "eagle3-chain")), 1.0, 1.0,
                          seeds=range(CONTROL_SEEDS))
    p = chi_square_p(joint_counts(toks), exact(1.0, 1.0))
    assert p < 1e-6, f"a {kind} draft q passed the chi-square test (p={p:.2e})"


@pytest.mark.parametrize("kind", ["with-replacement", "residual-kept"])
def test_loop_with_a_broken_sampled_tree_fails(tiny, heads, exact, monkeypatch, kind):  # noqa: F811
    """Positive controls of the sampled-tree cases: the eagle3 tree whose siblings are drawn with
    replacement (independent races over q) but verified with the without-replacement rows, and the
    right tree verified by a walk whose rejections leave the residual unchanged."""
    import jaxspec.speculative.drafters.sampled_tree as tree_mod
    import jaxspec.speculative.loop as loop_mod
    from jaxspec.speculative.sampling import draft_noise, race_sample
    from jaxspec.speculative.types import VerifyResult
    from tests.test_rejection import broken_verifier

    if kind == "with-replacement":
        real = tree_mod.sample_children

        def with_replacement(logits, parents, width, s, d2t, vocab):
            tok, rows = real(logits, parents, width, s, d2t, vocab)
            sp = s.sampling
            q = target_probs_from_logits(logits, sp.temperature, sp.top_k, sp.top_p)
            idx = jnp.stack([race_sample(q, jnp.stack([draft_noise(sp.seed, s.hist_len, 1000 * (r + 1) + n,
                                                                   q.shape[-1]) for n in parents], axis=1))
                             for r in range(width)], axis=-1)
            return jnp.where(tok >= 0, idx if d2t is None else d2t[idx], -1), rows

        monkeypatch.setattr(tree_mod, "sample_children", with_replacement)
    else:
        broken = broken_verifier("no_update")
        monkeypatch.setattr(loop_mod, "verify_rejection", lambda *a, **kw: VerifyResult(*broken(*a, **kw)))
    model, _ = tiny
    toks, _ = first_three(build_engine(model, spec_of(heads, "eagle3-tree")), 1.0, 1.0,
                          seeds=range(CONTROL_SEEDS))
    p = chi_square_p(joint_counts(toks), exact(1.0, 1.0))
    assert p < 1e-6, f"a sampled tree {kind} passed the chi-square test (p={p:.2e})"


# ---- 2. one verify step on the EAGLE-3 drafter's own q, 10^5 samples ------------------------------------------

CHUNK = 25_000  # propose rows per call (all share one cached context)


def eagle3_proposals(model, heads, context, temperature, top_p, seeds):
    """The EAGLE-3 chain drafter's real propose for `context` (its last token the root) on every seed:
    (tokens [S, 3], q [S, 3, V] over the target vocabulary, d2t [Vd])."""
    spec = dataclasses.replace(spec_of(heads, "eagle3-chain"), num_draft_tokens=3, num_steps=2)
    head_params, hcfg = load_draft(spec, model, jnp.float32, progress=False)
    drafter = build_drafter(SpecPlan.from_config(spec), spec, draft_cfg=hcfg, target_cfg=model.config)
    assert drafter.sample_drafts and drafter.provides_draft_probs
    target = prepare_params(model.params, model.config, unstack=False)
    params = {"own": drafter.prepare_params(head_params, native=False, unstack=None),
              "target": {k: target[k] for k in drafter.shares_target}}
    feats = _target_features(model, target, drafter, context)
    # Prefill every pair but the root's, as the engine's prefill leaves it (root committed, not yet run).
    r = len(context) - 1
    cfg = drafter.draft_cache_cfg
    page, pages = 4, 4
    state = drafter.init_state(KVCache.zeros(1, pages + 1, page, cfg.num_kv_heads, cfg.head_dim), 1)
    table = jnp.arange(1, pages + 1)[None]
    x = jnp.asarray([context])
    state = drafter.prefill(params, state, Committed(x[:, :r], feats[:, :r], jnp.array([0]), jnp.array([r])), table)

    @jax.jit
    def propose(seed):
        b = seed.shape[0]
        s = SimpleNamespace(
            history=jnp.zeros((b, 16), jnp.int32).at[:, : len(context)].set(x[0]),
            hist_len=jnp.full((b,), len(context), jnp.int32), page_table=jnp.broadcast_to(table, (b, pages)),
            done=jnp.zeros((b,), bool), corpus=None, prompt_lens=jnp.full((b,), len(context), jnp.int32),
            sampling=dataclasses.replace(greedy_rows(b), temperature=jnp.full((b,), temperature, jnp.float32),
                                         top_p=jnp.full((b,), top_p, jnp.float32), seed=seed))
        rows = dataclasses.replace(state, pending=jnp.broadcast_to(state.pending, (b, state.pending.shape[-1])))
        prop = drafter.propose(params, rows, s)
        return prop.tokens, prop.draft_probs

    out = [propose(jnp.asarray(seeds[i:i + CHUNK], jnp.uint32)) for i in range(0, len(seeds), CHUNK)]
    tokens = np.concatenate([np.asarray(t) for t, _ in out])
    q = np.concatenate([np.asarray(d) for _, d in out])
    return tokens, q, np.asarray(draft_to_target(params["own"], hcfg))


def target_rows(hf, contexts, temperature, top_p) -> np.ndarray:
    """The target's filtered next-token distribution after each context [len, V] (float32)."""
    import torch

    with torch.no_grad():
        logits = hf(torch.tensor(contexts)).logits[:, -1].float().numpy()
    b = len(contexts)
    p = target_probs_from_logits(jnp.asarray(logits)[None], jnp.full((1,), temperature), jnp.zeros((1,), jnp.int32),
                                 jnp.full((1,), top_p))[0]
    return np.asarray(p, np.float64).reshape(b, VOCAB)


def verify_chain(tokens, q, p, seeds, hist_len):
    """verify_rejection of chains `tokens` [S, 3] with proposals q [S, 3, V] against target rows p [3, V]
    (node j's target is p[j] whatever was drafted), noise keyed (seed, hist_len) as the loop keys it."""
    s, n = tokens.shape
    tree = build_chain_tree(jnp.asarray(tokens), jnp.full((s,), hist_len - 1, jnp.int32))
    u, e = make_verify_noise(jnp.asarray(seeds, jnp.uint32), jnp.full((s,), hist_len, jnp.int32), n, VOCAB)
    target = jnp.broadcast_to(jnp.asarray(p, jnp.float32), (s, n, VOCAB))
    res = verify_rejection(jnp.asarray(tokens), tree.retrieve_next_token, tree.retrieve_next_sibling, target,
                           jnp.asarray(q, jnp.float32), u, e, max_depth=n - 1)
    return np.asarray(emitted_tokens(jnp.asarray(tokens), res)), np.asarray(res.num_accepted)


def pvalue(samples: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square p of 1-D token samples against probs (tests/reference.chi_square_pvalue returns nan
    when no cell needs pooling, so the loop test's pooled version), after checking that no
    zero-probability token was drawn (the reduced vocabulary's zeros must hold exactly)."""
    counts = np.bincount(samples, minlength=VOCAB)
    assert counts[probs == 0].sum() == 0, f"zero-probability tokens drawn: counts {counts}, probs {probs}"
    if np.count_nonzero(probs) == 1:  # a single possible token (top-p can keep one): nothing to test beyond that
        return 1.0
    return chi_square_p(counts, probs)


def emitted_pvalues(emitted, accepted, p) -> list[float]:
    """Chi-square p of each emitted position j against p[j], over the rows that reached it (given
    node j accepted, what follows is a fresh lossless step at node j); positions reached by fewer
    than 1000 rows are left out."""
    out = []
    for j in range(p.shape[0]):
        rows = accepted >= j
        if rows.sum() >= 1000:
            out.append(pvalue(emitted[rows, j], p[j]))
    return out


VERIFY_CONTEXT = PROMPT + [4]  # root 4
OTHER_CONTEXT = PROMPT[:-1] + [7, 2]  # another context: its q is a wrong proposal here


@pytest.fixture(scope="module", params=[(1.0, 1.0), (0.7, 0.9)], ids=["T1", "T0.7-p0.9"])
def verify_world(request, tiny, heads):  # noqa: F811
    model, hf = tiny
    temperature, top_p = request.param
    seeds = np.arange(SEEDS) + 7_000_000  # seeds unlike the loop tests'
    tokens, q, d2t = eagle3_proposals(model, heads, VERIFY_CONTEXT, temperature, top_p, seeds)
    # Fixed targets: node 0 the real target after the context, nodes 1, 2 after two other prefixes.
    p = target_rows(hf, [VERIFY_CONTEXT, VERIFY_CONTEXT[:-1] + [6], VERIFY_CONTEXT[:-1] + [3]], temperature, top_p)
    return SimpleNamespace(model=model, hf=hf, heads=heads, seeds=seeds, tokens=tokens, q=q, d2t=d2t, p=p,
                           temperature=temperature, top_p=top_p)


def test_eagle3_drafts_follow_their_q(verify_world):
    w = verify_world
    q1 = w.q[:, 1]
    # One context, so one q at depth 1 on every row; zero outside the reduced vocabulary.
    np.testing.assert_allclose(q1, np.broadcast_to(q1[0], q1.shape), atol=1e-6)
    outside = np.setdiff1d(np.arange(VOCAB), w.d2t)
    assert len(outside) == VOCAB - DRAFT_VOCAB and np.all(w.q[:, 1:, outside] == 0)
    # The root unused, depth-2 q a distribution on every row.
    np.testing.assert_allclose(w.q[:, 1:].sum(-1), 1.0, atol=1e-5)
    pv = pvalue(w.tokens[:, 1], q1[0])
    assert pv > ALPHA, f"depth-1 drafts do not follow the returned q (p={pv:.2e})"
    # Depth 2, conditioned on one depth-1 draft (its q is then one row too): the most common one
    # whose depth-2 q has more than one possible token. Under top_p = 0.9 this sharp head keeps a
    # single token at depth 2 after every depth-1 draft; at T = 1 its softmax is never one-hot.
    support = np.count_nonzero(w.q[:, 2], axis=-1) > 1
    if not support.any():
        assert w.top_p < 1.0
        return
    a = np.bincount(w.tokens[support, 1], minlength=VOCAB).argmax()
    rows = w.tokens[:, 1] == a
    q2 = w.q[rows, 2]
    np.testing.assert_allclose(q2, np.broadcast_to(q2[0], q2.shape), atol=1e-6)
    pv2 = pvalue(w.tokens[rows, 2], q2[0])
    assert pv2 > ALPHA, f"depth-2 drafts do not follow the returned q (p={pv2:.2e})"


def test_rejection_with_eagle3_q_emits_the_target(verify_world):
    w = verify_world
    # The test has teeth only where q and p differ, including target mass the draft vocabulary misses.
    outside = np.setdiff1d(np.arange(VOCAB), w.d2t)
    assert w.p[0, outside].sum() > 0.05 and w.p[1, outside].sum() > 0.05, w.p
    assert 0.5 * np.abs(w.q[0, 1] - w.p[1]).sum() > 0.1
    emitted, accepted = verify_chain(w.tokens, w.q, w.p, w.seeds, len(VERIFY_CONTEXT))
    assert np.mean(accepted >= 1) > 0.1, np.bincount(accepted)
    pvals = emitted_pvalues(emitted, accepted, w.p)
    # At T = 1 every position is tested; under top_p = 0.9 the sharp head's one-hot depth-2 draft lies
    # outside node 1's kept set, so no chain gets past depth 1 and positions 0, 1 are tested.
    assert len(pvals) == (3 if w.top_p == 1.0 else 2), np.bincount(accepted)
    assert min(pvals) > ALPHA, f"emitted tokens vs target, per position: p={pvals}"


def wrong_proposal(w, kind: str) -> np.ndarray:
    q = w.q
    if kind == "d2t-forgotten":  # the draft-vocabulary probabilities at their draft ids, not their target ids
        wrong = np.zeros_like(q)
        wrong[:, :, :DRAFT_VOCAB] = q[:, :, w.d2t]
        assert not np.array_equal(wrong, q)  # d2t is not the identity for this head
        return wrong
    if kind == "uniform":
        return np.full_like(q, 1.0 / VOCAB)
    _, other, _ = eagle3_proposals(w.model, w.heads, OTHER_CONTEXT, w.temperature, w.top_p, w.seeds[:1])
    assert 0.5 * np.abs(other[0, 1] - q[0, 1]).sum() > 0.1  # the other context's q is really different
    return np.broadcast_to(other[:1], q.shape)


@pytest.mark.parametrize("kind", ["d2t-forgotten", "uniform", "other-context"])
def test_rejection_with_a_wrong_proposal_fails(verify_world, kind):
    """Positive control: the same drafts verified against a proposal they were not drawn from."""
    w = verify_world
    emitted, accepted = verify_chain(w.tokens, wrong_proposal(w, kind), w.p, w.seeds, len(VERIFY_CONTEXT))
    pvals = emitted_pvalues(emitted, accepted, w.p)
    assert pvals[0] < 1e-6, f"{kind} proposal passed: p={pvals}"
