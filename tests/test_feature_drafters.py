"""Feature drafters (EAGLE, EAGLE-3, MTP/NEXTN, Medusa, MLP speculator) inside the on-device loop.

1. The drafter's incremental bookkeeping (prefill chunks, observe after each
   verify, the pending feature, the draft KV cache, in-flight draft nodes)
   drafts exactly what a from-scratch recompute of the head over every
   (feature, token) pair drafts: the reference that proves the pair layout.
2. Greedy speculative output equals plain greedy output for every drafter,
   chain and tree, batch 1 and 4, page sizes 1 and 16, through the CLI's
   loader (`drafters.load.load_draft`) and the published formats.
3. A second request of a compiled bucket compiles nothing.
4. Mismatched heads get one-line errors.
(The heads' own math against torch references: tests/test_heads.py. The
sampled loop's distribution: tests/test_feature_distribution.py.)
"""

from __future__ import annotations

import dataclasses
import shutil
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.cache.paged import KVCache
from jaxspec.config import EngineSection, SpecSection
from jaxspec.engine import Engine, Request, RequestError
from jaxspec.sampling_params import SamplingParams
from jaxspec.models.heads.attn_head import attn_head_step, draft_to_target, project_features
from jaxspec.models.llama import forward, prepare_params
from jaxspec.models.loading import load_model
from jaxspec.speculative.drafters import build_drafter
from jaxspec.speculative.drafters.load import load_draft
from jaxspec.speculative.loop import SpecPlan
from jaxspec.speculative.types import Committed
from tests.heads_fixtures import (
    add_mtp_layers, write_eagle3_head, write_eagle_head, write_medusa_head, write_mlp_speculator,
)
from tests.reference import compile_events, greedy_rows
from tests.test_heads import causal_attend


@pytest.fixture(scope="module")
def world(tiny_dirs, tmp_path_factory):
    """The tiny llama target and one head of every format, plus MTP targets."""
    path, hf = tiny_dirs["llama"]
    tmp = tmp_path_factory.mktemp("heads")
    model = load_model(str(path), progress=False)
    heads = {
        "eagle": write_eagle_head(tmp / "eagle", hf),
        "eagle3": write_eagle3_head(tmp / "eagle3", hf, layer_ids=[0, 1, 2], convention="input"),
        "medusa": write_medusa_head(tmp / "medusa", hf, num_heads=3),
        "mlp_speculator": write_mlp_speculator(tmp / "mlp", hf, n_predict=3),
    }
    mtp = {}
    for kind in ("deepseek", "mimo"):
        d = tmp / f"mtp_{kind}"
        shutil.copytree(path, d)
        add_mtp_layers(d, kind=kind)
        mtp[kind] = load_model(str(d), progress=False)
    return SimpleNamespace(model=model, hf=hf, heads=heads, mtp=mtp)


def spec_for(alg, head_dir, topk, steps, n, **kw):
    return SpecSection(algorithm=alg, draft_model=str(head_dir) if head_dir else "", topk=topk, num_steps=steps,
                       num_draft_tokens=n, eagle3_layer_ids="input", **kw)


# ---- 1. incremental drafting == recompute over all pairs ---------------------------------------------


def _drafter_and_params(model, spec):
    spec = dataclasses.replace(spec, verify="greedy")  # deterministic drafts: the reference is greedy
    head_params, hcfg = load_draft(spec, model, jnp.float32, progress=False)
    plan = SpecPlan.from_config(spec)
    drafter = build_drafter(plan, spec, draft_cfg=hcfg, target_cfg=model.config)
    target = prepare_params(model.params, model.config, unstack=False)
    params = {"own": drafter.prepare_params(head_params, native=False, unstack=None),
              "target": {k: target[k] for k in drafter.shares_target}}
    return drafter, params, hcfg, target


def _target_features(model, target, drafter, tokens):
    cfg = model.config
    t = len(tokens)
    cache = KVCache.zeros(cfg.num_layers, 9, 16, cfg.num_kv_heads, cfg.head_dim)
    want = drafter.target_features
    out = forward(target, cfg, jnp.asarray([tokens]), jnp.arange(t)[None], cache, jnp.arange(1, 9)[None],
                  q_start=jnp.zeros((1,), jnp.int32), kv_len=jnp.array([t]), capture_layers=want.layers,
                  capture_final=want.final_norm)
    return out.features  # [1, T, F]


def _reference_chain(params, hcfg, feats, tokens, depth):
    """Greedy chain from scratch: the head over pairs (h_i, x_{i+1}) i < r, then fed back."""
    own, shared = params["own"], params["target"]
    d2t = draft_to_target(own, hcfg)
    r = len(tokens) - 1
    toks = list(tokens[1:])  # x_1 .. x_r
    h = project_features(own, hcfg, feats[:, :r])
    out = []
    for _ in range(depth):
        o = attn_head_step(own, hcfg, shared, jnp.asarray([toks]), h, jnp.arange(len(toks))[None], causal_attend)
        nxt = int(jnp.argmax(o.logits[0, -1]))
        nxt = int(d2t[nxt]) if d2t is not None else nxt
        out.append(nxt)
        toks.append(nxt)
        h = jnp.concatenate([h, o.h[:, -1:]], axis=1)
    return out, o


def _drive(drafter, params, feats, tokens, prompt_len, chunks, page_size):
    """Prefill the prompt, then observe committed chunks of the given sizes; the root is tokens[-1]."""
    cfg = drafter.draft_cache_cfg
    maxp = 64 // page_size
    state = drafter.init_state(KVCache.zeros(1, maxp + 1, page_size, cfg.num_kv_heads, cfg.head_dim), 1)
    table = jnp.arange(1, maxp + 1)[None]
    x = jnp.asarray([tokens])
    state = drafter.prefill(params, state, Committed(x[:, :prompt_len], feats[:, :prompt_len],
                                                     jnp.array([0]), jnp.array([prompt_len])), table)
    a = prompt_len
    for c in chunks:  # each: the old root plus the accepted drafts, padded to width 4 like a verify step
        w = 4
        tok = jnp.pad(x[:, a:a + c], ((0, 0), (0, w - c)))
        f = jnp.pad(feats[:, a:a + c], ((0, 0), (0, w - c), (0, 0)))
        state = drafter.observe(params, state, Committed(tok, f, jnp.array([a]), jnp.array([c])), table)
        a += c
    assert a == len(tokens) - 1
    s = SimpleNamespace(history=jnp.zeros((1, 64), jnp.int32).at[0, :len(tokens)].set(x[0]),
                        hist_len=jnp.array([len(tokens)]), page_table=table, done=jnp.array([False]),
                        sampling=greedy_rows(1), prompt_lens=jnp.array([prompt_len]), corpus=None)
    return drafter.propose(params, state, s)


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "mtp_deepseek", "mtp_mimo"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_incremental_chain_equals_recompute(world, kind, page_size):
    if kind.startswith("mtp"):
        model, spec = world.mtp[kind[4:]], spec_for("eagle", None, 1, 3, 4)
    else:
        model, spec = world.model, spec_for(kind, world.heads[kind], 1, 3, 4)
    drafter, params, hcfg, target = _drafter_and_params(model, spec)
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, 250, size=15).tolist()  # prompt 6, then 1+3+2+3 committed, root last
    feats = _target_features(model, target, drafter, tokens)
    prop = _drive(drafter, params, feats, tokens, 6, [1, 3, 2, 2], page_size)
    ref, _ = _reference_chain(params, hcfg, feats, tokens, 3)
    assert prop.tokens[0, 0] == tokens[-1]
    assert prop.tokens[0, 1:].tolist() == ref
    # Positive control: a pending feature off by one position (the classic pairing bug) drafts differently.
    shifted, _ = _reference_chain(params, hcfg, jnp.roll(feats, 1, axis=1), tokens, 3)
    assert shifted != ref


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_incremental_tree_matches_recompute(world, kind):
    """EAGLE-2 tree: depth-1 nodes are the root pair's top-k, and every depth-2 node is among the top-k
    of a from-scratch recompute continuing from its parent (the in-flight block and its ancestor mask)."""
    spec = spec_for(kind, world.heads[kind], 3, 2, 7)
    drafter, params, hcfg, target = _drafter_and_params(world.model, spec)
    tokens = np.random.default_rng(1).integers(3, 250, size=12).tolist()
    feats = _target_features(world.model, target, drafter, tokens)
    prop = _drive(drafter, params, feats, tokens, 5, [2, 3, 1], 4)
    tok, par = np.asarray(prop.tokens[0]), np.asarray(prop.parents[0])
    d2t = draft_to_target(params["own"], hcfg)
    _, o = _reference_chain(params, hcfg, feats, tokens, 1)  # o: logits of the root pair
    ids = lambda logits: [int(d2t[i]) if d2t is not None else int(i) for i in jax.lax.top_k(logits, 3)[1]]  # noqa
    top1 = ids(o.logits[0, -1])
    depth1 = [i for i in range(1, len(tok)) if par[i] == 0]
    # The best N - 1 nodes are kept: depth-1 nodes are among the root pair's top-k, its best one always.
    assert set(tok[depth1].tolist()) <= set(top1) and top1[0] in tok[depth1].tolist()
    checked = 0
    for i in range(1, len(tok)):
        if par[i] > 0:
            own, shared = params["own"], params["target"]
            toks = list(tokens[1:]) + [int(tok[par[i]])]
            h = jnp.concatenate([project_features(own, hcfg, feats[:, : len(tokens) - 1]), o.h[:, -1:]], axis=1)
            oo = attn_head_step(own, hcfg, shared, jnp.asarray([toks]), h, jnp.arange(len(toks))[None],
                                causal_attend)
            assert int(tok[i]) in ids(oo.logits[0, -1]), (i, tok.tolist(), par.tolist())
            checked += 1
    assert checked >= 1


# ---- 2. greedy speculative == plain greedy ----------------------------------------------------------

CASES = [
    ("eagle", 1, 3, 4), ("eagle", 2, 3, 6), ("eagle3", 1, 3, 4), ("eagle3", 2, 3, 6),
    ("medusa", 1, 3, 4), ("medusa", 2, 3, 6), ("mlp_speculator", 1, 3, 4),
    ("mtp_deepseek", 1, 3, 4), ("mtp_mimo", 2, 2, 5),
]
REQS = [Request([5, 9, 17, 33, 2, 7, 11][: 2 + 2 * i], SamplingParams(max_tokens=18)) for i in range(3)]


def ecfg(page_size, batch):
    return EngineSection(max_batch_size=batch, max_context=128, length_buckets=(16, 32, 64, 128),
                         batch_buckets=(1, batch), page_size=page_size)


@pytest.fixture(scope="module")
def plain(world):
    out = {}
    for name, model in [("llama", world.model)] + [(k, m) for k, m in world.mtp.items()]:
        out[name] = [r.output_ids for r in Engine(model.params, model.config, ecfg(16, 4), progress=False)
                     .generate(REQS)]
    return out


# Page size and batch alternate over the cases, so both meet every algorithm's chain or tree (the
# full product doubled the cases for one shared commit path).
@pytest.mark.parametrize("alg, topk, steps, n, page_size, batch",
                         [(*c, *[(1, 4), (16, 1)][(i + i // 2) % 2]) for i, c in enumerate(CASES)])
def test_greedy_equals_plain(world, plain, alg, topk, steps, n, page_size, batch):
    if alg.startswith("mtp"):
        model, spec, ref = world.mtp[alg[4:]], spec_for("nextn", None, topk, steps, n), plain[alg[4:]]
    else:
        model, spec, ref = world.model, spec_for(alg, world.heads[alg], topk, steps, n), plain["llama"]
    draft = load_draft(spec, model, jnp.float32, progress=False)
    engine = Engine(model.params, model.config, ecfg(page_size, batch), progress=False, spec=spec, draft=draft)
    out = engine.generate(REQS)
    assert [r.output_ids for r in out] == ref
    for r in out:
        assert sum(r.accept_lengths) == len(r.output_ids) - 1  # every token after prefill's came from verify
    # A second request of the same buckets compiles nothing (the drafter's state is all traced).
    again = {}
    assert compile_events(lambda: again.update(out=engine.generate(REQS))) == []
    assert [r.output_ids for r in again["out"]] == ref


# ---- 4. bad heads -----------------------------------------------------------------------------------


def test_wrong_head_kind_for_algorithm_is_named(world):
    with pytest.raises(ValueError, match=r"'eagle3' drives eagle3 heads, but .* holds a eagle head: use --spec eagle"):
        load_draft(spec_for("eagle3", world.heads["eagle"], 1, 3, 4), world.model, jnp.float32, progress=False)
    # Positive control: the same head under its own algorithm loads.
    assert load_draft(spec_for("eagle", world.heads["eagle"], 1, 3, 4), world.model, jnp.float32,
                      progress=False)[1].kind == "eagle"


def test_nextn_without_mtp_layers_is_named(world):
    with pytest.raises(ValueError, match="has no MTP layers"):
        load_draft(spec_for("nextn", None, 1, 3, 4), world.model, jnp.float32, progress=False)
    assert load_draft(spec_for("nextn", None, 1, 3, 4), world.mtp["mimo"], jnp.float32,
                      progress=False)[1].kind == "mtp_mimo"


def test_medusa_chain_longer_than_its_heads_is_refused(world):
    spec = spec_for("medusa", world.heads["medusa"], 1, 4, 5)
    draft = load_draft(spec, world.model, jnp.float32, progress=False)
    with pytest.raises(RequestError, match="needs 4 heads; the checkpoint has 3"):
        Engine(world.model.params, world.model.config, ecfg(16, 1), progress=False, spec=spec, draft=draft)


def test_medusa_tree_choices(world):
    spec = spec_for("medusa", world.heads["medusa"], 2, 2, 4, tree_choices="[[0], [1], [0, 0]]")
    draft = load_draft(spec, world.model, jnp.float32, progress=False)
    engine = Engine(world.model.params, world.model.config, ecfg(16, 1), progress=False, spec=spec, draft=draft)
    assert engine.drafter.rank_tree.parents == (-1, 0, 0, 1)
    bad = spec_for("medusa", world.heads["medusa"], 2, 2, 4, tree_choices="[[0], [0, 1, 1]]")
    with pytest.raises(RequestError, match="tree_choices"):
        Engine(world.model.params, world.model.config, ecfg(16, 1), progress=False, spec=bad,
               draft=load_draft(bad, world.model, jnp.float32, progress=False))


@pytest.mark.parametrize("choices, match", [
    ("[]", "non-empty"), ("[[0], [-1]]", "integer ranks >= 0"), ("[[0], [1, 0]]", "no parent \\[1\\]"),
    ("[[0], [0], [1]]", "appears twice"), ("[[0], [1.0], [0, 0]]", "integer ranks"), ("[[0], [5], [0, 0]]", "ranks up to 5"),
    ("[[0], [0, 0], [0, 0, 0]]", "3 deep"), ("[[0], []]", "non-empty list"), ("{}", "non-empty"),
])
def test_medusa_tree_choices_are_checked(world, choices, match):
    """Issue 23: malformed or inconsistent --tree-choices were accepted without a word."""
    spec = spec_for("medusa", world.heads["medusa"], 2, 2, 4, tree_choices=choices)
    with pytest.raises(RequestError, match=match):
        Engine(world.model.params, world.model.config, ecfg(16, 1), progress=False, spec=spec,
               draft=load_draft(spec, world.model, jnp.float32, progress=False))


def test_tree_choices_where_they_do_not_apply_are_refused(world):
    """Issue 23: --tree-choices where no tree reads it was silently ignored. The config refuses it
    for a drafter that does not read it (the MLP speculator); Medusa refuses it for a chain; EAGLE-3
    reads it for its sampled tree only, so greedy verify (no sampled tree) refuses it."""
    from jaxspec.speculative.algorithm import SpecConfigError, validate_spec_config

    spec = spec_for("mlp_speculator", world.heads["mlp_speculator"], 1, 2, 3, tree_choices="[[0], [1]]")
    with pytest.raises(SpecConfigError, match="tree_choices"):
        validate_spec_config(spec)
    spec = spec_for("medusa", world.heads["medusa"], 1, 2, 3, tree_choices="[[0], [1], [0, 0]]")
    validate_spec_config(spec)
    with pytest.raises(RequestError, match="tree_choices needs a tree"):
        Engine(world.model.params, world.model.config, ecfg(16, 1), progress=False, spec=spec,
               draft=load_draft(spec, world.model, jnp.float32, progress=False))
    spec = spec_for("eagle3", world.heads["eagle3"], 2, 2, 4, tree_choices="[[0], [1], [0, 0]]")
    for verify, refused in (("greedy", True), ("rejection", False)):  # the second: positive control
        s = dataclasses.replace(spec, verify=verify)
        draft = load_draft(s, world.model, jnp.float32, progress=False)
        if refused:
            with pytest.raises(RequestError, match="shapes the sampled tree only"):
                Engine(world.model.params, world.model.config, ecfg(16, 1), progress=False, spec=s, draft=draft)
        else:
            engine = Engine(world.model.params, world.model.config, ecfg(16, 1), progress=False, spec=s, draft=draft)
            assert engine.drafter.rank_tree.parents == (-1, 0, 0, 1)


def test_draft_model_default_picks_the_shipped_head(world, tmp_path, monkeypatch):
    """`--draft-model default` reads checkpoints/<shipped name>; absent, or for an algorithm without a
    shipped head, the error names the path or the algorithms that have one."""
    import jaxspec.paths as paths
    from jaxspec.speculative.algorithm import registration

    monkeypatch.setattr(paths, "checkpoints_dir", lambda: tmp_path)
    spec = spec_for("eagle3", "default", 1, 3, 4)
    with pytest.raises(ValueError, match=r"shipped eagle3 head is not at .*eagle3-smollm2-135m"):
        load_draft(spec, world.model, jnp.float32, progress=False)
    with pytest.raises(ValueError, match="no head ships for --spec mlp_speculator; shipped: eagle3, medusa, frozen_kv_mtp, dflash, dspark"):
        load_draft(spec_for("mlp_speculator", "default", 1, 3, 4), world.model, jnp.float32, progress=False)
    # Positive control: a head in the shipped place loads, read as SpecForge writes layer ids.
    write_eagle3_head(tmp_path / registration("eagle3").shipped_head, world.hf, layer_ids=[1, 2, 2], convention="output")
    params, hcfg = load_draft(spec, world.model, jnp.float32, progress=False)
    assert hcfg.kind == "eagle3" and hcfg.feature_layers == (1, 2, 2)
