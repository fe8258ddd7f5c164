"""Drafters on the target's last hidden state alone: Medusa heads and the MLP speculator.

No attention, so no draft cache: the state is the pending feature (the final-
norm state h_{r-1} that predicted the root; see
`jaxspec.speculative.drafters.features`), updated by prefill chunks and by
`observe` from the accepted path's features. Both draft every depth from that
one state, so a draft step costs one small MLP and an LM head per depth.

* Medusa: head i predicts the token i + 2 past h's position, i.e. depth i + 1
  below the root. Chains take each head's argmax (or, on sampled rows, a draw
  from its softmax under the request's temperature, returned as q: each head's
  draw is independent of the earlier drafts given the context, which is what
  rejection sampling needs). Trees come from a "medusa choices" list
  (`spec.tree_choices`, tuples of top-k ranks per depth; by default the
  num_draft_tokens - 1 paths of smallest rank sum within topk x num_steps):
  the top-k tokens of each head on greedy rows; on sampled rows each node's
  children are drawn from its depth's head without replacement, with their q
  (`drafters.sampled_tree`; spec.tree_sampling = "topk" keeps the top-k tree,
  verified as one-hot proposals).
* MLP speculator (IBM, vLLM `mlp_speculator.py`): n_predict stages, stage i
  reading the previous stage's state and token; chains only.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.models.heads.config import HeadConfig
from jaxspec.models.heads.medusa import medusa_logits
from jaxspec.models.heads.mlp_speculator import mlp_speculator_init_state, mlp_speculator_step
from jaxspec.models.heads.attn_head import prepare_head_params
from jaxspec.speculative.drafters.features import FeatureState, chain_proposal, choose_draft, next_pending
from jaxspec.speculative.algorithm import AlgorithmInfo
from jaxspec.speculative.drafters.load import register_head
from jaxspec.speculative.drafters.sampled_tree import SampledTrees, TreeDraws, greedy_or_sampled, parse_choices
from jaxspec.speculative.protocol import DrafterBase
from jaxspec.speculative.types import Committed, FeatureRequest, Proposal


class _PendingOnly(DrafterBase):
    """State = the pending final-norm feature; prefill and observe only move it."""

    head: HeadConfig
    target_features = FeatureRequest(final_norm=True)
    shares_target = ("embed", "head")

    def prepare_params(self, loaded, *, native: bool, unstack) -> dict:
        return prepare_head_params(loaded, self.head, native=native)

    def init_state(self, draft_cache, batch: int) -> FeatureState:
        return FeatureState(cache=None, pending=jnp.zeros((batch, self.head.target_hidden_size), jnp.float32))

    def prefill(self, params, state, chunk: Committed, page_table):
        return FeatureState(cache=None, pending=next_pending(state.pending, chunk))

    def observe(self, params, state, committed: Committed, page_table):
        return FeatureState(cache=None, pending=next_pending(state.pending, committed))


@dataclasses.dataclass(frozen=True)
class MedusaDrafter(SampledTrees, _PendingOnly):
    head: HeadConfig
    num_steps: int
    topk: int
    num_draft_tokens: int
    sample_drafts: bool
    choices: tuple[tuple[int, ...], ...] = ()  # () = sampled_tree.default_choices
    coupled: bool = False  # coupled verify: chains race with the target's noise (sampling.draft_noise)
    tree_sampling: str = "sampled"  # sampled rows' trees: "sampled" (from each head's q) or "topk"

    def __post_init__(self):
        n = self.num_draft_tokens
        if self.topk == 1 and n - 1 > self.head.num_heads:
            raise ValueError(f"a Medusa chain of {n - 1} drafts needs {n - 1} heads; the checkpoint has "
                             f"{self.head.num_heads} (spec.num_draft_tokens <= {self.head.num_heads + 1})")
        self.check_sampled_tree(always=True)  # its top-k tree is the rank tree too

    @property
    def tree_depth(self) -> int:
        return min(self.num_steps, self.head.num_heads)

    def propose(self, params, state: FeatureState, s) -> Proposal:
        root = jnp.take_along_axis(s.history, jnp.maximum(s.hist_len - 1, 0)[:, None], axis=1)[:, 0]
        logits = medusa_logits(params["own"], self.head, params["target"], state.pending)  # [B, heads, V]
        n = self.num_draft_tokens
        if self.topk == 1:
            drafts, qs = [], []
            for depth in range(1, n):  # Medusa's heads are independent; only the penalties read prev
                tok, q = choose_draft(logits[:, depth - 1], s, drafts, None, logits.shape[-1], self.sample_drafts,
                                      self.coupled)
                drafts.append(tok)
                qs.append(q)
            return chain_proposal(root, drafts, qs, self.sample_drafts, state)
        t = self.rank_tree
        parents, ranks, depths = (np.asarray(x, np.int32) for x in (t.parents, t.ranks, t.depths))
        b = root.shape[0]

        def topk_tree():
            _, top = jax.lax.top_k(logits, self.topk)  # [B, heads, K]
            nodes = top[:, np.maximum(depths[1:] - 1, 0), ranks[1:]].astype(jnp.int32)  # [B, N-1]
            return jnp.concatenate([root[:, None], nodes], axis=1), jnp.broadcast_to(jnp.asarray(parents), (b, n))

        if not self.sampled_tree:
            return Proposal(*topk_tree(), None, state)

        def sampled_tree():
            # A depth-d node's children all come from head d (Medusa reads no drafted token).
            draws = TreeDraws.start(t, root)
            for depth in range(1, t.depth + 1):  # q computed once per depth, every parent races its own noise
                draws.draw_level(depth, logits[:, None, depth - 1], s, None, logits.shape[-1])
            return draws.proposal()

        return Proposal(*greedy_or_sampled(s, topk_tree, sampled_tree, (b, n, logits.shape[-1])), state)


@dataclasses.dataclass(frozen=True)
class MLPSpeculatorDrafter(_PendingOnly):
    head: HeadConfig
    num_draft_tokens: int
    sample_drafts: bool
    coupled: bool = False  # coupled verify: the chain races with the target's noise (sampling.draft_noise)

    def __post_init__(self):
        if self.num_draft_tokens - 1 > self.head.num_heads:
            raise ValueError(f"an MLP speculator chain of {self.num_draft_tokens - 1} drafts needs as many stages; "
                             f"the checkpoint has n_predict = {self.head.num_heads}")

    @property
    def provides_draft_probs(self) -> bool:
        return self.sample_drafts and not self.coupled

    def propose(self, params, state: FeatureState, s) -> Proposal:
        own = params["own"]
        root = jnp.take_along_axis(s.history, jnp.maximum(s.hist_len - 1, 0)[:, None], axis=1)[:, 0]
        st = mlp_speculator_init_state(own, self.head, state.pending)
        drafts, qs, tok = [], [], root
        for i in range(self.num_draft_tokens - 1):
            st, logits = mlp_speculator_step(own, self.head, st, tok, i)
            tok, q = choose_draft(logits, s, drafts, None, logits.shape[-1], self.sample_drafts, self.coupled)
            drafts.append(tok)
            qs.append(q)
        return chain_proposal(root, drafts, qs, self.sample_drafts, state)


def _medusa(plan, spec, head, sample) -> MedusaDrafter:
    choices = tuple(parse_choices(spec.tree_choices)) if spec.tree_choices else ()
    return MedusaDrafter(head, plan.num_steps, plan.topk, plan.num_draft_tokens, sample, choices,
                         tree_sampling=spec.tree_sampling)


register_head("medusa", AlgorithmInfo(needs_draft_model=True, supports_tree=True, description=(
    "Medusa parallel decoding heads (tree from medusa choices)")), _medusa,
    head_kinds=("medusa",), shipped_head="medusa-smollm2-135m", reads=("tree_choices", "tree_sampling"))
register_head("mlp_speculator", AlgorithmInfo(needs_draft_model=True, description=(
    "IBM MLP speculator: n_predict MLP stages on the last hidden state")),
    lambda plan, spec, head, sample: MLPSpeculatorDrafter(head, plan.num_draft_tokens, sample),
    head_kinds=("mlp_speculator",))
