"""The drafter protocol: what every drafter declares and implements.

Every drafter, built-in or plugin, is an object with this interface; the loop
(`jaxspec.speculative.loop`) and the engine call it and never ask which
drafter it is. `DrafterBase` supplies the defaults of a stateless,
featureless drafter, so a plugin only has to write `propose`.

Static declarations (plain attributes, read once when the engine is built):

  scratch_tokens: int
      Cache slots past the committed context (past `hist_len`) the drafter
      itself writes while drafting. The engine reserves
      max(num_draft_tokens, scratch_tokens) slots per sequence beyond
      prompt + max_new; a slot past the reserve would land on the shared
      null page and be read back by another row.
  draft_cache_cfg: ModelConfig | None
      Geometry (num_layers, num_kv_heads, head_dim) of the drafter's own paged
      KV cache, which shares the target's page table; None = no cache. The
      engine allocates it and passes it to `init_state`.
  target_features: FeatureRequest
      The target hidden states the drafter reads (none, the final-norm state,
      chosen layers). Every target forward (prefill chunks and verify)
      returns them; commit gathers the accepted path's. No extra forward.
  provides_draft_probs: bool
      `propose` returns the distribution each draft token was sampled from
      (sampled rows); False = deterministic drafts, which lossless rejection
      verifies as one-hot proposals.
  shares_target: tuple[str, ...]
      Target runtime params the drafter reads ("embed", "head",
      "final_norm"); the engine passes them, without a copy, as
      `draft_params["target"]`.
  target_kv_layers: tuple[int, ...]
      Target decoder layers whose paged K/V the drafter reads (FROZEN_KV_MTP);
      `propose` then gets `s.cache` as a `types.TargetKV` of exactly those
      layers' pools, read-only, sliced from the loop's cache carry without a
      copy. Undeclared (the default, ()): `s.cache` is None in `propose`.

Calls (pure, jitted inside the engine's programs, except prepare_params):

  prepare_params(loaded, *, native, unstack) -> runtime params
      Once, on the host: the loaded weights (Hugging Face layout) in the
      layout the drafter's jitted code reads. Inside the jitted calls
      `params` is {"own": that, "target": {shared target params}}.

  init_state(draft_cache, batch) -> state pytree (or None)
  prefill(params, state, chunk: Committed, page_table [B, P]) -> state
      After the target's forward over one prompt chunk (`chunk.tokens` at
      slots chunk.start.., `chunk.features` their target features).
  propose(params, state, s: SpecState) -> Proposal
      Draft the tree for loop state `s` (history, hist_len, page table, done,
      sampling, corpus; `s.cache`: the declared target KV layers, or None). A
      drafter that samples under the rejection rule draws its noise with
      `sampling.draft_noise(seed, s.hist_len, depth, size)`: the step's own draft
      stream, independent of every earlier step's and of the verify's coins
      (losslessness needs it), and returns q (declaring
      provides_draft_probs). Under the coupled rule (plan.sampled_rule ==
      "coupled") it returns no q: any draft is exact there, and racing its
      distribution with the target's noise at the draft's position
      (`sampling.race_filtered` keyed by `race_key(seed, s.hist_len + depth - 1)`,
      what `drafters.features.choose_draft` does) lands drafts where the
      target's sample does.
  observe(params, state, committed: Committed, page_table) -> state
      The draft-extend after verify: the root and accepted drafts with their
      target features (SGLang's draft_extend_for_decode).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from jaxspec.speculative.types import Committed, FeatureRequest, Proposal

if TYPE_CHECKING:
    from jaxspec.speculative.loop import SpecState

PROTOCOL_ATTRS = ("scratch_tokens", "draft_cache_cfg", "target_features", "provides_draft_probs", "shares_target",
                  "prepare_params", "init_state", "prefill", "propose", "observe")
SHAREABLE = ("embed", "head", "final_norm")


@runtime_checkable
class Drafter(Protocol):
    scratch_tokens: int
    draft_cache_cfg: Any
    target_features: FeatureRequest
    provides_draft_probs: bool
    shares_target: tuple[str, ...]

    def prepare_params(self, loaded, *, native: bool, unstack) -> Any: ...

    def init_state(self, draft_cache, batch: int) -> Any: ...

    def prefill(self, params, state, chunk: Committed, page_table) -> Any: ...

    def propose(self, params, state, s: "SpecState") -> Proposal: ...

    def observe(self, params, state, committed: Committed, page_table) -> Any: ...


class DrafterBase:
    """Defaults: no state, no cache, no features, deterministic drafts."""

    scratch_tokens: int = 0
    draft_cache_cfg = None
    target_features: FeatureRequest = FeatureRequest()
    provides_draft_probs: bool = False
    shares_target: tuple[str, ...] = ()
    target_kv_layers: tuple[int, ...] = ()

    def prepare_params(self, loaded, *, native: bool, unstack) -> Any:
        return loaded

    def init_state(self, draft_cache, batch: int) -> Any:
        return None

    def prefill(self, params, state, chunk: Committed, page_table) -> Any:
        return state

    def observe(self, params, state, committed: Committed, page_table) -> Any:
        return state


def check_drafter(name: str, drafter: Any) -> Any:
    missing = [a for a in PROTOCOL_ATTRS if not hasattr(drafter, a)]
    if missing:
        from jaxspec.speculative.algorithm import SpecConfigError

        raise SpecConfigError(
            f"plugin algorithm {name!r}: its factory returned {type(drafter).__name__}, which lacks "
            f"{', '.join(missing)} of the drafter protocol (jaxspec.speculative.protocol.Drafter; "
            "subclass DrafterBase for the defaults)")
    bad = [n for n in drafter.shares_target if n not in SHAREABLE]
    if bad:
        from jaxspec.speculative.algorithm import SpecConfigError

        raise SpecConfigError(f"plugin algorithm {name!r} shares unknown target params {bad}; "
                              f"shareable: {', '.join(SHAREABLE)}")
    return drafter
