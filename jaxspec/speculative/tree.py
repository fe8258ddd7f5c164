"""Draft-tree construction for tree verification.

Tree convention (shared by every drafter and verifier in jaxspec):

* Per sequence there are exactly N nodes (N = num_draft_tokens, static).
  Node 0 is the root: the last committed token (the previous bonus) whose KV
  is not yet cached. Nodes 1..N-1 are draft tokens.
* `parents [B, N]`: parents[b, 0] = -1 and 0 <= parents[b, i] < i, so parents
  precede children. Sibling order is index order; drafters put higher-score
  siblings first.
* `tokens [B, N]`: a token < 0 marks a PADDING node (a drafter that found
  fewer candidates pads). Padding nodes have parent 0, see only themselves
  (plus the prefix), are unreachable from the retrieve tables and are never
  accepted. The root is never padding, whatever its token. A token >= V is
  not padding here (the tree does not know V); the verifiers skip it.
* `prefix_lens [B]`: committed tokens whose KV is cached; node i is written at
  cache slot prefix_lens[b] + i during verification.

`build_tree` turns (tokens, parents, prefix_lens) into a `TreeInfo`: depths,
RoPE positions, the ancestor mask (bool, qlen-only layout) and
SGLang's child/sibling retrieve tables. On GPU/TPU it runs the Pallas kernel in
`jaxspec.pallas.tree_build`, on CPU the jnp reference (see jaxspec.pallas).

`organize_draft_tree` is the EAGLE-2 / SGLang `organize_draft_results` step
that turns a tree drafter's per-step top-k expansions into that convention.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxspec.pallas import interpret_mode, target_platform, use_kernel

# The containers and their constructors live in a leaf module that the Pallas
# kernel imports too; re-exported here, where the convention is documented.
from jaxspec.speculative.types import (  # noqa: F401
    TreeInfo,
    assemble_tree_info,
    full_tree_mask,
    node_valid,
)

# --------------------------------------------------------------------------
# Reference, chain fast path, dispatch
# --------------------------------------------------------------------------


def build_tree_ref(
    tokens: jax.Array,  # [B, N] int32; < 0 marks padding
    parents: jax.Array,  # [B, N] int32; parents[:, 0] = -1, parents[:, i] < i
    prefix_lens: jax.Array,  # [B] int32
    *,
    max_kv: int | None = None,
) -> TreeInfo:
    """Pure-jnp tree construction (the CPU path and the kernel's oracle)."""
    b, n = tokens.shape
    idx = jnp.arange(n, dtype=jnp.int32)
    parents = parents.astype(jnp.int32)
    valid = node_valid(tokens)
    # Padding nodes get no parent edge, so their ancestor set is only themselves.
    walk_parent = jnp.where(valid & (idx >= 1), parents, -1)

    # 1. Ancestor-or-self mask: walk every node's parent chain in lockstep;
    #    a chain is at most N long, cur = -1 once past the root.
    def step(_, carry):
        mask, cur = carry
        mask = mask | (cur[..., None] == idx)
        up = jnp.take_along_axis(walk_parent, jnp.maximum(cur, 0), axis=1)
        return mask, jnp.where(cur >= 0, up, -1)

    init = (jnp.zeros((b, n, n), bool), jnp.broadcast_to(idx, (b, n)))
    mask, _ = lax.fori_loop(0, n, step, init)

    # 2. Depth = ancestors - 1; padding sits at depth 1 (its nominal parent is 0).
    depth = mask.sum(-1, dtype=jnp.int32) - 1 + (~valid).astype(jnp.int32)

    # 3. Child/sibling tables as masked minima over the pairwise parent relation.
    is_child = ((parents[:, None, :] == idx[None, :, None])  # [B, parent, child]
                & valid[:, None, :] & (idx >= 1)[None, None, :])
    first = jnp.min(jnp.where(is_child, idx, n), axis=-1)
    next_token = jnp.where(first == n, -1, first).astype(jnp.int32)
    later_sib = ((parents[:, :, None] == parents[:, None, :])  # [B, node, sib]
                 & (idx[None, None, :] > idx[None, :, None])
                 & valid[:, None, :] & valid[:, :, None] & (idx >= 1)[None, :, None])
    sib = jnp.min(jnp.where(later_sib, idx, n), axis=-1)
    next_sibling = jnp.where(sib == n, -1, sib).astype(jnp.int32)

    return assemble_tree_info(depth, mask, next_token, next_sibling, valid, prefix_lens, max_kv)


def build_chain_tree(
    tokens: jax.Array,  # [B, N] int32; padding (< 0), if any, must be a suffix
    prefix_lens: jax.Array,  # [B] int32
    *,
    max_kv: int | None = None,
) -> TreeInfo:
    """Fast path for topk=1 chains (parents[i] = i-1): no ancestor search.

    Everything after the first padding token is treated as padding, which is
    what a chain drafter that stops early produces. Equal to `build_tree_ref`
    on the same tokens with parents i-1 for real nodes and 0 for padding.
    Pure iota comparisons that XLA fuses, so there is no kernel for it.
    """
    b, n = tokens.shape
    idx = jnp.arange(n, dtype=jnp.int32)
    valid = jnp.cumprod(node_valid(tokens).astype(jnp.int32), axis=1).astype(bool)
    row, col = idx[:, None], idx[None, :]
    mask = ((col <= row) & valid[:, :, None]) | (col == row)
    depth = jnp.where(valid, idx, 1).astype(jnp.int32)
    nxt_valid = jnp.concatenate([valid[:, 1:], jnp.zeros((b, 1), bool)], axis=1)
    next_token = jnp.where(nxt_valid, idx + 1, -1).astype(jnp.int32)
    next_sibling = jnp.full((b, n), -1, jnp.int32)
    return assemble_tree_info(depth, mask, next_token, next_sibling, valid, prefix_lens, max_kv)


def build_tree(
    tokens: jax.Array,  # [B, N] int32; < 0 marks padding
    parents: jax.Array | None,  # [B, N] int32; ignored (may be None) if chain
    prefix_lens: jax.Array,  # [B] int32
    *,
    chain: bool = False,
    max_kv: int | None = None,
) -> TreeInfo:
    """Build the verification TreeInfo; kernel on GPU/TPU, jnp on CPU.

    chain=True takes the topk=1 fast path (`build_chain_tree`). max_kv, if
    given, also fills TreeInfo.full_mask [B, N, max_kv].
    """
    if chain:
        return build_chain_tree(tokens, prefix_lens, max_kv=max_kv)
    if parents is None:
        raise ValueError("build_tree: parents is required unless chain=True")
    if use_kernel():
        # Lazy: Pallas is only needed where the kernel runs.
        from jaxspec.pallas.shard import shard_kernel_rows
        from jaxspec.pallas.tree_build import build_tree_pallas

        kernel = functools.partial(build_tree_pallas, max_kv=max_kv, interpret=interpret_mode(),
                                   platform=target_platform())
        return shard_kernel_rows(kernel, tokens, parents, prefix_lens)  # per shard under a mesh
    return build_tree_ref(tokens, parents, prefix_lens, max_kv=max_kv)


# --------------------------------------------------------------------------
# Draft organisation (EAGLE-2 / SGLang select_top_k_tokens + organize_draft_results)
# --------------------------------------------------------------------------
#
# A tree drafter runs S = num_steps forwards with branching K = topk. Step s
# expands a frontier of K nodes, each into K candidate children, recorded as
#
#   step_tokens   [B, S, K, K] int32    [b, s, f, c]: token of child c of
#                                       frontier row f at step s (< 0: none)
#   step_scores   [B, S, K, K] float32  its cumulative path log-prob (the root
#                                       scores 0; any monotone score works)
#   step_frontier [B, S, K] int32       [b, s, f]: which step s-1 candidate is
#                                       frontier row f of step s, as the flat
#                                       index f' * K + c' into step s-1's
#                                       [K, K] grid; row s = 0 is ignored
#
# Step 0 expands only the root: row f = 0 holds the root's top-K, rows f >= 1
# are ignored (`root_step` builds that layout). The drafter picks the next
# frontier with `select_frontier`, whose tie-breaking matches the organiser.
# Candidates total K + (S-1) K^2, hence `max_draft_tokens`.


def max_draft_tokens(num_steps: int, topk: int) -> int:
    """Largest num_draft_tokens (root included) that S steps of top-K can fill."""
    return 1 + topk + (num_steps - 1) * topk * topk


def check_draft_config(num_steps: int, topk: int, num_draft_tokens: int) -> None:
    """Raise ValueError unless the drafter config can fill the tree."""
    if num_steps < 1 or topk < 1 or num_draft_tokens < 1:
        raise ValueError(
            f"draft config needs num_steps >= 1, topk >= 1, num_draft_tokens >= 1; "
            f"got num_steps={num_steps}, topk={topk}, num_draft_tokens={num_draft_tokens}")
    cap = max_draft_tokens(num_steps, topk)
    if num_draft_tokens > cap:
        raise ValueError(
            f"num_draft_tokens={num_draft_tokens} exceeds what num_steps={num_steps}, "
            f"topk={topk} can draft: at most 1 + topk + (num_steps-1)*topk^2 = {cap} "
            f"(root included). Lower num_draft_tokens or raise num_steps/topk.")


def root_step(
    tokens: jax.Array,  # [B, K] int32; the root's top-K children
    scores: jax.Array,  # [B, K] float; their log-probs
) -> tuple[jax.Array, jax.Array]:
    """Step-0 record in the uniform [B, K, K] layout (rows f >= 1 empty)."""
    b, k = tokens.shape
    tok = jnp.full((b, k, k), -1, jnp.int32).at[:, 0].set(tokens.astype(jnp.int32))
    sc = jnp.full((b, k, k), -jnp.inf, jnp.float32).at[:, 0].set(scores.astype(jnp.float32))
    return tok, sc


def select_frontier(
    scores: jax.Array,  # [B, K, K] float; cumulative scores of one step's candidates
) -> jax.Array:
    """[B, K] int32 flat indices (f*K + c) of the next frontier: the top-K
    candidates by score, lower flat index first on ties (lax.top_k is stable)."""
    b, k, _ = scores.shape
    _, idx = lax.top_k(scores.reshape(b, k * k).astype(jnp.float32), k)
    return idx.astype(jnp.int32)


def organize_draft_tree(
    root_tokens: jax.Array,  # [B] int32; the tree root (previous bonus token)
    step_tokens: jax.Array,  # [B, S, K, K] int32; see the layout comment above
    step_scores: jax.Array,  # [B, S, K, K] float; cumulative path log-probs
    step_frontier: jax.Array,  # [B, S, K] int32; row 0 ignored
    num_draft_tokens: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Select the best num_draft_tokens-1 candidates into a tree.

    Returns (tokens [B, N] int32, parents [B, N] int32, scores [B, N] float32)
    in the tree convention. Selection ranks candidates by effective score
    (desc), then step, then flat index: the effective score is clamped to its
    parent's, so a parent always outranks its child and the top set is closed
    under ancestors exactly. Candidates with token < 0 or effective score -inf
    (and so their descendants) become padding: token -1, parent 0, score -inf,
    placed after all real nodes. Real nodes come in BFS order: by depth, then
    parent's output index, then score (desc), then flat index; the root is
    node 0 with score 0.
    """
    b, s_steps, k, _ = step_tokens.shape
    n = num_draft_tokens
    check_draft_config(s_steps, k, n)
    kk = k * k
    tok = step_tokens.reshape(b, s_steps, kk).astype(jnp.int32)
    raw = step_scores.reshape(b, s_steps, kk).astype(jnp.float32)
    row = jnp.arange(kk, dtype=jnp.int32) // k  # frontier row of each flat slot
    neg_inf = jnp.float32(-jnp.inf)

    # 1. Effective scores: clamp to the parent's and kill padding subtrees, so
    #    selection is ancestor-closed even if the drafter's scores are not
    #    monotone (e.g. rounding).
    eff_steps = [jnp.where(tok[:, 0] < 0, neg_inf, raw[:, 0])]
    for s in range(1, s_steps):
        par_eff = jnp.take_along_axis(eff_steps[-1], step_frontier[:, s], axis=1)  # [B, K]
        cap = par_eff[:, row]
        eff_steps.append(jnp.where(tok[:, s] < 0, neg_inf, jnp.minimum(raw[:, s], cap)))
    eff = jnp.stack(eff_steps, axis=1).reshape(b, s_steps * kk)

    # 2. Rank all S*K*K slots; step-0 rows f >= 1 are not candidates and sort
    #    last. lexsort's last key is primary; g (step-major flat id) breaks ties.
    g = jnp.arange(s_steps * kk, dtype=jnp.int32)
    slot_ok = ~((g < kk) & (row[g % kk] >= 1))
    order = jnp.lexsort((jnp.broadcast_to(g, (b, g.size)), -eff,
                         jnp.broadcast_to(~slot_ok, (b, g.size))), axis=-1)
    rank = jnp.argsort(order, axis=-1)
    selected = rank < n - 1  # [B, S*K*K]
    real = selected & (eff > neg_inf)
    selected = selected.reshape(b, s_steps, kk)
    real = real.reshape(b, s_steps, kk)

    # 3. BFS output positions, one step (= depth) at a time: a node's sort key
    #    needs its parent's output index, fixed by the previous step.
    big = jnp.int32(n + 1)
    out_pos = []  # per step: [B, K*K] int32 output index, or n if not a real node
    next_free = jnp.ones((b,), jnp.int32)
    parent_pos = []
    for s in range(s_steps):
        if s == 0:
            ppos = jnp.zeros((b, kk), jnp.int32)
        else:
            front_pos = jnp.take_along_axis(out_pos[-1], step_frontier[:, s], axis=1)
            ppos = front_pos[:, row]
        r = real[:, s]
        key_order = jnp.lexsort(
            (jnp.broadcast_to(jnp.arange(kk), (b, kk)), -eff_steps[s],
             jnp.where(r, ppos, big), ~r), axis=-1)
        within = jnp.argsort(key_order, axis=-1).astype(jnp.int32)
        out_pos.append(jnp.where(r, next_free[:, None] + within, n))
        parent_pos.append(ppos)
        next_free = next_free + r.sum(-1, dtype=jnp.int32)

    # 4. Padding nodes fill the tail in slot order.
    pad = (selected & ~real).reshape(b, -1)
    pad_pos = next_free[:, None] + jnp.cumsum(pad, axis=-1, dtype=jnp.int32) - 1
    pos = jnp.stack(out_pos, axis=1).reshape(b, -1)
    pos = jnp.where(pad, pad_pos, pos)

    # 5. Scatter into [B, N]; non-selected slots go to index n and are dropped.
    bidx = jnp.arange(b)[:, None]
    par = jnp.where(pad, 0, jnp.stack(parent_pos, axis=1).reshape(b, -1))
    out_tok = jnp.where(pad, -1, tok.reshape(b, -1))
    out_sc = jnp.where(pad, neg_inf, eff)
    tokens = jnp.full((b, n), -1, jnp.int32).at[:, 0].set(root_tokens.astype(jnp.int32))
    tokens = tokens.at[bidx, pos].set(out_tok, mode="drop")
    parents = jnp.full((b, n), 0, jnp.int32).at[:, 0].set(-1)
    parents = parents.at[bidx, pos].set(par, mode="drop")
    scores = jnp.zeros((b, n), jnp.float32).at[bidx, pos].set(out_sc, mode="drop")
    return tokens, parents, scores
