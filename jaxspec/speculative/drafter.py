"""The drafter protocol, and how the engine builds the drafter of a plan.

Every drafter, built-in or plugin, is an object with this interface; the loop
(`jaxspec.speculative.loop`) calls it and never asks which drafter it is:

  scratch_tokens: int
      Cache slots past the committed context (past `hist_len`) the drafter
      itself writes while drafting: the draft model's tree block, say. The
      engine reserves max(num_draft_tokens, scratch_tokens) slots per sequence
      beyond prompt + max_new; a slot past the reserve would land on the shared
      null page and be read back by another row.
  needs_draft_cache: bool
      Whether it keeps a paged KV cache of its own (same page table as the
      target); the engine then allocates `draft_cache_shape` and passes it to
      `init_state`.
  init_state(draft_cache, batch) -> state pytree (or None)
  prefill(params, state, tokens [B, L], prompt_lens [B], page_table [B, P]) -> state
  propose(params, state, s: SpecState) -> Proposal
      Draft the tree for the loop state `s` (its history, hist_len, page
      table, done flags, sampling params and n-gram corpus). A drafter that
      samples must key its noise with `sampling.draft_key(seed, s.hist_len,
      depth)`: the step's noise key (see `sampling.step_key`), so its draws are
      independent of every earlier step's.

The feature drafters (EAGLE, Medusa, ...) extend this with target features
and a post-verify `observe`; the seam is here so they need no loop change.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import jax.numpy as jnp

from jaxspec.speculative.types import Proposal

if TYPE_CHECKING:
    from jaxspec.speculative.loop import SpecPlan, SpecState


@runtime_checkable
class Drafter(Protocol):
    scratch_tokens: int
    needs_draft_cache: bool

    def init_state(self, draft_cache, batch: int) -> Any: ...

    def prefill(self, params, state, tokens, prompt_lens, page_table) -> Any: ...

    def propose(self, params, state, s: "SpecState") -> Proposal: ...


@dataclasses.dataclass(frozen=True)
class NgramDrafter:
    """Prompt lookup on the on-device history (and the optional corpus); stateless."""

    plan: "SpecPlan"
    scratch_tokens: int = 0
    needs_draft_cache: bool = False

    def init_state(self, draft_cache, batch: int) -> None:
        return None

    def prefill(self, params, state, tokens, prompt_lens, page_table) -> None:
        return None

    def propose(self, params, state, s: "SpecState") -> Proposal:
        from jaxspec.speculative.ngram import ngram_propose

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


def _check_drafter(name: str, drafter: Any) -> Any:
    missing = [a for a in ("scratch_tokens", "needs_draft_cache", "init_state", "prefill", "propose")
               if not hasattr(drafter, a)]
    if missing:
        from jaxspec.speculative.algorithm import SpecConfigError

        raise SpecConfigError(
            f"plugin algorithm {name!r}: its factory returned {type(drafter).__name__}, which lacks "
            f"{', '.join(missing)} of the drafter protocol (jaxspec.speculative.drafter.Drafter)")
    return drafter


def build_drafter(plan: "SpecPlan", *, draft_cfg=None, catch_up_width: int = 0, target_cfg=None) -> Drafter:
    """The drafter for `plan`: a built-in, or what a plugin's factory returns.

    A plugin factory is called as factory(plan=plan, target_cfg=target_cfg,
    draft_cfg=draft_cfg) and must return an object with the protocol above.
    """
    from jaxspec.speculative.algorithm import SpecConfigError, algorithm_info, plugin_factory, sampling_verify
    from jaxspec.speculative.standalone import StandaloneDrafter

    if plan.algorithm == "ngram":
        return NgramDrafter(plan)
    if plan.algorithm == "standalone":
        if draft_cfg is None:
            raise SpecConfigError("standalone speculation needs a draft model")
        return StandaloneDrafter(
            draft_cfg, plan.num_steps, plan.topk, plan.num_draft_tokens,
            sample_drafts=sampling_verify(plan.verify, algorithm_info(plan.algorithm)) == "rejection",
            catch_up_width=catch_up_width,
        )
    factory = plugin_factory(plan.algorithm)
    if factory is None:
        raise SpecConfigError(f"algorithm {plan.algorithm!r} has no drafter: register it with a factory")
    return _check_drafter(plan.algorithm, factory(plan=plan, target_cfg=target_cfg, draft_cfg=draft_cfg))


def reserve_tokens(plan: "SpecPlan", drafter: Drafter) -> int:
    """Cache slots per sequence past prompt + max_new: the verify tree and the drafter's scratch."""
    return max(plan.num_draft_tokens, int(drafter.scratch_tokens))

