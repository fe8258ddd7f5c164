"""Drafter training losses: EAGLE-3 with training-time test, FROZEN_KV_MTP, EAGLE-1, Medusa. Pure JAX.

Every loss is `loss(params, batch, shared, rng, *, hcfg, lcfg) -> (scalar, metrics)` with
`params` the head's trainable weights in the loaders' Hugging Face layout (what
`init_head_params` / `load_draft_head` give, without the integer `d2t`), so `jax.grad` of it
trains exactly the tensors `export.py` writes. `batch` is the data interface of
`jaxspec.train.data` (arrays, right-padded rows):

    tokens [B, T] int32, lengths [B] int32, loss_mask [B, T] bool (assistant tokens),
    aux [B, T, 3H] (residual stream entering the EAGLE-3 layers), final [B, T, H] (final-norm state)

and `shared` the target's runtime tensors the heads read (`embed` [V, H], `head` [H, V]) plus,
for EAGLE-3, `draft_ids` [Vd] (the target id of each draft id, sorted) and `t2d` [V] bool.

THE PAIRING is the inference drafter's (jaxspec/speculative/drafters/features.py): pair i is
(h_i, x_{i+1}) at RoPE position i, and its output predicts x_{i+2}, whose target distribution is
softmax(final_{i+1} @ head). A prediction of token x_j counts where loss_mask[j] (x_j is an
assistant token) and j < length.

EAGLE-3 TTT (SpecForge specforge/core/eagle3.py OnlineEagle3Model, sdpa backend): step s at
index i is depth s of the chain rooted at pair i. Its input is the head's own step s-1 output h
at index i with the token x_{i+1+s}, at RoPE position i + s (SpecForge's `position_ids + lck`);
it predicts x_{i+2+s} from the target distribution at position i+1+s. Its query attends to the
step-0 keys j <= i (the true pairs 0..i: the drafter's cache plus the root pair) and to the
diagonal key i of each step 1..s (its own chain's earlier draft nodes), SpecForge's cache
concatenation. Soft cross-entropy against the target softmax restricted to the draft vocabulary;
positions whose target argmax (full vocabulary) lies outside it are masked; the per-step loss is
the masked sum over the loss-mask count of that step (SpecForge divides top-1 by that count, and
its loss by B*T: only the scale differs), weighted 0.8^s. Top-1 = draft argmax == target
argmax on those positions, over the same count.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.models.heads.attn_head import attn_head_step, prepare_head_params, project_features
from jaxspec.models.heads.config import HeadConfig
from jaxspec.models.heads.medusa import medusa_logits


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Static loss settings (hashable: part of the jitted step's cache key)."""

    ttt_length: int = 7  # EAGLE-3 unrolled steps
    step_weight_decay: float = 0.8  # weight of step s (EAGLE-3) / head s (Medusa): decay ** s
    eagle_noise: float = 0.2  # EAGLE-1 uniform feature noise: U(-0.5, 0.5) * eagle_noise
    eagle_ploss_weight: float = 0.1  # EAGLE-1: SmoothL1 + w * cross-entropy
    medusa_labels: str = "argmax"  # "argmax": the target's greedy token; "tokens": the sequence's
    remat: bool = False  # recompute each step's activations in backward (logits over Vd x T x 7)
    block_anchors: int = 16  # DFLASH / DSPARK: blocks per sequence
    block_decay: float = 7.0  # DFLASH / DSPARK: draft d weighs exp(-(d - 1) / block_decay)


def shift(x: jax.Array, n: int) -> jax.Array:
    """x[:, n:] padded with zeros at the end to the same length (SpecForge's padding(left=False))."""
    if n == 0:
        return x
    pad = jnp.zeros((x.shape[0], n) + x.shape[2:], x.dtype)
    return jnp.concatenate([x[:, n:], pad], axis=1)


def predicts_mask(batch: dict, j_offset: int) -> jax.Array:
    """[B, T]: the prediction at index i of token x_{i + j_offset} counts (in the row, loss-masked)."""
    t = batch["tokens"].shape[1]
    i = jnp.arange(t, dtype=jnp.int32)[None, :]
    inside = i + j_offset < batch["lengths"][:, None]
    return inside & shift(batch["loss_mask"].astype(bool), j_offset)


def _repeat_kv(x: jax.Array, heads: int) -> jax.Array:
    return jnp.repeat(x, heads // x.shape[2], axis=2)


def causal_attend(q, k, v):
    """Plain causal attention, q [B,T,nh,hd], k/v [B,T,kvh,hd] -> [B,T,nh,hd] (float32 softmax)."""
    nh, t = q.shape[2], q.shape[1]
    k, v = _repeat_kv(k, nh), _repeat_kv(v, nh)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s.astype(jnp.float32), -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1).astype(v.dtype), v)


def ttt_attend(prev: list[tuple[jax.Array, jax.Array]]):
    """The attention of TTT step len(prev): causal over step 0's K/V, plus the query's own
    diagonal entry of every later step (the current one included)."""

    def attend(q, k, v):
        steps = prev + [(k, v)]
        nh, t = q.shape[2], q.shape[1]
        scale = q.shape[-1] ** -0.5
        k0, v0 = _repeat_kv(steps[0][0], nh), _repeat_kv(steps[0][1], nh)
        s0 = jnp.einsum("bqhd,bkhd->bhqk", q, k0).astype(jnp.float32) * scale
        s0 = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s0, -jnp.inf)
        diag = [jnp.einsum("bqhd,bqhd->bhq", q, _repeat_kv(ki, nh)).astype(jnp.float32)[..., None] * scale
                for ki, _ in steps[1:]]
        p = jax.nn.softmax(jnp.concatenate([s0] + diag, axis=-1), axis=-1)
        o = jnp.einsum("bhqk,bkhd->bqhd", p[..., :t].astype(v0.dtype), v0)
        for n, (_, vi) in enumerate(steps[1:]):
            w = jnp.transpose(p[..., t + n], (0, 2, 1))[..., None]  # [B, T, nh, 1]
            o = o + w.astype(vi.dtype) * _repeat_kv(vi, nh)
        return o

    return attend


def _f32(x) -> jax.Array:
    return jnp.asarray(x).astype(jnp.float32)


def _masked_mean(x: jax.Array, mask: jax.Array, count: jax.Array) -> jax.Array:
    return jnp.sum(jnp.where(mask, x, 0.0)) / jnp.maximum(count, 1.0)


def trainable(params: dict) -> dict:
    """The float tensors of a HF-layout head (drops the integer d2t / bool t2d maps)."""
    return {k: v for k, v in params.items() if k not in ("d2t", "t2d")}


# --------------------------------------------------------------------------- #
# EAGLE-3
# --------------------------------------------------------------------------- #


def eagle3_targets(batch: dict, shared: dict) -> tuple[jax.Array, jax.Array]:
    """(target_p [B, T, Vd] over the draft vocabulary, in_draft [B, T]) at every position: the
    target's next-token distribution restricted (and renormalised) to the draft ids, and whether
    its full-vocabulary argmax is a draft token. No gradient."""
    final = _f32(batch["final"])
    logits = final @ shared["head"].astype(jnp.float32)  # [B, T, V]
    in_draft = shared["t2d"][jnp.argmax(logits, axis=-1)]
    p = jax.nn.softmax(jnp.take(logits, shared["draft_ids"], axis=-1), axis=-1)
    return jax.lax.stop_gradient(p), in_draft


def eagle3_ttt(params: dict, hcfg: HeadConfig, shared: dict, batch: dict, ttt_length: int, per_step,
               remat: bool = False) -> list:
    """Run the TTT unroll; `per_step(s, logits [B, T, Vd]) -> value` is called inside each step (and
    rematerialised with it). Returns the list of per-step values."""
    own = prepare_head_params(params, hcfg)
    tokens = batch["tokens"]
    t = tokens.shape[1]
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], tokens.shape)
    h = project_features(own, hcfg, _f32(batch["aux"]))

    values, prev = [], []
    for s in range(ttt_length):
        def one(own, h, prev, s=s):
            captured = []
            base = ttt_attend(list(prev))

            def attend(q, k, v):
                captured.append((k, v))
                return base(q, k, v)

            out = attn_head_step(own, hcfg, shared, shift(tokens, 1 + s), h, pos + s, attend)
            return out.h, captured[0], per_step(s, out.logits)

        fn = jax.checkpoint(one) if remat else one
        h, kv, val = fn(own, h, tuple(prev))
        prev.append(kv)
        values.append(val)
    return values


def _distill_step(batch: dict, target_p: jax.Array, in_draft: jax.Array, s: int, logits: jax.Array):
    """(loss, top-1) of unrolled step s, whose prediction at index i is token x_{i+2+s}."""
    tp = shift(target_p, 1 + s)
    counted = predicts_mask(batch, 2 + s)
    mask = counted & shift(in_draft, 1 + s)
    count = jnp.sum(counted).astype(jnp.float32)
    ce = -jnp.sum(tp * jax.nn.log_softmax(logits, axis=-1), axis=-1)
    hit = jnp.argmax(logits, axis=-1) == jnp.argmax(tp, axis=-1)
    return _masked_mean(ce, mask, count), _masked_mean(hit.astype(jnp.float32), mask, count)


def _weighted(vals: list, lcfg: LossConfig):
    losses = jnp.stack([v[0] for v in vals])
    acc = jnp.stack([v[1] for v in vals])
    w = lcfg.step_weight_decay ** jnp.arange(len(vals), dtype=jnp.float32)
    loss = jnp.sum(w * losses)
    return loss, {"loss": loss, "step_loss": losses, "acc": acc}


def eagle3_loss(params, batch, shared, rng, *, hcfg: HeadConfig, lcfg: LossConfig):
    del rng
    target_p, in_draft = eagle3_targets(batch, shared)
    per_step = lambda s, logits: _distill_step(batch, target_p, in_draft, s, logits)  # noqa: E731
    return _weighted(eagle3_ttt(params, hcfg, shared, batch, lcfg.ttt_length, per_step, lcfg.remat), lcfg)


# --------------------------------------------------------------------------- #
# FROZEN_KV_MTP
# --------------------------------------------------------------------------- #


def frozen_kv_context(batch: dict, shared: dict, hcfg: HeadConfig) -> list:
    """Per draft layer (k, v [B, T, kvh, hd], visible [B, T, T]): the target's own K/V of its layer,
    recomputed from the captured residual entering it (`aux`) with the target's frozen input norm,
    k/v projections and RoPE, exactly what its cache holds. Query i sees keys 0 .. i."""
    from jaxspec.models.heads.frozen_kv import window_mask
    from jaxspec.models.layers import apply_rope, linear, rms_norm, rope_inv_freq, rope_tables

    c, h = hcfg.layer, hcfg.target_hidden_size
    tokens = batch["tokens"]
    b, t = tokens.shape
    aux = _f32(batch["aux"])
    cos, sin = rope_tables(jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t)), rope_inv_freq(c))
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool))[None], (b, t, t))
    i = jnp.broadcast_to(jnp.arange(1, t + 1, dtype=jnp.int32)[None, :], (b, t))
    out = []
    for j in range(len(hcfg.target_kv_layers)):
        y = rms_norm(aux[..., j * h:(j + 1) * h], shared["kv_norm"][j], shared["kv_eps"])
        k = apply_rope(linear(y, shared["kv_wk"][j]).reshape(b, t, c.num_kv_heads, c.head_dim), cos, sin)
        v = linear(y, shared["kv_wv"][j]).reshape(b, t, c.num_kv_heads, c.head_dim)
        out.append((jax.lax.stop_gradient(k), jax.lax.stop_gradient(v), window_mask(causal, i, hcfg, j)))
    return out


def frozen_kv_loss(params, batch, shared, rng, *, hcfg: HeadConfig, lcfg: LossConfig):
    """The inference rounds, unrolled: step s at index i is draft s + 1 of the round whose last slot
    with K/V is i (seed h = the target's final-norm state at i, root x_{i+1}); every step's query
    sits at position i and sees target keys 0 .. i, its h is the previous step's output and its
    token x_{i+1+s} (the accepted draft). Targets and weights as EAGLE-3's."""
    del rng
    from jaxspec.models.heads.frozen_kv import frozen_kv_step, prepare_frozen_kv_params

    target_p, in_draft = eagle3_targets(batch, shared)
    own = prepare_frozen_kv_params(params, hcfg)
    tokens = batch["tokens"]
    pos = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32)[None], tokens.shape)
    ctx = frozen_kv_context(batch, shared, hcfg)
    h, vals = _f32(batch["final"]), []
    for s in range(lcfg.ttt_length):
        def one(own, h, s=s):
            h, logits = frozen_kv_step(own, hcfg, shared, shift(tokens, 1 + s), h, pos, ctx)
            return h, _distill_step(batch, target_p, in_draft, s, logits)

        h, val = (jax.checkpoint(one) if lcfg.remat else one)(own, h)
        vals.append(val)
    return _weighted(vals, lcfg)


# --------------------------------------------------------------------------- #
# EAGLE-1
# --------------------------------------------------------------------------- #


def _smooth_l1(d: jax.Array) -> jax.Array:  # torch SmoothL1Loss, beta 1
    a = jnp.abs(d)
    return jnp.where(a < 1.0, 0.5 * d * d, a - 0.5)


def eagle_loss(params, batch, shared, rng, *, hcfg: HeadConfig, lcfg: LossConfig):
    """EAGLE-1 (SafeAILab eagle/train/main.py): pair (h_i + noise, x_{i+1}) -> the head's output
    regresses h_{i+1} (SmoothL1, mean over H) and its logits through the target LM head match
    softmax(h_{i+1} @ head) (soft cross-entropy, weight eagle_ploss_weight). The noise is EAGLE's
    AddUniformNoise, (U(0, 1) - 0.5) * eagle_noise, without its 512 / T factor; rng None = none."""
    own = prepare_head_params(params, hcfg)
    final = _f32(batch["final"])
    tokens = batch["tokens"]
    t = tokens.shape[1]
    h_in = final
    if rng is not None and lcfg.eagle_noise > 0:
        h_in = final + (jax.random.uniform(rng, final.shape) - 0.5) * lcfg.eagle_noise
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], tokens.shape)
    out = attn_head_step(own, hcfg, shared, shift(tokens, 1), h_in, pos, causal_attend)
    target_h = shift(final, 1)
    mask = predicts_mask(batch, 2)
    count = jnp.sum(mask).astype(jnp.float32)
    vloss = _masked_mean(jnp.mean(_smooth_l1(out.h - target_h), axis=-1), mask, count)
    tlogits = target_h @ shared["head"].astype(jnp.float32)
    tp = jax.lax.stop_gradient(jax.nn.softmax(tlogits, axis=-1))
    ploss = _masked_mean(-jnp.sum(tp * jax.nn.log_softmax(out.logits, axis=-1), axis=-1), mask, count)
    hit = (jnp.argmax(out.logits, axis=-1) == jnp.argmax(tlogits, axis=-1)).astype(jnp.float32)
    acc = _masked_mean(hit, mask, count)
    loss = vloss + lcfg.eagle_ploss_weight * ploss
    return loss, {"loss": loss, "step_loss": jnp.stack([ploss]), "vloss": vloss, "acc": jnp.stack([acc])}


# --------------------------------------------------------------------------- #
# Medusa
# --------------------------------------------------------------------------- #


def medusa_loss(params, batch, shared, rng, *, hcfg: HeadConfig, lcfg: LossConfig):
    """Head k reads final_t and predicts x_{t+k+2} (FasterDecoding train_legacy.py). Hard labels:
    medusa_labels="argmax" (default) takes the target's own greedy token there, argmax(final_{t+k+1}
    @ head), which is what greedy verification accepts; "tokens" takes the sequence's token.
    Cross-entropy per head, weighted step_weight_decay ** k (Medusa's decay 0.8)."""
    del rng
    own = prepare_head_params(params, hcfg)
    final = _f32(batch["final"])
    b, t, hdim = final.shape
    if lcfg.medusa_labels == "argmax":
        greedy = jnp.argmax(final @ shared["head"].astype(jnp.float32), axis=-1).astype(jnp.int32)
    elif lcfg.medusa_labels != "tokens":
        raise ValueError(f"medusa_labels must be 'argmax' or 'tokens', got {lcfg.medusa_labels!r}")
    one_cfg = dataclasses.replace(hcfg, num_heads=1)

    def head_loss(k, own_k, x):
        logits = medusa_logits(own_k, one_cfg, shared, x.reshape(b * t, hdim))[:, 0].reshape(b, t, -1)
        labels = shift(greedy, k + 1) if lcfg.medusa_labels == "argmax" else shift(batch["tokens"], k + 2)
        mask = predicts_mask(batch, k + 2)
        count = jnp.sum(mask).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
        hit = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)
        return _masked_mean(nll, mask, count), _masked_mean(hit, mask, count)

    losses, accs = [], []
    for k in range(hcfg.num_heads):
        own_k = {"res_w": [own["res_w"][k]], "res_b": [own["res_b"][k]]}
        if "heads" in own:
            own_k["heads"] = [own["heads"][k]]
        fn = jax.checkpoint(head_loss, static_argnums=(0,)) if lcfg.remat else head_loss
        lo, ac = fn(k, own_k, final)
        losses.append(lo)
        accs.append(ac)
    losses, accs = jnp.stack(losses), jnp.stack(accs)
    w = lcfg.step_weight_decay ** jnp.arange(hcfg.num_heads, dtype=jnp.float32)
    loss = jnp.sum(w * losses)
    return loss, {"loss": loss, "step_loss": losses, "acc": accs}
