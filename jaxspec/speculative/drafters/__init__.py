"""The built-in drafters, the registry's lookups, and how the engine builds the drafter of a plan.

Each module here implements `jaxspec.speculative.protocol.Drafter` and registers its algorithm
(`jaxspec.speculative.algorithm.register`) at import: importing this package registers them all,
in the order `builtin_names()` lists them, and re-exports the lookups, so code that asks about an
algorithm imports them from here. Plugins register the same way from their own modules.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from jaxspec.speculative.algorithm import (  # noqa: F401  (the lookups, re-exported with the built-ins registered)
    SpecConfigError, algorithm_for_head, algorithm_info, builtin_names, canonical_name, registration, registrations,
    shipped_head, valid_names, validate_spec_config,
)
from jaxspec.speculative.drafters import plain, ngram, standalone, eagle, heads, frozen_kv, block  # noqa: F401  (registers)
from jaxspec.speculative.protocol import Drafter, check_drafter

if TYPE_CHECKING:
    from jaxspec.config import Config, SpecSection
    from jaxspec.speculative.loop import SpecPlan

__all__ = ["SpecConfigError", "algorithm_for_head", "algorithm_info", "build_drafter", "builtin_names",
           "canonical_name", "registration", "registrations", "reserve_tokens", "shipped_head", "valid_names",
           "validate_config", "validate_spec_config"]


def validate_config(cfg: "Config") -> "Config":
    """`cfg` with its [spec] validated and the algorithm canonicalised: what `jaxspec.LLM` and the
    server call once, before loading, where a config becomes an engine."""
    return dataclasses.replace(cfg.validate(), spec=validate_spec_config(cfg.spec))


def build_drafter(plan: "SpecPlan", spec: "SpecSection", *, draft_cfg=None, catch_up_width: int = 0,
                  target_cfg=None) -> Drafter:
    """The drafter of `plan` (its shape) and `spec` (the options only its drafter reads), from
    the algorithm's registered builder, called as
    build(plan=, spec=, target_cfg=, draft_cfg=, catch_up_width=)."""
    reg = registration(plan.algorithm)
    if reg.build is None:
        raise SpecConfigError(f"algorithm {plan.algorithm!r} has no drafter: register it with a factory")
    drafter = reg.build(plan=plan, spec=spec, target_cfg=target_cfg, draft_cfg=draft_cfg,
                        catch_up_width=catch_up_width)
    return drafter if reg.builtin else check_drafter(plan.algorithm, drafter)


def reserve_tokens(plan: "SpecPlan", drafter: Drafter) -> int:
    """Cache slots per sequence past prompt + max_new: the verify tree and the drafter's scratch."""
    return max(plan.num_draft_tokens, int(drafter.scratch_tokens))
