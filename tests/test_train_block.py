"""Training DFLASH and DSPARK drafters (jaxspec/train/block.py), on tests/test_train.py's tiny target.

1. The training forward (anchors batched, context before each anchor, the block bidirectional)
   equals the inference drafter's forward over the same context (prefill through its own cache).
2. A few hundred steps: the loss falls, held-out top-1 of draft 1 rises (DSPARK: its confidence
   loss falls too), the export loads through the CLI's loader, greedy speculative output equals
   plain greedy, and the trained drafter's τ beats the untrained one's.
3. Export -> load round trip: the same logits.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.cache.paged import KVCache
from jaxspec.models.heads.block import block_logits
from jaxspec.models.heads.family import init_head_params
from jaxspec.models.heads.loading import load_draft_head
from jaxspec.speculative.drafters.block import BlockDrafter
from jaxspec.speculative.types import Committed
from jaxspec.train import block as B
from jaxspec.train import trainer as tr
from jaxspec.train.export import export_head
from tests.test_train import LAYERS, RESPONSE, assert_exact_and_faster, small, world  # noqa: F401  (world: fixture)


def bsmall(kind, **kw):
    return small(drafter=kind, block_size=6 if kind == "dflash" else 5, block_layers=1, block_anchors=12,
                 mask_token_id=255, markov_rank=8, feature_layers=LAYERS, lr=2e-3, **kw)


def _perturbed(params, seed):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: x + 0.2 * rng.standard_normal(x.shape).astype(np.float32), params)


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_training_forward_equals_the_drafter(world, kind):  # noqa: F811
    model = world["model"]
    cfg = bsmall(kind)
    hcfg = tr.make_head_config(cfg, model.config)
    shared = tr.shared_target(model)
    params = _perturbed(init_head_params(hcfg, 1), 2)
    b = world["held"][0]
    tokens, aux = jnp.asarray(b["tokens"][:2]), jnp.asarray(b["aux"][:2].astype(np.float32))
    anchors = jnp.array([[4, 11, 20], [7, 15, 30]], jnp.int32)
    got = B.train_hidden(B.runtime(params), hcfg, shared, tokens, aux, anchors)  # [2, 3, W, H]
    drafter = BlockDrafter(hcfg, hcfg.block_size + (kind == "dspark"), False)
    dparams = {"own": drafter.prepare_params(params, native=False, unstack=None),
               "target": {"embed": shared["embed"], "head": shared["head"]}}
    c = hcfg.layer
    for row in range(2):
        for k in range(3):
            a = int(anchors[row, k])
            state = drafter.init_state(KVCache.zeros(c.num_layers, 5, 16, c.num_kv_heads, c.head_dim), 1)
            table = jnp.arange(1, 5)[None]
            chunk = Committed(tokens[row:row + 1, :a], aux[row:row + 1, :a], jnp.array([0]), jnp.array([a]))
            state = drafter.prefill(dparams, state, chunk, table)
            want = drafter.hidden(dparams, state, tokens[row:row + 1, a], jnp.array([a]), table)
            np.testing.assert_allclose(np.asarray(got[row, k]), np.asarray(want[0]), rtol=2e-4, atol=2e-4)
    # Positive control: anchors one later see one more context token and give other states.
    late = B.train_hidden(B.runtime(params), hcfg, shared, tokens, aux, anchors + 1)
    assert not np.allclose(np.asarray(late[0, 0]), np.asarray(got[0, 0]), atol=1e-3)


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_block_drafter_trains_and_speeds_up_the_engine(world, kind):  # noqa: F811
    model, run = world["model"], world["tmp"].mktemp(kind)
    cfg = bsmall(kind, total_steps=300, log_every=50)
    hcfg = tr.make_head_config(cfg, model.config)
    shared = tr.shared_target(model)
    fresh = tr.init_train_params(hcfg, shared, cfg.seed)
    evaluate = tr.heldout_eval(world["held"], hcfg, shared, cfg)
    before = evaluate(fresh)
    res = tr.train(cfg, model, world["train"], run, heldout=world["held"], progress=False)
    log = tr.read_log(run)
    after = log[-1]["eval"]
    assert after["heldout_loss"] < 0.7 * before["heldout_loss"], (before, after)
    assert after["heldout_acc"][0] > before["heldout_acc"][0] + 0.2, (before, after)
    assert len(log[-1]["acc"]) == hcfg.block_size - 1 + (kind == "dspark")
    if kind == "dspark":  # confidence separates right drafts from wrong ones, better than at the start
        assert log[-1]["conf_gap"] > 0.15 and log[-1]["conf_loss"] < log[0]["conf_loss"], (log[0], log[-1])
    # The export is the published format, loads through the CLI's loader, and keeps greedy output exact.
    written = json.loads((run / "head" / "config.json").read_text())
    assert written["architectures"] == ["DFlashDraftModel" if kind == "dflash" else "DSparkDraftModel"]
    assert written[f"{kind}_config"]["target_layer_ids"] == [k - 1 for k in LAYERS]  # z-lab's output ids
    head = load_draft_head(run / "head", model.config)
    assert head.config == hcfg
    ps, plain = world["held_prompts"][:8], world["held_plain"][:8]
    n = hcfg.block_size + (kind == "dspark")
    he = tr.HeadEngine(res.hcfg, model, ps, max_new_tokens=RESPONSE, num_draft_tokens=n)
    assert_exact_and_faster(he, res.params, fresh, plain)


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_block_export_round_trip(world, kind, tmp_path):  # noqa: F811
    model = world["model"]
    hcfg = tr.make_head_config(bsmall(kind), model.config)
    params = _perturbed(init_head_params(hcfg, 3), 4)
    export_head(params, hcfg, tmp_path / kind, num_target_layers=model.config.num_layers)
    loaded = load_draft_head(tmp_path / kind, model.config)
    assert loaded.config == hcfg
    shared = tr.shared_target(model)
    b = world["held"][0]
    tokens, aux = jnp.asarray(b["tokens"][:2]), jnp.asarray(b["aux"][:2].astype(np.float32))
    anchors = jnp.array([[3, 9], [12, 25]], jnp.int32)

    def logits(p):
        return block_logits(shared, B.train_hidden(B.runtime(p), hcfg, shared, tokens, aux, anchors))

    np.testing.assert_array_equal(np.asarray(logits(params)), np.asarray(logits(loaded.params)))
    if kind == "dspark":
        for k in ("markov_w1", "markov_w2", "conf_w", "conf_b"):
            np.testing.assert_array_equal(np.asarray(params[k]), np.asarray(loaded.params[k]))
