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
  num_draft_tokens - 1 paths of smallest rank sum within topk x num_steps),
  deterministic, verified as one-hot proposals on sampled rows.
* MLP speculator (IBM, vLLM `mlp_speculator.py`): n_predict stages, stage i
  reading the previous stage's state and token; chains only.
"""

from __future__ import annotations

import dataclasses
import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.models.heads.config import HeadConfig
from jaxspec.models.heads.medusa import medusa_logits, medusa_tree_from_choices
from jaxspec.models.heads.mlp_speculator import mlp_speculator_init_state, mlp_speculator_step
from jaxspec.models.heads.attn_head import prepare_head_params
from jaxspec.speculative.drafters.features import FeatureState, chain_proposal, choose_draft, next_pending
from jaxspec.speculative.algorithm import AlgorithmInfo
from jaxspec.speculative.drafters.load import register_head
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


def default_medusa_choices(topk: int, depth: int, n: int) -> list[tuple[int, ...]]:
    """The n paths of smallest rank sum (then shallower, then lexicographic) with ranks < topk
    and length <= depth: prefix-closed, since a parent's key is below its child's."""
    paths = [p for d in range(1, depth + 1) for p in itertools.product(range(topk), repeat=d)]
    paths.sort(key=lambda p: (sum(p), len(p), p))
    return paths[:n]


def parse_choices(text: str) -> list[tuple[int, ...]]:
    """Medusa tree paths from JSON, checked: a non-empty list of distinct, non-empty lists of
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
class MedusaDrafter(_PendingOnly):
    head: HeadConfig
    num_steps: int
    topk: int
    num_draft_tokens: int
    sample_drafts: bool
    choices: tuple[tuple[int, ...], ...] = ()  # () = default_medusa_choices
    coupled: bool = False  # coupled verify: chains race with the target's noise (sampling.draft_noise)

    def __post_init__(self):
        n = self.num_draft_tokens
        if self.choices and self.topk == 1:
            raise ValueError("spec.tree_choices needs a tree (spec.topk > 1); with topk = 1 Medusa drafts a chain")
        if self.topk == 1 and n - 1 > self.head.num_heads:
            raise ValueError(f"a Medusa chain of {n - 1} drafts needs {n - 1} heads; the checkpoint has "
                             f"{self.head.num_heads} (spec.num_draft_tokens <= {self.head.num_heads + 1})")
        if self.topk > 1:
            try:
                parents, ranks, depths = self.tree
            except ValueError as e:
                raise ValueError(f"spec.tree_choices: {e}") from None
            if len(parents) != n:
                raise ValueError(f"spec.tree_choices has {len(parents) - 1} nodes; spec.num_draft_tokens - 1 = {n - 1}")
            if max(depths) > min(self.num_steps, self.head.num_heads) or max(ranks) >= self.topk:
                raise ValueError(f"spec.tree_choices go {max(depths)} deep with ranks up to {max(ranks)}; the plan "
                                 f"allows depth <= min(num_steps, heads) = {min(self.num_steps, self.head.num_heads)} "
                                 f"and ranks < topk = {self.topk}")

    @property
    def provides_draft_probs(self) -> bool:
        return self.sample_drafts and not self.coupled and self.topk == 1

    @property
    def tree(self):
        choices = list(self.choices) or default_medusa_choices(self.topk, min(self.num_steps, self.head.num_heads),
                                                               self.num_draft_tokens - 1)
        return medusa_tree_from_choices(choices)

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
        parents, ranks, depths = (np.asarray(x, np.int32) for x in self.tree)
        _, top = jax.lax.top_k(logits, self.topk)  # [B, heads, K]
        nodes = top[:, np.maximum(depths[1:] - 1, 0), ranks[1:]].astype(jnp.int32)  # [B, N-1]
        tokens = jnp.concatenate([root[:, None], nodes], axis=1)
        b = root.shape[0]
        return Proposal(tokens, jnp.broadcast_to(jnp.asarray(parents), (b, n)), None, state)


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
    return MedusaDrafter(head, plan.num_steps, plan.topk, plan.num_draft_tokens, sample, choices)


register_head("medusa", AlgorithmInfo(needs_draft_model=True, supports_tree=True, description=(
    "Medusa parallel decoding heads (tree from medusa choices)")), _medusa,
    head_kinds=("medusa",), shipped_head="medusa-smollm2-135m", reads=("tree_choices",))
register_head("mlp_speculator", AlgorithmInfo(needs_draft_model=True, description=(
    "IBM MLP speculator: n_predict MLP stages on the last hidden state")),
    lambda plan, spec, head, sample: MLPSpeculatorDrafter(head, plan.num_draft_tokens, sample),
    head_kinds=("mlp_speculator",))
