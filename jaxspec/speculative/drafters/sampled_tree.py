"""Multi-draft trees sampled from the drafter's q (SpecInfer / RSD), for sampled rows under rejection verify.

Deterministic top-k trees verified as one-hot proposals are lossless but accept
only sum_t min(p, 1[t]) per sibling where a draw from q would accept
sum_t min(p, q). Here every expanded node draws its children from its own q
WITHOUT replacement, and the r-th child's proposal row is q with the r earlier
siblings removed and renormalised: the distribution that child was actually
drawn from. `verify.verify_rejection` (reference and kernels) walks the
siblings in index order, each rejection updating the residual; with these rows
that is recursive rejection sampling over distinct siblings, which is lossless.

Why a fixed topology: EAGLE-2's selection keeps a node when its cumulative
score is among the best, so whether a node exists depends on its own token.
With sampled tokens that selects on the draw and biases the output. The tree
is a value-independent `RankTree` (Medusa's "choices" form: a node is a path of
sibling ranks, by default the N - 1 paths of smallest rank sum), and only q's
support cuts it short: a draw past the support of a top-k / top-p filtered q is
padding, with its subtree.

Draws: the exponential race q_v / E_v ranks the vocabulary as sequential
sampling without replacement from q would (Gumbel-top-k), so one noise vector
per expanded node gives all its children. The noise is the step's draft stream
(`sampling.draft_noise`, keyed by the parent's node index), independent of the
verify's coins. Greedy rows of a mixed batch rank by the draft logits and get
one-hot rows, so they stay exactly greedy; an all-greedy batch keeps the
drafter's deterministic tree (`greedy_or_sampled`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jaxspec.speculative.sampling import draft_noise, target_probs_from_logits


# ---- the topology ---------------------------------------------------------------------------------


def default_choices(topk: int, depth: int, n: int) -> list[tuple[int, ...]]:
    """The n paths of smallest rank sum (then shallower, then lexicographic) with ranks < topk
    and length <= depth: prefix-closed, and a rank-r node's rank r - 1 sibling is in too,
    since both come before it in that order."""
    paths = [p for d in range(1, depth + 1) for p in itertools.product(range(topk), repeat=d)]
    paths.sort(key=lambda p: (sum(p), len(p), p))
    return paths[:n]


def parse_choices(text: str) -> list[tuple[int, ...]]:
    """Tree paths from JSON, checked: a non-empty list of distinct, non-empty lists of
    integer ranks >= 0, closed under prefixes (each path's parent is a path too)."""
    form = "a JSON list of rank lists like [[0], [1], [0, 0]]"
    try:
        raw = json.loads(text)
    except ValueError as e:
        raise ValueError(f"spec.tree_choices must be {form}: {e}") from None
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"spec.tree_choices must be {form}, non-empty; got {text[:60]}")
    paths = []
    for c in raw:
        if (not isinstance(c, list) or not c
                or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in c)):
            raise ValueError(f"spec.tree_choices: {json.dumps(c)[:40]} is not a non-empty list of integer ranks >= 0")
        paths.append(tuple(c))
    seen = set()
    for p in paths:
        if p in seen:
            raise ValueError(f"spec.tree_choices: path {list(p)} appears twice")
        seen.add(p)
    for p in paths:
        if len(p) > 1 and p[:-1] not in seen:
            raise ValueError(f"spec.tree_choices: path {list(p)} has no parent {list(p[:-1])} (an orphan)")
    return paths


@dataclasses.dataclass(frozen=True)
class RankTree:
    """A static tree of sibling ranks. Node 0 is the root; nodes follow (depth, path) order, so
    parents precede children and siblings come in rank order (the verifier's sibling order)."""

    parents: tuple[int, ...]
    ranks: tuple[int, ...]
    depths: tuple[int, ...]

    @classmethod
    def from_choices(cls, choices) -> "RankTree":
        from jaxspec.models.heads.medusa import medusa_tree_from_choices

        return cls(*(tuple(x) for x in medusa_tree_from_choices(choices)))

    def check_sampling(self) -> None:
        """The r-th draw without replacement is the r-th child only where draws 0..r-1 are children too."""
        for i in range(self.size):
            got = sorted(self.ranks[c] for c in self.children(i))
            if got != list(range(len(got))):
                raise ValueError(f"the children of path {self.path(i)} have ranks {got}; a sampled tree needs "
                                 "ranks 0, 1, .., w-1 under each node (or spec.tree_sampling = 'topk')")

    @property
    def size(self) -> int:
        return len(self.parents)

    @property
    def depth(self) -> int:
        return max(self.depths)

    def path(self, i: int) -> list[int]:
        out = []
        while i > 0:
            out.append(self.ranks[i])
            i = self.parents[i]
        return out[::-1]

    def children(self, i: int) -> list[int]:
        return [c for c in range(1, self.size) if self.parents[c] == i]

    def expanded(self, depth: int) -> list[int]:
        """Nodes at `depth` that have children, in node order."""
        return [i for i in range(self.size) if self.depths[i] == depth and self.children(i)]

    def fed(self) -> list[int]:
        """Every expanded non-root node, level by level: what a drafter with attention runs."""
        return [i for d in range(1, self.depth) for i in self.expanded(d)]

    def ancestors(self, nodes: list[int]) -> np.ndarray:
        """[len(nodes), len(nodes)] bool: nodes[j] is an ancestor-or-self of nodes[i]."""
        pos = {n: j for j, n in enumerate(nodes)}
        out = np.zeros((len(nodes), len(nodes)), bool)
        for i, n in enumerate(nodes):
            while n >= 0:
                if n in pos:
                    out[i, pos[n]] = True
                n = self.parents[n]
        return out


def rank_tree(choices, topk: int, depth: int, num_draft_tokens: int) -> RankTree:
    """The drafter's rank tree: `choices` (spec.tree_choices) or the default shape, checked
    against the plan (num_draft_tokens - 1 nodes, ranks < topk, depth <= `depth`)."""
    paths = list(choices) or default_choices(topk, depth, num_draft_tokens - 1)
    tree = RankTree.from_choices(paths)
    if tree.size != num_draft_tokens:
        raise ValueError(f"spec.tree_choices has {tree.size - 1} nodes; spec.num_draft_tokens - 1 = "
                         f"{num_draft_tokens - 1}")
    if tree.depth > depth or max(tree.ranks) >= topk:
        raise ValueError(f"spec.tree_choices go {tree.depth} deep with ranks up to {max(tree.ranks)}; the plan "
                         f"allows depth <= {depth} and ranks < topk = {topk}")
    return tree


class SampledTrees:
    """What a tree drafter needs to draft sampled trees; the dataclass supplies `tree_sampling`
    ("sampled" | "topk"), `choices`, `sample_drafts`, `coupled`, `topk`, `num_draft_tokens` and
    `num_steps`, and may narrow `tree_depth` (how deep its rank tree may go)."""

    def __post_init__(self):
        self.check_sampled_tree()

    @property
    def tree_depth(self) -> int:
        return self.num_steps

    @property
    def sampled_tree(self) -> bool:
        """Sampled rows draft sampled trees (and return q): rejection verify, a tree, not opted out."""
        return self.sample_drafts and not self.coupled and self.topk > 1 and self.tree_sampling == "sampled"

    @property
    def provides_draft_probs(self) -> bool:
        return self.sample_drafts and not self.coupled and (self.topk == 1 or self.sampled_tree)

    @functools.cached_property
    def rank_tree(self) -> RankTree:
        return rank_tree(self.choices, self.topk, self.tree_depth, self.num_draft_tokens)

    def check_sampled_tree(self, *, always: bool = False) -> None:
        """Refuse a bad tree_sampling or rank tree. `always`: the drafter's deterministic tree is the
        rank tree too (Medusa); otherwise choices shape only the sampled tree and are refused without one."""
        if self.tree_sampling not in ("sampled", "topk"):
            raise ValueError(f"spec.tree_sampling must be 'sampled' or 'topk'; got {self.tree_sampling!r}")
        if self.choices and self.topk == 1:
            raise ValueError("spec.tree_choices needs a tree (spec.topk > 1); with topk = 1 this drafts a chain")
        if self.choices and not (always or self.sampled_tree):
            raise ValueError("spec.tree_choices shapes the sampled tree only (sampled rows under rejection verify, "
                             "spec.tree_sampling = 'sampled'); this drafter's other trees are EAGLE-2's dynamic ones")
        if self.topk > 1 and (always or self.sampled_tree):
            try:
                tree = self.rank_tree
                if self.sampled_tree:
                    tree.check_sampling()
            except ValueError as e:
                raise ValueError(str(e) if str(e).startswith("spec.") else f"spec.tree_choices: {e}") from None


# ---- the draws --------------------------------------------------------------------------------------


def sample_children(
    logits: Float[Array, "B P Vd"],  # or [B, 1, Vd]: one distribution every parent draws from (Medusa)
    parents: list[int],
    width: int,
    s,
    d2t: Int[Array, "Vd"] | None,
    vocab: int,
) -> tuple[Int[Array, "B P W"], Float[Array, "B P W V"]]:
    """`width` distinct children of each of the P expanded nodes `parents` (node indices, which key
    their noise) from the draft logits at those nodes: (target token ids, -1 past q's support;
    the proposal row each was drawn from, over the target vocabulary)."""
    sp = s.sampling
    b, p, vd = logits.shape[0], len(parents), logits.shape[-1]
    # 1. q under each row's own temperature / top-k / top-p.
    q = target_probs_from_logits(logits, sp.temperature, sp.top_k, sp.top_p)  # [B, P, Vd]
    noise = jnp.stack([draft_noise(sp.seed, s.hist_len, 1 + n, vd) for n in parents], axis=1)
    greedy = (sp.temperature <= 0.0)[:, None, None]
    # 2. The race ranks like sequential draws without replacement; greedy rows rank by the logits.
    score = jnp.where(greedy, jax.nn.softmax(logits.astype(jnp.float32), axis=-1), q / noise)
    top_score, idx = jax.lax.top_k(score, width)  # [B, P, W]
    idx = idx.astype(jnp.int32)
    valid = top_score > 0.0
    # 3. The r-th draw's row: q without draws 0..r-1, renormalised (one-hot on greedy rows).
    rows, kept = [], jnp.broadcast_to(q, noise.shape)
    for r in range(width):
        z = jnp.sum(kept, axis=-1, keepdims=True)
        row = jnp.where(z > 0.0, kept / jnp.where(z > 0.0, z, 1.0), 0.0)
        one = jax.nn.one_hot(idx[..., r], vd, dtype=q.dtype)
        rows.append(jnp.where(greedy, one, row))
        kept = kept * (1.0 - one)
    rows = jnp.stack(rows, axis=2)  # [B, P, W, Vd]
    if d2t is not None:
        idx = d2t[idx]
        rows = jnp.zeros((b, p, width, vocab), rows.dtype).at[..., d2t].set(rows)
    return jnp.where(valid, idx, -1), rows


@dataclasses.dataclass
class TreeDraws:
    """The sampled tree being filled level by level: per node its token [B] and row [B, V]."""

    tree: RankTree
    tokens: dict
    rows: dict

    @classmethod
    def start(cls, tree: RankTree, root: Int[Array, "B"]) -> "TreeDraws":
        return cls(tree, {0: root.astype(jnp.int32)}, {})

    def draw_level(self, depth: int, logits: Float[Array, "B P Vd"], s, d2t, vocab: int) -> None:
        """Draw the children of the nodes expanded at depth - 1 (logits in `expanded` order, or one
        [B, 1, Vd] row they all share); a padding parent's children are padding."""
        t = self.tree
        parents = t.expanded(depth - 1)
        width = max(len(t.children(n)) for n in parents)
        tok, rows = sample_children(logits, parents, width, s, d2t, vocab)
        for j, n in enumerate(parents):
            for c in t.children(n):
                live = self.tokens[n] >= 0 if n > 0 else True
                self.tokens[c] = jnp.where(live, tok[:, j, t.ranks[c]], -1)
                self.rows[c] = rows[:, j, t.ranks[c]]

    def proposal(self) -> tuple[Int[Array, "B N"], Int[Array, "B N"], Float[Array, "B N V"]]:
        """(tokens, parents, draft_probs) in the tree convention; padding nodes hang off the root."""
        n = self.tree.size
        tokens = jnp.stack([self.tokens[i] for i in range(n)], axis=1)
        zero = jnp.zeros_like(self.rows[1])
        probs = jnp.stack([zero] + [self.rows[i] for i in range(1, n)], axis=1)
        parents = jnp.broadcast_to(jnp.asarray(self.tree.parents, jnp.int32), tokens.shape)
        parents = jnp.where((tokens < 0) & (jnp.arange(n) > 0), 0, parents)
        return tokens, parents, probs


def greedy_or_sampled(s, deterministic, sampled, probs_shape: tuple[int, ...]):
    """An all-greedy batch drafts the deterministic tree (its own shape; the greedy verify never
    reads q); any sampled row makes the whole batch draft the sampled tree. `deterministic()`
    returns (tokens [B, N], parents [B, N], *rest), `sampled()` (tokens, parents, probs
    `probs_shape` = [B, N, V], *rest); both branches return the latter."""

    def det():
        tokens, parents, *rest = deterministic()
        return (tokens, parents, jnp.zeros(probs_shape, jnp.float32), *rest)

    return jax.lax.cond(jnp.all(s.sampling.temperature <= 0.0), det, sampled)
