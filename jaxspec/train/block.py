"""Training DFLASH and DSPARK block drafters, and writing them in the DFlash format.

The recipe is SpecForge's DFlash one. Each sequence gets `block_anchors`
random anchors a among positions whose next token is an assistant token; block
a is [x_a, MASK, ...] at positions a .. a + W - 1 and sees the target context
strictly before its anchor (features of positions < a, as the drafter's cache
holds them at propose time) and its own block bidirectionally, exactly the
inference forward (`jaxspec.models.heads.block`), batched over anchors with
the context K/V computed once per sequence.

Labels are the sequence's tokens (hard-label cross-entropy; on regenerated
data they are the target's own greedy tokens): DFLASH block position j >= 1
predicts x_{a+j}; DSPARK position j predicts x_{a+j+1}. Draft d (1-based) is
weighted exp(-(d - 1) / block_decay), SpecForge's gamma = 7. DSPARK adds the
Markov bias of the true previous token x_{a+d-1} (teacher forcing: the
drafted token equals it whenever the earlier drafts were accepted, the only
case its distribution matters for) and a confidence head trained with binary
cross-entropy against whether the position's draft (the argmax) is right.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.models.heads.block import (
    block_attend, block_hidden, block_logits, confidence_logit, context_kv, draft_log_odds, markov_bias, output_offset,
    project_context,
    window_mask,
)
from jaxspec.models.heads.config import HeadConfig

def runtime(params: dict) -> dict:
    """HF [out, in] -> the [in, out] the model functions read (differentiable: a transpose)."""
    def t(x):
        return x.T

    out = {k: v for k, v in params.items() if k not in ("layers", "fc", "markov_w2", "conf_w")}
    out["layers"] = [{k: (t(v) if k in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down") else v)
                      for k, v in layer.items()} for layer in params["layers"]]
    for k in ("fc", "markov_w2", "conf_w"):
        if k in params:
            out[k] = t(params[k])
    return out


def sample_anchors(batch: dict, rng, num: int) -> tuple[jax.Array, jax.Array]:
    """(anchors [B, A] int32, valid [B, A] bool): distinct positions a >= 1 whose first label is an
    assistant token inside the row, drawn uniformly (Gumbel top-k); rows with fewer get invalid ones."""
    tokens, lengths, lmask = batch["tokens"], batch["lengths"], batch["loss_mask"].astype(bool)
    b, t = tokens.shape
    pos = jnp.arange(t, dtype=jnp.int32)[None, :]
    first = pos + 1  # the first label is x_{a+1} for both kinds
    nxt = jnp.concatenate([lmask[:, 1:], jnp.zeros((b, 1), bool)], axis=1)
    ok = (pos >= 1) & (first < lengths[:, None]) & nxt
    g = jax.random.gumbel(rng, (b, t))
    score, idx = jax.lax.top_k(jnp.where(ok, g, -jnp.inf), num)
    return idx.astype(jnp.int32), jnp.isfinite(score)


def train_hidden(
    own: dict,  # runtime layout (`runtime`)
    hcfg: HeadConfig,
    shared: dict,
    tokens: jax.Array,  # [B, T] int32
    aux: jax.Array,  # [B, T, F] target features
    anchors: jax.Array,  # [B, A] int32
) -> jax.Array:  # [B, A, W, H] final-normed block states
    """Every anchor's block forward over the context before it: the inference forward, batched."""
    b, t = tokens.shape
    a, w = anchors.shape[1], hcfg.block_size
    j = jnp.arange(w, dtype=jnp.int32)
    qpos = anchors[:, :, None] + j[None, None, :]  # [B, A, W]
    block = jnp.where(j[None, None, :] == 0, jnp.take_along_axis(tokens, anchors, axis=1)[:, :, None],
                      hcfg.mask_token_id)
    # Context K/V once per sequence; block b sees context positions < its anchor.
    ctx = project_context(own, hcfg, aux.astype(jnp.float32))
    kpos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None, :], (b, t))
    k_ctx, v_ctx = context_kv(own, hcfg, ctx, kpos)  # [N, B, T, kvh, hd]
    before = kpos[:, None, None, :] < anchors[:, :, None, None]  # [B, A, 1, T]

    def attend(layer, q, k, v):  # q [B*A, W, nh, hd], k/v [B*A, W, kvh, hd]
        sh = lambda x: x.reshape(b, a, *x.shape[1:])  # noqa: E731
        vis = jnp.broadcast_to(before, (b, a, w, t))
        win = window_mask(hcfg, layer, qpos.reshape(b * a, w), jnp.repeat(kpos, a, axis=0))
        if win is not None:
            vis = vis & win.reshape(b, a, w, t)
        bwin = window_mask(hcfg, layer, qpos.reshape(b * a, w), qpos.reshape(b * a, w))
        o = block_attend(sh(q), k_ctx[layer], v_ctx[layer], sh(k), sh(v), vis,
                         None if bwin is None else bwin.reshape(b, a, w, w))
        return o.reshape(b * a, w, *o.shape[3:])

    hidden = block_hidden(own, hcfg, shared, block.reshape(b * a, w), qpos.reshape(b * a, w), attend)
    return hidden.reshape(b, a, w, -1)


def block_loss(params, batch, shared, rng, *, hcfg: HeadConfig, lcfg):
    """(loss, metrics) of one batch; `lcfg.block_anchors` anchors per row, decay `lcfg.block_decay`."""
    own = runtime(params)
    if rng is None:  # held-out evaluation: the same anchors every time
        rng = jax.random.PRNGKey(0)
    tokens, lengths, lmask = batch["tokens"], batch["lengths"], batch["loss_mask"].astype(bool)
    b, t = tokens.shape
    off = output_offset(hcfg)
    nd = hcfg.block_size - 1 + off  # drafts per block (dflash: the root's output is unused)
    # 1. Anchors; 2. their blocks' states, the drafting outputs only.
    anchors, valid = sample_anchors(batch, rng, min(lcfg.block_anchors, t))
    a = anchors.shape[1]
    hidden = train_hidden(own, hcfg, shared, tokens, batch["aux"], anchors)[:, :, 1 - off:1 - off + nd]
    # 3. Labels x_{a+d} for draft d = 1..D, weighted by depth.
    d = jnp.arange(1, nd + 1, dtype=jnp.int32)
    lab_pos = anchors[:, :, None] + d[None, None, :]  # [B, A, D]
    inside = lab_pos < lengths[:, None, None]
    lab_pos = jnp.minimum(lab_pos, t - 1)
    labels = jnp.take_along_axis(tokens, lab_pos.reshape(b, -1), axis=1).reshape(b, a, nd)
    counted = valid[:, :, None] & inside & jnp.take_along_axis(lmask, lab_pos.reshape(b, -1), axis=1).reshape(b, a, nd)
    logits = block_logits(shared, hidden)  # [B, A, D, V]
    if hcfg.kind == "dspark":
        prev = jnp.take_along_axis(tokens, (lab_pos - 1).reshape(b, -1), axis=1).reshape(b, a, nd)
        logits = logits + markov_bias(own, prev)
    logp = jax.nn.log_softmax(logits, axis=-1)
    ce = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
    hit = (jnp.argmax(logits, axis=-1) == labels) & counted
    wd = jnp.exp(-(d.astype(jnp.float32) - 1.0) / lcfg.block_decay)
    cnt = jnp.maximum(jnp.sum(counted, axis=(0, 1)).astype(jnp.float32), 1.0)  # [D]
    per_pos = jnp.sum(jnp.where(counted, ce, 0.0), axis=(0, 1)) / cnt
    loss = jnp.sum(wd * per_pos) / jnp.sum(wd)
    metrics = {"loss": loss, "step_loss": per_pos, "acc": jnp.sum(hit, axis=(0, 1)) / cnt}
    if hcfg.confidence:
        odds = jax.lax.stop_gradient(draft_log_odds(logits))  # confidence does not train the drafts
        z = confidence_logit(own, hidden.reshape(b * a, nd, -1), odds.reshape(b * a, nd)).reshape(b, a, nd)
        y = jax.lax.stop_gradient(hit.astype(jnp.float32))
        bce = jnp.maximum(z, 0) - z * y + jnp.log1p(jnp.exp(-jnp.abs(z)))
        conf_loss = jnp.sum(jnp.where(counted, bce, 0.0)) / jnp.maximum(jnp.sum(counted), 1)
        loss = loss + conf_loss
        # How well confidence separates right drafts from wrong ones: mean c on hits minus on misses.
        c = jax.nn.sigmoid(z)
        miss = counted & ~hit
        gap = (jnp.sum(jnp.where(hit, c, 0.0)) / jnp.maximum(jnp.sum(hit), 1)
               - jnp.sum(jnp.where(miss, c, 0.0)) / jnp.maximum(jnp.sum(miss), 1))
        metrics.update(loss=loss, conf_loss=conf_loss, conf_gap=gap)
    return loss, metrics
