"""Speculative algorithms: names, capabilities, plugin registry, config validation.

The family follows SGLang's `SpeculativeAlgorithm`: NONE (plain decode), NGRAM,
STANDALONE, EAGLE, EAGLE3, MEDUSA, DFLASH, DSPARK, with NEXTN accepted as an alias
of EAGLE (MTP checkpoints are driven through the EAGLE path). Names are
case-insensitive; the canonical spelling is the lowercase enum value, which is
what `[spec] algorithm` holds after `validate_spec_config`.

What an algorithm needs and supports is plain data (`AlgorithmInfo`), looked up
with `algorithm_info(name)`, so the engine branches on capabilities
(`info.supports_tree`) rather than on algorithm identity; what a drafter needs at run
time (a draft cache, target features, draft probabilities) its drafter object declares
(`protocol.py`). Plugins add
algorithms at runtime with `register(name, info, factory)`; they are not enum
members, so code that must handle plugins goes through `canonical_name` /
`algorithm_info` / `plugin_factory` instead of `SpecAlgorithm`.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Callable

from jaxspec.config import SpecSection
from jaxspec.speculative.tree import check_draft_config


class SpecConfigError(ValueError):
    """An invalid speculative-decoding setting; the message names the field."""


class SpecAlgorithm(enum.Enum):
    NONE = "none"
    NGRAM = "ngram"
    STANDALONE = "standalone"
    EAGLE = "eagle"
    EAGLE3 = "eagle3"
    MEDUSA = "medusa"
    MLP_SPECULATOR = "mlp_speculator"
    DFLASH = "dflash"
    DSPARK = "dspark"

    @classmethod
    def from_name(cls, name: str | SpecAlgorithm) -> SpecAlgorithm:
        """Built-in algorithm by name (case-insensitive, NEXTN -> EAGLE).

        A registered plugin name is valid but not an enum member, so it raises
        too; use `algorithm_info` / `plugin_factory` for plugins.
        """
        key = canonical_name(name)
        if key in _PLUGINS:
            raise SpecConfigError(
                f"algorithm {key!r} is a registered plugin, not a built-in SpecAlgorithm; "
                f"look it up with algorithm_info()/plugin_factory()")
        return cls(key)

    @property
    def info(self) -> AlgorithmInfo:
        return _BUILTIN_INFO[self]


@dataclasses.dataclass(frozen=True)
class AlgorithmInfo:
    """Capabilities of one algorithm. Defaults describe a generic drafter."""

    needs_draft_model: bool = False  # loads extra draft weights
    supports_tree: bool = False  # can draft topk > 1 trees (else chains only)
    # Draft trees grow one model step per level, so num_steps bounds their
    # depth and num_draft_tokens <= 1 + topk + (num_steps-1)*topk^2. N-gram
    # lookups have no steps: their depth is bounded by num_draft_tokens alone.
    drafts_in_steps: bool = True
    # Drafts of varying length, padded at the end (a lookup that may find
    # little): the loop then verifies at the narrowest width that holds them.
    variable_draft_width: bool = False
    implemented: bool = True
    speculative: bool = True  # False only for NONE: no draft, no verify
    description: str = ""


_BUILTIN_INFO: dict[SpecAlgorithm, AlgorithmInfo] = {
    SpecAlgorithm.NONE: AlgorithmInfo(
        speculative=False, description="plain autoregressive decode"),
    SpecAlgorithm.NGRAM: AlgorithmInfo(
        supports_tree=True, drafts_in_steps=False, variable_draft_width=True,
        description="n-gram lookup in the prompt/generated tokens (and an optional corpus)"),
    SpecAlgorithm.STANDALONE: AlgorithmInfo(
        needs_draft_model=True, supports_tree=True,
        description="a smaller LM (or the target's first layers) drafts token by token"),
    SpecAlgorithm.EAGLE: AlgorithmInfo(
        needs_draft_model=True, supports_tree=True,
        description="EAGLE-1 head with EAGLE-2 dynamic trees (also NEXTN/MTP layers of the target)"),
    SpecAlgorithm.EAGLE3: AlgorithmInfo(
        needs_draft_model=True, supports_tree=True,
        description="EAGLE-3 head on multi-layer target features, reduced draft vocabulary"),
    SpecAlgorithm.MEDUSA: AlgorithmInfo(
        needs_draft_model=True, supports_tree=True,
        description="Medusa parallel decoding heads (tree from medusa choices)"),
    SpecAlgorithm.MLP_SPECULATOR: AlgorithmInfo(
        needs_draft_model=True,
        description="IBM MLP speculator: n_predict MLP stages on the last hidden state"),
    # Block drafters emit a whole chain per forward; their depth is the block, not
    # a number of steps. Sampled rows draw each position from the block's own
    # distribution, which is their q. DSPARK's planner cuts rows short (-1
    # padding), so its verify runs at the narrowest width holding the batch.
    SpecAlgorithm.DFLASH: AlgorithmInfo(
        needs_draft_model=True, drafts_in_steps=False,
        description="DFlash block drafter: the whole chain in one forward over [root, MASK...]"),
    SpecAlgorithm.DSPARK: AlgorithmInfo(
        needs_draft_model=True, drafts_in_steps=False, variable_draft_width=True,
        description="DSpark: a DFlash block with a Markov head and a confidence planner (ragged verify)"),
}

ALIASES: dict[str, SpecAlgorithm] = {"nextn": SpecAlgorithm.EAGLE}
# "auto": the greedy rule on greedy rows, a lossless sampling rule on sampled
# rows, per row in one batch (`sampling_verify` picks the rule). "greedy" is
# refused for a sampled request: it would silently ignore the temperature.
VERIFY_MODES = ("auto", "greedy", "target-only", "rejection", "coupled")


def sampling_verify(verify: str) -> str:
    """The rule sampled rows get: `verify` itself, or for "auto" the coupled rule: exact, and
    the output of plain sampling with the same seed token for token, so a seeded request
    reproduces whatever its batch, draft length or planner (issue 23). It keeps 97-98% of
    rejection's tau on MT-Bench (docs/semantics.md); "rejection" remains one flag away."""
    return "coupled" if verify == "auto" else verify


def check_request_sampling(verify: str, temperature: float) -> None:
    """Refuse a sampled request under the greedy rule (it would decode greedily)."""
    if verify == "greedy" and temperature > 0:
        raise SpecConfigError(
            f"spec.verify='greedy' ignores temperature, but the request has temperature={temperature}: "
            "use spec.verify='auto' (or 'rejection'), or temperature 0")

# name -> (info, factory). Module-level on purpose: plugins register at import.
_PLUGINS: dict[str, tuple[AlgorithmInfo, Callable[..., Any] | None]] = {}
# Plugins from outside the package: modules (or functions) named by this entry-point group in an
# installed distribution, and modules listed in $JAXSPEC_PLUGINS (comma-separated). They are
# imported the first time a name is looked up and not known, so the CLI, `jaxspec.LLM` and the
# server all see them with no edit here (vLLM's general-plugins pattern).
PLUGIN_GROUP = "jaxspec.drafters"
PLUGIN_ENV = "JAXSPEC_PLUGINS"
_plugins_loaded = False


def load_plugins() -> None:
    """Import every external plugin once per process; a module registers at import, a function
    named by an entry point is called. A plugin that fails is an error naming it."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True  # first: a plugin that looks a name up while importing must not recurse
    import importlib
    import os
    from importlib.metadata import entry_points

    for ep in entry_points(group=PLUGIN_GROUP):
        try:
            obj = ep.load()
            if callable(obj):
                obj()
        except Exception as e:
            raise SpecConfigError(f"drafter plugin entry point {ep.name!r} ({ep.value}) failed: "
                                  f"{type(e).__name__}: {e}") from None
    for mod in filter(None, (m.strip() for m in os.environ.get(PLUGIN_ENV, "").split(","))):
        try:
            importlib.import_module(mod)
        except Exception as e:
            raise SpecConfigError(f"{PLUGIN_ENV} module {mod!r} failed to import: {type(e).__name__}: {e}") from None


# --------------------------------------------------------------------------
# Names and lookup
# --------------------------------------------------------------------------


def builtin_names() -> tuple[str, ...]:
    return tuple(a.value for a in SpecAlgorithm)


def valid_names() -> tuple[str, ...]:
    """Every accepted name: built-ins, aliases, then plugins (lowercase)."""
    return builtin_names() + tuple(ALIASES) + tuple(sorted(_PLUGINS))


def _describe_valid() -> str:
    parts = list(builtin_names())
    parts += [f"{a} (alias of {t.value})" for a, t in ALIASES.items()]
    parts += [f"{p} (plugin)" for p in sorted(_PLUGINS)]
    return ", ".join(parts)


def canonical_name(name: str | SpecAlgorithm) -> str:
    """Lowercase canonical name of a built-in, alias or plugin; raise if unknown."""
    if isinstance(name, SpecAlgorithm):
        return name.value
    if not isinstance(name, str):
        raise SpecConfigError(f"algorithm name must be a string, got {name!r}")
    key = name.strip().lower()
    if key in ALIASES:
        return ALIASES[key].value
    if key in _PLUGINS or key in builtin_names():
        return key
    if not _plugins_loaded:
        load_plugins()
        return canonical_name(name)
    raise SpecConfigError(f"unknown speculative algorithm {name!r}; valid: {_describe_valid()}")


def algorithm_info(name: str | SpecAlgorithm) -> AlgorithmInfo:
    key = canonical_name(name)
    if key in _PLUGINS:
        return _PLUGINS[key][0]
    return _BUILTIN_INFO[SpecAlgorithm(key)]


def plugin_factory(name: str) -> Callable[..., Any] | None:
    """The factory a plugin registered with (None for built-ins or no factory)."""
    key = canonical_name(name)
    return _PLUGINS[key][1] if key in _PLUGINS else None


def implemented_names() -> tuple[str, ...]:
    return tuple(n for n in builtin_names() + tuple(sorted(_PLUGINS))
                 if algorithm_info(n).implemented)


# --------------------------------------------------------------------------
# Plugin registry
# --------------------------------------------------------------------------


def register(name: str, info: AlgorithmInfo, factory: Callable[..., Any] | None = None) -> str:
    """Add a plugin algorithm; returns its canonical (lowercase) name.

    Built-in names and aliases are reserved, and a plugin name registers once
    (`unregister` first to replace it), so a name never silently changes meaning.
    """
    if not isinstance(name, str) or not name.strip():
        raise SpecConfigError(f"plugin algorithm name must be a non-empty string, got {name!r}")
    if not isinstance(info, AlgorithmInfo):
        raise SpecConfigError(f"register({name!r}): info must be an AlgorithmInfo, got {info!r}")
    if factory is not None and not callable(factory):
        raise SpecConfigError(f"register({name!r}): factory must be callable, got {factory!r}")
    key = name.strip().lower()
    if key in builtin_names() or key in ALIASES:
        raise SpecConfigError(f"algorithm name {key!r} is reserved for a built-in algorithm")
    if key in _PLUGINS:
        raise SpecConfigError(f"algorithm {key!r} is already registered as a plugin")
    _PLUGINS[key] = (info, factory)
    return key


def unregister(name: str) -> None:
    """Remove a plugin (tests); unknown names are ignored, built-ins refused."""
    key = name.strip().lower()
    if key in builtin_names() or key in ALIASES:
        raise SpecConfigError(f"cannot unregister built-in algorithm {key!r}")
    _PLUGINS.pop(key, None)


# --------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------


def max_accept_length(num_steps: int, num_draft_tokens: int) -> int:
    """Most tokens one verify can commit: the deepest path plus the bonus.

    A tree of num_draft_tokens nodes (root included) drafted in num_steps
    steps is at most min(num_steps, num_draft_tokens - 1) drafts deep.
    """
    return 1 + min(num_steps, num_draft_tokens - 1)


def _field_checks(s: SpecSection) -> list[tuple[bool, str]]:
    """Range checks that hold whatever the algorithm (typos are caught even
    when the field is unused)."""
    return [
        (s.verify in VERIFY_MODES,
         f"spec.verify must be one of {', '.join(VERIFY_MODES)}; got {s.verify!r}"),
        (0 < s.threshold_single <= 1,
         f"spec.threshold_single must be in (0, 1]; got {s.threshold_single}"),
        (0 < s.threshold_acc <= 1,
         f"spec.threshold_acc must be in (0, 1]; got {s.threshold_acc}"),
        (s.num_steps >= 1, f"spec.num_steps must be >= 1; got {s.num_steps}"),
        (s.topk >= 1, f"spec.topk must be >= 1; got {s.topk}"),
        (s.num_draft_tokens >= 1, f"spec.num_draft_tokens must be >= 1; got {s.num_draft_tokens}"),
        (s.ngram_min_match >= 1, f"spec.ngram_min_match must be >= 1; got {s.ngram_min_match}"),
        (s.ngram_min_match <= s.ngram_max_match,
         f"spec.ngram_min_match ({s.ngram_min_match}) must be <= spec.ngram_max_match "
         f"({s.ngram_max_match})"),
        (all(t >= 1 for t in s.ngram_draft_tokens_by_match)
         and len(s.ngram_draft_tokens_by_match) <= s.ngram_max_match,
         f"spec.ngram_draft_tokens_by_match needs at most ngram_max_match ({s.ngram_max_match}) "
         f"entries, each >= 1; got {list(s.ngram_draft_tokens_by_match)}"),
        (s.draft_layers >= 0, f"spec.draft_layers must be >= 0; got {s.draft_layers}"),
        (s.eagle3_layer_ids in ("output", "input"),
         f"spec.eagle3_layer_ids must be 'output' (SpecForge/SGLang) or 'input' (vLLM); got {s.eagle3_layer_ids!r}"),
        (s.simulate_accept_length >= 0,
         f"spec.simulate_accept_length must be >= 0 (0 = off); got {s.simulate_accept_length}"),
    ]


def _has_builtin_default(name: str, s: SpecSection) -> bool:
    """A draft model without spec.draft_model: the target's first layers
    (standalone, draft_layers > 0), the target's own MTP layers (eagle, as
    NEXTN; the loader says so if the target has none), or the head shipped for
    the embedded model (eagle3, medusa; the loader says so if the target is
    another model)."""
    from jaxspec.paths import SHIPPED_HEADS

    return (name == "standalone" and s.draft_layers > 0) or name == "eagle" or name in SHIPPED_HEADS


def _drafter_checks(s: SpecSection, name: str, info: AlgorithmInfo,
                    benchmark: bool, draft_given: bool = False) -> list[tuple[bool, str]]:
    """Cross-field checks for a speculative algorithm, in reporting order."""
    checks: list[tuple[bool, str]] = [
        (s.num_draft_tokens >= 2,
         f"spec.num_draft_tokens must be >= 2 for algorithm {name!r} (the root plus at least "
         f"one draft token); got {s.num_draft_tokens}"),
        (s.topk == 1 or info.supports_tree,
         f"spec.topk={s.topk} needs a tree drafter, but algorithm {name!r} drafts chains "
         f"only; use spec.topk=1"),
        (not info.needs_draft_model or draft_given or bool(s.draft_model) or _has_builtin_default(name, s),
         f"algorithm {name!r} needs a draft model: set spec.draft_model" + (
             ", or spec.draft_layers > 0 to draft with the target's first layers" if name == "standalone"
             else " (a head directory in its published format)")),
    ]
    if s.simulate_accept_length > 0:
        most = max_accept_length(s.num_steps, s.num_draft_tokens) if info.drafts_in_steps else s.num_draft_tokens
        checks += [
            (benchmark,
             f"spec.simulate_accept_length={s.simulate_accept_length} is a benchmark-only "
             f"mode (it commits tokens the target did not choose); set it to 0"),
            (s.simulate_accept_length <= most,
             f"spec.simulate_accept_length={s.simulate_accept_length} exceeds the most one "
             f"verify can commit, " + (f"1 + min(num_steps, num_draft_tokens - 1) = {most}"
                                       if info.drafts_in_steps else f"num_draft_tokens = {most}")),
        ]
    return checks


def validate_spec_config(spec: SpecSection, *, benchmark: bool = False, draft_given: bool = False) -> SpecSection:
    """Check [spec] up front; return it with `algorithm` canonicalised.

    Raises SpecConfigError naming the field at the first problem. With
    algorithm "none" only field ranges are checked (the drafter fields are
    unused), except that simulate_accept_length needs a drafter. benchmark=True
    is the bench harness: it alone may set simulate_accept_length > 0.
    draft_given: the caller holds draft weights already (an Engine built with
    `draft=`), so spec.draft_model need not name them.
    """
    try:
        name = canonical_name(spec.algorithm)
    except SpecConfigError as e:
        raise SpecConfigError(f"spec.algorithm: {e}") from None
    info = algorithm_info(name)
    if not info.implemented:
        raise SpecConfigError(
            f"spec.algorithm={name!r} is not implemented yet; implemented: "
            f"{', '.join(implemented_names())}")
    checks = _field_checks(spec)
    if info.speculative:
        for ok, msg in checks:
            if not ok:
                raise SpecConfigError(msg)
        try:
            if info.drafts_in_steps:
                check_draft_config(spec.num_steps, spec.topk, spec.num_draft_tokens)
        except ValueError as e:
            raise SpecConfigError(f"spec.num_draft_tokens: {e}") from None
        checks = _drafter_checks(spec, name, info, benchmark, draft_given)
    else:
        checks.append((spec.simulate_accept_length == 0,
                       "spec.simulate_accept_length > 0 needs a speculative algorithm "
                       "(spec.algorithm is 'none')"))
    for ok, msg in checks:
        if not ok:
            raise SpecConfigError(msg)
    return dataclasses.replace(spec, algorithm=name)
