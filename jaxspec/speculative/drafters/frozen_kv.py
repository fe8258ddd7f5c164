"""FROZEN_KV_MTP: draft layers over the target's own cached K/V (SGLang's Gemma 4 assistant runtime).

The drafter declares `target_kv_layers`, so `propose` gets those layers' paged K/V (`s.cache`, a
`types.TargetKV` sliced from the loop's carry, no copy) and reads them; it allocates no KV and
writes none (`draft_cache_cfg` is None, `scratch_tokens` 0). Its only state is the seed: the
target's final-norm state at the last committed slot with K/V (the pending feature of
`drafters.features`), which prefill and `observe` move; there is no draft-extend.

A round: every draft query sits at RoPE position hist_len - 2 and sees target slots 0 .. hist_len - 2
(the root's K/V is the verify's to write). Draft tokens make no K/V, so a draft node differs from its
siblings only by its token and its parent's h, and the in-flight state held in registers is each
node's h (what EAGLE's drafter holds as K/V). The target pages are gathered once per round and every
step reuses them. Chains; EAGLE-2 trees (top-k expansion by cumulative log-prob, then the best
num_draft_tokens - 1 nodes); on sampled rows under rejection verify, chains sampled from q and
sampled multi-draft trees on a fixed rank tree (`drafters.sampled_tree`).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxspec.cache.attention import gather_pages
from jaxspec.models.heads.attn_head import draft_to_target
from jaxspec.models.heads.config import HeadConfig
from jaxspec.models.heads.frozen_kv import frozen_kv_step, window_mask
from jaxspec.speculative.algorithm import AlgorithmInfo
from jaxspec.speculative.drafters.features import (
    FeatureState, chain_proposal, choose_draft, expand_frontier, topk_children,
)
from jaxspec.speculative.drafters.heads import _PendingOnly
from jaxspec.speculative.drafters.load import register_head
from jaxspec.speculative.drafters.sampled_tree import SampledTrees, TreeDraws, greedy_or_sampled, parse_choices
from jaxspec.speculative.tree import organize_draft_tree, root_step, select_frontier
from jaxspec.speculative.types import Proposal


@dataclasses.dataclass(frozen=True)
class FrozenKVDrafter(SampledTrees, _PendingOnly):
    """State = the seed (the pending final-norm feature), as the Medusa / MLP-speculator drafters'."""

    head: HeadConfig
    num_steps: int
    topk: int
    num_draft_tokens: int
    sample_drafts: bool  # rejection verify on sampled rows: chains and sampled trees return q
    coupled: bool = False  # coupled verify: the chain races with the target's noise
    tree_sampling: str = "sampled"
    choices: tuple[tuple[int, ...], ...] = ()

    shares_target = ("embed",)  # its own LM head

    @property
    def target_kv_layers(self) -> tuple[int, ...]:
        return self.head.target_kv_layers

    # ---- drafting ----------------------------------------------------------------------------

    def _context(self, s) -> list:
        """Per draft layer (k, v [B, S, kvh, hd], visible [B, 1, S]): the committed prefix of its
        target layer, gathered once for the whole round."""
        kv = s.cache
        if kv is None or tuple(kv.layers) != self.target_kv_layers:
            raise ValueError(f"FrozenKVDrafter needs target layers {self.target_kv_layers} in propose, got "
                             f"{getattr(kv, 'layers', None)}")
        n = jnp.maximum(s.hist_len - 1, 1)  # slots 0 .. n - 1 hold committed K/V
        out = []
        for i, (k, v) in enumerate(zip(kv.k, kv.v)):
            kg, vg = gather_pages(k, s.page_table), gather_pages(v, s.page_table)
            visible = (jnp.arange(kg.shape[1], dtype=jnp.int32)[None, :] < n[:, None])[:, None]
            out.append((kg, vg, window_mask(visible, n[:, None], self.head, i)))
        return out

    def propose(self, params, state: FeatureState, s) -> Proposal:
        b = s.hist_len.shape[0]
        root = jnp.take_along_axis(s.history, jnp.maximum(s.hist_len - 1, 0)[:, None], axis=1)[:, 0]
        pos = jnp.maximum(s.hist_len - 2, 0)  # the last slot with K/V: every query's RoPE position
        ctx = self._context(s)
        own, shared = params["own"], params["target"]
        d2t = draft_to_target(own, self.head) if "d2t" in own else None

        def step(tokens, h):  # tokens [B, T], h [B, T, H]
            return frozen_kv_step(own, self.head, shared, tokens, h, jnp.broadcast_to(pos[:, None], tokens.shape), ctx)

        h, logits = step(root[:, None], state.pending[:, None].astype(jnp.float32))
        if self.topk == 1:
            return self._chain(s, root, h, logits, step, d2t, state)
        args = (s, root, h, logits, step, d2t)
        if not self.sampled_tree:
            return Proposal(*self._tree(*args), None, state)
        shape = (b, self.num_draft_tokens, self.head.layer.vocab_size)
        return Proposal(*greedy_or_sampled(s, lambda: self._tree(*args), lambda: self._sampled_tree(*args), shape),
                        state)

    def _chain(self, s, root, h, logits, step, d2t, state):
        drafts, qs = [], []
        for depth in range(1, self.num_draft_tokens):
            tok, q = choose_draft(logits[:, -1], s, drafts, d2t, self.head.layer.vocab_size, self.sample_drafts,
                                  self.coupled)
            drafts.append(tok)
            qs.append(q)
            if depth < self.num_draft_tokens - 1:
                h, logits = step(tok[:, None], h)
        return chain_proposal(root, drafts, qs, self.sample_drafts, state)

    def _tree(self, s, root, h, logits, step, d2t):
        k, b = self.topk, root.shape[0]
        # 1. The root's children.
        s0, t0 = topk_children(logits[:, -1], k, d2t)
        tok0, sc0 = root_step(t0, s0)
        step_tokens, step_scores = [tok0], [sc0]
        step_frontier = [jnp.zeros((b, k), jnp.int32)]
        front_h = jnp.broadcast_to(h, (b, k, h.shape[-1]))  # h of each candidate's parent, per frontier row
        for _ in range(1, self.num_steps):
            # 2. Feed the K best candidates (flat f*K + c) with their parents' h: K queries at one position.
            front = select_frontier(step_scores[-1])
            step_frontier.append(front)
            fed_tok = jnp.take_along_axis(step_tokens[-1].reshape(b, k * k), front, axis=1)
            fed_sc = jnp.take_along_axis(step_scores[-1].reshape(b, k * k), front, axis=1)
            h_in = jnp.take_along_axis(front_h, (front // k)[:, :, None], axis=1)
            front_h, out = step(jnp.maximum(fed_tok, 0), h_in)
            # 3. Their children, scored by cumulative log-prob.
            ct, cs = expand_frontier(out, fed_tok, fed_sc, k, d2t)
            step_tokens.append(ct)
            step_scores.append(cs)
        tokens, parents, _ = organize_draft_tree(
            root, jnp.stack(step_tokens, 1), jnp.stack(step_scores, 1), jnp.stack(step_frontier, 1),
            self.num_draft_tokens)
        return tokens, parents

    def _sampled_tree(self, s, root, h, logits, step, d2t):
        t = self.rank_tree
        draws = TreeDraws.start(t, root)
        node_h, node_logits = {0: h[:, -1]}, {0: logits[:, -1]}
        for depth in range(1, t.depth + 1):
            draws.draw_level(depth, jnp.stack([node_logits[n] for n in t.expanded(depth - 1)], axis=1), s, d2t,
                             self.head.layer.vocab_size)
            fed = t.expanded(depth)
            if not fed:
                break
            tokens = jnp.stack([jnp.maximum(draws.tokens[n], 0) for n in fed], axis=1)
            out_h, out = step(tokens, jnp.stack([node_h[t.parents[n]] for n in fed], axis=1))
            for j, n in enumerate(fed):
                node_h[n], node_logits[n] = out_h[:, j], out[:, j]
        return draws.proposal()


def _make(plan, spec, head, sample) -> FrozenKVDrafter:
    choices = tuple(parse_choices(spec.tree_choices)) if spec.tree_choices else ()
    return FrozenKVDrafter(head, plan.num_steps, plan.topk, plan.num_draft_tokens, sample,
                           tree_sampling=spec.tree_sampling, choices=choices)


register_head("frozen_kv_mtp", AlgorithmInfo(needs_draft_model=True, supports_tree=True, description=(
    "FROZEN_KV_MTP: draft layers over the target's own K/V (Gemma 4 assistant layout); no draft KV")), _make,
    head_kinds=("frozen_kv",), shipped_head="frozen-kv-smollm2-135m", reads=("tree_choices", "tree_sampling"))
