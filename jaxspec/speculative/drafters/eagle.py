"""EAGLE-family drafters: EAGLE-1, EAGLE-3 and the MTP/NEXTN layers, chains and EAGLE-2 trees.

One decoder-layer head (`jaxspec.models.heads.attn_head`) over (feature,
token) pairs with its own one-layer paged KV cache; the pending-feature
convention and the pair layout are in `jaxspec.speculative.drafters.features`.

Drafting never writes the cache: the draft nodes' K/V (the pair (pending,
root) first, then one node per chain step or K per tree step) stay in
registers as an in-flight block that each step's queries attend to beside the
cached prefix, with an ancestor mask for trees. So `scratch_tokens` is 0 and
a rejected draft leaves nothing behind; `observe` then writes the K/V of the
pairs that were committed (K/V only: no attention, MLP or LM head), which is
the draft-extend. EAGLE-2's tree: top-k expansion by cumulative log-prob over
`num_steps` (`select_frontier`), then the best num_draft_tokens - 1 nodes
(`organize_draft_tree`), as the standalone drafter does.

Sampled rows (rejection verify): chains sample each draft from the head's
distribution under the request's temperature / top-k / top-p and return q over
the target vocabulary; trees are sampled multi-draft trees on a fixed rank tree
(`drafters.sampled_tree`), or with spec.tree_sampling = "topk" the
deterministic top-k tree, which rejection verifies as one-hot proposals
(lossless, SGLang's choice, but it accepts less).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxspec.cache.attention import attention_with_block_ref
from jaxspec.models.heads.attn_head import attn_head_step, draft_to_target, prepare_head_params, project_features
from jaxspec.models.heads.config import HeadConfig
from jaxspec.speculative.drafters.features import (
    FeatureState, chain_proposal, choose_draft, expand_frontier, next_pending, pair_inputs, topk_children,
    write_pairs_kv,
)
from jaxspec.speculative.algorithm import AlgorithmInfo
from jaxspec.speculative.drafters.load import register_head
from jaxspec.speculative.drafters.sampled_tree import SampledTrees, TreeDraws, greedy_or_sampled, parse_choices
from jaxspec.speculative.protocol import DrafterBase
from jaxspec.speculative.tree import organize_draft_tree, root_step, select_frontier
from jaxspec.speculative.types import Committed, FeatureRequest, Proposal


@dataclasses.dataclass(frozen=True)
class EagleDrafter(SampledTrees, DrafterBase):
    head: HeadConfig
    num_steps: int
    topk: int
    num_draft_tokens: int
    sample_drafts: bool  # rejection verify on sampled rows: chains and sampled trees return q
    coupled: bool = False  # coupled verify: the chain races with the target's noise (sampling.draft_noise)
    tree_sampling: str = "sampled"  # sampled rows' trees: "sampled" (from q) or "topk" (one-hot)
    choices: tuple[tuple[int, ...], ...] = ()  # the sampled tree's rank paths; () = the default shape

    shares_target = ("embed", "head")

    @property
    def draft_cache_cfg(self):
        return self.head.layer

    @property
    def target_features(self) -> FeatureRequest:
        if self.head.feature_layers:
            return FeatureRequest(layers=self.head.feature_layers)
        return FeatureRequest(final_norm=True)

    def prepare_params(self, loaded, *, native: bool, unstack) -> dict:
        return prepare_head_params(loaded, self.head, native=native)

    def init_state(self, draft_cache, batch: int) -> FeatureState:
        return FeatureState(cache=draft_cache, pending=jnp.zeros((batch, self.head.feature_width), jnp.float32))

    # ---- committed pairs: prefill chunks and the post-verify draft-extend ----------------------

    def _extend(self, params, state: FeatureState, c: Committed, page_table) -> FeatureState:
        tokens, feats, slots, valid = pair_inputs(state.pending, c)
        own = params["own"]
        h = project_features(own, self.head, feats.astype(jnp.float32))
        out = attn_head_step(own, self.head, params["target"], tokens, h, slots, None, kv_only=True)
        cache = write_pairs_kv(state.cache, page_table, slots, valid, out.k, out.v)
        return FeatureState(cache=cache, pending=next_pending(state.pending, c))

    def prefill(self, params, state, chunk: Committed, page_table):
        return self._extend(params, state, chunk, page_table)

    def observe(self, params, state, committed: Committed, page_table):
        return self._extend(params, state, committed, page_table)

    # ---- drafting ----------------------------------------------------------------------------

    def _step(self, params, tokens, h, positions, prefix, block_k, block_v, mask, page_table, cache):
        """One head step over T new nodes; the block holds every in-flight node's K/V (the new
        ones last) and mask [B, T, U] says which of them each new node sees."""
        own, shared = params["own"], params["target"]
        block = []  # the in-flight K/V with the new nodes appended, as attend built it

        def attend(q, k, v):
            ks = k if block_k is None else jnp.concatenate([block_k, k], axis=1)
            vs = v if block_v is None else jnp.concatenate([block_v, v], axis=1)
            block.append((ks, vs))
            return attention_with_block_ref(q, cache.k[0], cache.v[0], page_table, prefix, ks, vs, mask,
                                            scale=self.head.layer.head_dim ** -0.5)

        out = attn_head_step(own, self.head, shared, tokens, h, positions, attend)
        ks, vs = block[0]
        return out, ks, vs

    def propose(self, params, state: FeatureState, s) -> Proposal:
        b = s.hist_len.shape[0]
        root = jnp.take_along_axis(s.history, jnp.maximum(s.hist_len - 1, 0)[:, None], axis=1)[:, 0]
        r = jnp.maximum(s.hist_len - 1, 1)  # root position (padding rows: any valid value)
        prefix = r - 1  # pairs 0 .. r-2 are cached
        d2t = draft_to_target(params["own"], self.head)
        h0 = project_features(params["own"], self.head, state.pending[:, None].astype(jnp.float32))
        one = jnp.ones((b, 1, 1), bool)
        # Step 0: the pair (pending, root) at slot r - 1.
        out, bk, bv = self._step(params, root[:, None], h0, prefix[:, None], prefix, None, None, one,
                                 s.page_table, state.cache)
        if self.topk == 1:
            return self._chain(params, state, s, root, out, bk, bv, prefix, d2t)
        args = (params, state, s, root, out, bk, bv, prefix, d2t)
        if not self.sampled_tree:
            return Proposal(*self._tree(*args), None, state)
        shape = (b, self.num_draft_tokens, self.head.layer.vocab_size)
        return Proposal(*greedy_or_sampled(s, lambda: self._tree(*args), lambda: self._sampled_tree(*args), shape),
                        state)

    def _chain(self, params, state, s, root, out, bk, bv, prefix, d2t):
        n = self.num_draft_tokens
        drafts, qs = [], []
        h = out.h
        logits = out.logits[:, -1]
        for depth in range(1, n):
            tok, q = choose_draft(logits, s, drafts, d2t, self.head.layer.vocab_size, self.sample_drafts,
                                  self.coupled)
            drafts.append(tok)
            qs.append(q)
            if depth < n - 1:
                u = bk.shape[1] + 1
                mask = jnp.ones((root.shape[0], 1, u), bool)  # a chain node sees every earlier node
                out, bk, bv = self._step(params, tok[:, None], h[:, -1:], (prefix + depth)[:, None], prefix, bk, bv,
                                         mask, s.page_table, state.cache)
                h, logits = out.h, out.logits[:, -1]
        return chain_proposal(root, drafts, qs, self.sample_drafts, state)

    def _tree(self, params, state, s, root, out, bk, bv, prefix, d2t):
        k, steps, b = self.topk, self.num_steps, root.shape[0]
        # 1. Step 0 expands the root pair's distribution.
        s0, t0 = topk_children(out.logits[:, -1], k, d2t)
        tok0, sc0 = root_step(t0, s0)
        step_tokens, step_scores = [tok0], [sc0]
        step_frontier = [jnp.zeros((b, k), jnp.int32)]
        node_h = out.h  # [B, U, H] fed-back state of every in-flight node (node 0: the root pair)
        anc = jnp.ones((b, 1, 1), bool)  # [B, U, U] ancestor-or-self among in-flight nodes
        prev_nodes = jnp.zeros((b, k), jnp.int32)  # in-flight index of each frontier row's node
        for step in range(1, steps):
            # 2. Feed the K best candidates of the previous step (flat f*K + c).
            front = select_frontier(step_scores[-1])
            step_frontier.append(front)
            fed_tok = jnp.take_along_axis(step_tokens[-1].reshape(b, k * k), front, axis=1)
            fed_sc = jnp.take_along_axis(step_scores[-1].reshape(b, k * k), front, axis=1)
            parent = jnp.take_along_axis(prev_nodes, front // k, axis=1)  # [B, K] in-flight index
            u0 = node_h.shape[1]
            # A new node sees its parent's ancestors and itself: its row is built from the parent's.
            anc = jnp.pad(anc, ((0, 0), (0, 0), (0, k)))
            mask = jnp.take_along_axis(anc, parent[:, :, None], axis=1) | jnp.eye(k, u0 + k, u0, dtype=bool)[None]
            anc = jnp.concatenate([anc, mask], axis=1)  # mask: [B, K, U0 + K]
            h_in = jnp.take_along_axis(node_h, parent[:, :, None], axis=1)
            pos = jnp.broadcast_to(prefix[:, None] + step, (b, k))
            out, bk, bv = self._step(params, jnp.maximum(fed_tok, 0), h_in, pos, prefix,
                                     bk, bv, mask, s.page_table, state.cache)
            node_h = jnp.concatenate([node_h, out.h], axis=1)
            prev_nodes = u0 + jnp.arange(k, dtype=jnp.int32)[None, :].repeat(b, 0)
            # 3. Their children, scored by cumulative log-prob.
            ct, cs = expand_frontier(out.logits, fed_tok, fed_sc, k, d2t)  # [B, K, K]
            step_tokens.append(ct)
            step_scores.append(cs)
        tokens, parents, _ = organize_draft_tree(
            root, jnp.stack(step_tokens, 1), jnp.stack(step_scores, 1), jnp.stack(step_frontier, 1),
            self.num_draft_tokens,
        )
        return tokens, parents

    def _sampled_tree(self, params, state, s, root, out, bk, bv, prefix, d2t):
        """The rank tree level by level: draw a level's children, then run the head on the level's
        expanded nodes (their K/V join the in-flight block, masked to their ancestors)."""
        t, b = self.rank_tree, root.shape[0]
        draws = TreeDraws.start(t, root)
        flight = [0]  # in-flight nodes in block order; node 0 is the root pair
        node_h, node_logits = {0: out.h[:, -1]}, {0: out.logits[:, -1]}
        for depth in range(1, t.depth + 1):
            draws.draw_level(depth, jnp.stack([node_logits[n] for n in t.expanded(depth - 1)], axis=1), s, d2t,
                             self.head.layer.vocab_size)
            fed = t.expanded(depth)
            if not fed:
                break
            mask = t.ancestors(flight + fed)[len(flight):]  # [F, U] static: the topology is fixed
            tokens = jnp.stack([jnp.maximum(draws.tokens[n], 0) for n in fed], axis=1)
            h_in = jnp.stack([node_h[t.parents[n]] for n in fed], axis=1)
            pos = jnp.broadcast_to(prefix[:, None] + depth, tokens.shape)
            out, bk, bv = self._step(params, tokens, h_in, pos, prefix, bk, bv,
                                     jnp.broadcast_to(jnp.asarray(mask), (b, *mask.shape)), s.page_table, state.cache)
            for j, n in enumerate(fed):
                node_h[n], node_logits[n] = out.h[:, j], out.logits[:, j]
            flight += fed
        return draws.proposal()



def _make(plan, spec, head, sample) -> EagleDrafter:
    choices = tuple(parse_choices(spec.tree_choices)) if spec.tree_choices else ()
    return EagleDrafter(head, plan.num_steps, plan.topk, plan.num_draft_tokens, sample,
                        tree_sampling=spec.tree_sampling, choices=choices)


def _own_mtp_layers(model, dtype):
    from jaxspec.models.heads.loading import load_mtp_head

    return load_mtp_head(model.path, model.config, dtype=dtype)


# NEXTN / MTP checkpoints are driven through the EAGLE path (SGLang's NEXTN alias); without a head
# directory, EAGLE drafts with the target's own MTP layers (the loader says so if it has none).
register_head("eagle", AlgorithmInfo(needs_draft_model=True, supports_tree=True, description=(
    "EAGLE-1 head with EAGLE-2 dynamic trees (also NEXTN/MTP layers of the target)")), _make,
    head_kinds=("eagle", "mtp_deepseek", "mtp_mimo"), aliases=("nextn",), fallback=_own_mtp_layers,
    default_draft=lambda s: True, reads=("tree_choices", "tree_sampling"))
register_head("eagle3", AlgorithmInfo(needs_draft_model=True, supports_tree=True, description=(
    "EAGLE-3 head on multi-layer target features, reduced draft vocabulary")), _make,
    head_kinds=("eagle3",), shipped_head="eagle3-smollm2-135m", reads=("tree_choices", "tree_sampling"))
