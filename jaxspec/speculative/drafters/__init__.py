"""The built-in drafters, and how the engine builds the drafter of a plan.

Each module here implements `jaxspec.speculative.protocol.Drafter`; plugins
implement it too and come in through `algorithm.register`'s factory.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from jaxspec.speculative.algorithm import SpecConfigError, plugin_factory
from jaxspec.speculative.drafters.ngram import NgramDrafter
from jaxspec.speculative.drafters.plain import PlainDrafter
from jaxspec.speculative.drafters.standalone import StandaloneDrafter
from jaxspec.speculative.protocol import Drafter, check_drafter

if TYPE_CHECKING:
    from jaxspec.speculative.loop import SpecPlan


def build_drafter(plan: "SpecPlan", *, draft_cfg=None, catch_up_width: int = 0, target_cfg=None) -> Drafter:
    """The drafter for `plan`: a built-in, or what a plugin's factory returns.

    A plugin factory is called as factory(plan=plan, target_cfg=target_cfg,
    draft_cfg=draft_cfg) and must return an object with the protocol above.
    """
    kind = getattr(draft_cfg, "kind", None)
    if plan.tree_choices and kind != "medusa":  # read only by Medusa's static tree: never ignore it
        raise SpecConfigError(f"spec.tree_choices (--tree-choices) shapes a Medusa head's static tree; "
                              f"{plan.algorithm} {'(a ' + kind + ' head) ' if kind else ''}builds its tree from "
                              "the draft scores (--topk, --num-steps, --num-draft-tokens)")
    if plan.sps_table not in ("", "default") and not getattr(draft_cfg, "confidence", False):
        raise SpecConfigError(f"spec.sps_table (--sps-table) drives the planner of a head with a confidence head "
                              f"(DSPARK); {plan.algorithm} verifies every draft, so it would be ignored")
    if plan.algorithm == "none":
        return PlainDrafter()
    if plan.algorithm == "ngram":
        return NgramDrafter(plan)
    if plan.algorithm == "standalone":
        if draft_cfg is None:
            raise SpecConfigError("standalone speculation needs a draft model")
        return StandaloneDrafter(
            draft_cfg, plan.num_steps, plan.topk, plan.num_draft_tokens,
            sample_drafts=plan.sampled_rule in ("rejection", "coupled"),
            catch_up_width=catch_up_width, coupled=plan.sampled_rule == "coupled",
        )
    if plan.algorithm in ("eagle", "eagle3", "medusa", "mlp_speculator", "dflash", "dspark"):
        return _feature_drafter(plan, draft_cfg)
    factory = plugin_factory(plan.algorithm)
    if factory is None:
        raise SpecConfigError(f"algorithm {plan.algorithm!r} has no drafter: register it with a factory")
    return check_drafter(plan.algorithm, factory(plan=plan, target_cfg=target_cfg, draft_cfg=draft_cfg))


def _feature_drafter(plan: "SpecPlan", head) -> Drafter:
    from jaxspec.models.heads.config import HeadConfig

    if not isinstance(head, HeadConfig):
        raise SpecConfigError(f"spec.algorithm={plan.algorithm!r} needs a draft head (spec.draft_model: a head "
                              "directory in its published format)")
    sample = plan.sampled_rule in ("rejection", "coupled")
    drafter = _head_drafter(plan, head, sample)
    return dataclasses.replace(drafter, coupled=True) if plan.sampled_rule == "coupled" else drafter


def _head_drafter(plan: "SpecPlan", head, sample: bool) -> Drafter:
    from jaxspec.speculative.drafters.eagle import EagleDrafter
    from jaxspec.speculative.drafters.heads import MedusaDrafter, MLPSpeculatorDrafter, parse_choices

    try:
        if head.kind == "medusa":
            choices = tuple(parse_choices(plan.tree_choices)) if plan.tree_choices else ()
            return MedusaDrafter(head, plan.num_steps, plan.topk, plan.num_draft_tokens, sample, choices)
        if head.kind == "mlp_speculator":
            return MLPSpeculatorDrafter(head, plan.num_draft_tokens, sample)
        if head.kind in ("dflash", "dspark"):
            from jaxspec.speculative.drafters.block import BlockDrafter, resolve_sps_table

            table = resolve_sps_table(plan.sps_table) if head.confidence else None
            return BlockDrafter(head, plan.num_draft_tokens, sample, table)
    except ValueError as e:
        raise SpecConfigError(str(e)) from None
    return EagleDrafter(head, plan.num_steps, plan.topk, plan.num_draft_tokens, sample)


def reserve_tokens(plan: "SpecPlan", drafter: Drafter) -> int:
    """Cache slots per sequence past prompt + max_new: the verify tree and the drafter's scratch."""
    return max(plan.num_draft_tokens, int(drafter.scratch_tokens))

