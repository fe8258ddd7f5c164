"""Draft weights and drafter objects of the head drafters, for their registrations.

`load_draft(spec, model, dtype)` is what the front ends call: the registration of `spec.algorithm`
loads its draft (a `ModelConfig` for the standalone drafter, a `HeadConfig` for a head drafter,
None for drafters without weights). `register_head` is the one call a head drafter's module makes:
its loader finds the head (the shipped one, a directory in its published format, or a fallback),
and its builder checks the head's kind and wraps the sampling mode every head drafter shares.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

from jaxspec.models.config import ConfigError
from jaxspec.speculative.algorithm import (AlgorithmInfo, SpecConfigError, algorithm_for_head, register,
                                           registration, shipped_head)


def load_draft(spec, model, dtype, *, cache_dir: str | None = None, progress: bool = True):
    """(params, config) of the draft for `spec` ([spec] section) against the loaded target `model`, or None."""
    reg = registration(spec.algorithm)
    if reg.load is None:
        return None
    return reg.load(spec, model, dtype, cache_dir=cache_dir, progress=progress)


def _load_head(spec, model, dtype, *, fallback=None, cache_dir: str | None = None, progress: bool = True):
    """The head `spec` names: 'default' or nothing (when one ships) = the shipped head, a directory, else
    `fallback(model, dtype)` (EAGLE without a head: the target's own MTP layers)."""
    from jaxspec.models.heads.loading import load_draft_head

    reg = registration(spec.algorithm)
    name = reg.name
    if spec.draft_model == "default" or (not spec.draft_model and reg.shipped_head):
        try:
            path = shipped_head(name)
        except FileNotFoundError as e:
            raise ConfigError(str(e)) from None
        try:
            head = load_draft_head(path, model.config, aux_layer_convention="output", dtype=dtype)
        except (ConfigError, ValueError) as e:
            raise ConfigError(f"the shipped {name} head ({path.name}) is for the embedded SmolLM2-135M-Instruct "
                              f"and does not fit this target: give --draft-model DIR ({e})") from None
    elif spec.draft_model:
        head = load_draft_head(Path(spec.draft_model).expanduser(), model.config,
                               aux_layer_convention=spec.eagle3_layer_ids, dtype=dtype)
    elif fallback is not None:
        head = fallback(model, dtype)
    else:
        raise SpecConfigError(f"algorithm {name!r} needs a draft model: set spec.draft_model")
    if head.config.kind not in reg.head_kinds:
        other = algorithm_for_head(head.config.kind)
        raise ConfigError(f"spec.algorithm={name!r} drives {', '.join(reg.head_kinds)} heads, but {head.path} "
                          f"holds a {head.config.kind} head" + (f": use --spec {other}" if other else ""))
    return head.params, head.config


def register_head(name: str, info: AlgorithmInfo, make: Callable[..., Any], *, head_kinds: tuple[str, ...],
                  fallback: Callable[..., Any] | None = None, **kw) -> str:
    """Register a head drafter. `make(plan, spec, head, sample)` builds it from its `HeadConfig`;
    `sample`: sampled rows draw the drafts (rejection and coupled verify), which the coupled rule then
    races with the target's noise. `fallback(model, dtype)`: the head when no directory is given."""

    def build(*, plan, spec, draft_cfg, **_):
        from jaxspec.models.heads.config import HeadConfig

        if not isinstance(draft_cfg, HeadConfig) or draft_cfg.kind not in head_kinds:
            raise SpecConfigError(f"spec.algorithm={name!r} needs a {' or '.join(head_kinds)} head (spec.draft_model: "
                                  f"a head directory in its published format); got {getattr(draft_cfg, 'kind', None)}")
        try:
            drafter = make(plan, spec, draft_cfg, plan.sampled_rule in ("rejection", "coupled"))
            # replace re-runs the drafter's checks, which may refuse what only the coupled rule lacks
            return dataclasses.replace(drafter, coupled=True) if plan.sampled_rule == "coupled" else drafter
        except ValueError as e:
            raise SpecConfigError(str(e)) from None

    def load(spec, model, dtype, **lkw):
        return _load_head(spec, model, dtype, fallback=fallback, **lkw)

    return register(name, info, build, load=load, head_kinds=head_kinds, builtin=True, **kw)
