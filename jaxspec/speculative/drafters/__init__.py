"""The built-in drafters, and how the engine builds the drafter of a plan.

Each module here implements `jaxspec.speculative.protocol.Drafter` and registers its algorithm
(`jaxspec.speculative.algorithm.register`) at import: importing this package registers them all,
in the order `builtin_names()` lists them. Plugins register the same way from their own modules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxspec.speculative.algorithm import SpecConfigError, registration
from jaxspec.speculative.drafters import plain, ngram, standalone, eagle, heads, block  # noqa: F401  (registers)
from jaxspec.speculative.protocol import Drafter, check_drafter

if TYPE_CHECKING:
    from jaxspec.config import SpecSection
    from jaxspec.speculative.loop import SpecPlan


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
