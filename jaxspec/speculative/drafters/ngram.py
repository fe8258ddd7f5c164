"""NGRAM drafter: prompt lookup on the on-device history (and an optional corpus).

The lookup itself is `jaxspec.speculative.ngram.ngram_propose`; this is its
drafter-protocol face. Stateless: it reads the loop's history directly.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax.numpy as jnp

from jaxspec.speculative.ngram import ngram_propose
from jaxspec.speculative.protocol import DrafterBase
from jaxspec.speculative.types import Proposal

if TYPE_CHECKING:
    from jaxspec.speculative.loop import SpecPlan, SpecState


@dataclasses.dataclass(frozen=True)
class NgramDrafter(DrafterBase):
    """Prompt lookup on the on-device history (and the optional corpus); stateless."""

    plan: "SpecPlan"

    def propose(self, params, state, s: "SpecState") -> Proposal:
        plan = self.plan
        history, hist_len = s.history, s.hist_len
        if s.corpus is not None:
            corpus = jnp.broadcast_to(s.corpus, (history.shape[0], s.corpus.shape[1]))
            history = jnp.concatenate([corpus, history], 1)
            hist_len = hist_len + s.corpus.shape[1]
        tokens, parents = ngram_propose(
            history, hist_len, num_draft_tokens=plan.num_draft_tokens, topk=plan.topk,
            min_match=plan.ngram_min_match, max_match=plan.ngram_max_match,
            draft_tokens_by_match=plan.ngram_draft_tokens_by_match,
        )
        return Proposal(tokens, None if plan.chain else parents, None, None)
