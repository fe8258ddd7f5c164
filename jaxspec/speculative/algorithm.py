"""The drafter registry: each speculative algorithm, built-in or plugin, is one `register` call.

A registration is everything the rest of jaxspec may know about a drafter:
- its name and aliases (case-insensitive; NEXTN is EAGLE's alias, as in SGLang);
- its capabilities (`AlgorithmInfo`): the loop, the runner and the validator branch on these,
  never on a name;
- the head kinds it drives and the head shipped for the embedded model, if any;
- the `[spec]` fields only it reads (`reads`): any other algorithm refuses them when set,
  instead of silently ignoring them;
- its loader (the draft weights a spec names) and its builder (the drafter object of a plan).

The built-in drafters register in their own modules (`jaxspec/speculative/drafters/*.py`); importing
`jaxspec.speculative.drafters` registers them all and re-exports the lookups below, which is how
the rest of jaxspec reaches them (this module imports no drafter, so there is no import cycle; a
lookup before the built-ins are registered is an error saying so). Plugins register the same way
from their own modules, found through the `jaxspec.drafters` entry point or $JAXSPEC_PLUGINS the
first time a name is not known. A config is validated once, where it becomes an engine
(`drafters.validate_config`, called by `jaxspec.LLM` and `build_server` before loading).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

from jaxspec.config import SpecSection
from jaxspec.speculative.tree import check_draft_config


class SpecConfigError(ValueError):
    """An invalid speculative-decoding setting; the message names the field."""


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


@dataclasses.dataclass(frozen=True)
class Registration:
    """One algorithm. `build(plan=, spec=, target_cfg=, draft_cfg=, catch_up_width=)` returns its drafter
    (a plugin's factory may take **_ for what it does not read); `load(spec, model, dtype, *,
    cache_dir, progress)` returns (params, config) of its draft weights, or None."""

    name: str
    info: AlgorithmInfo
    build: Callable[..., Any] | None = None
    load: Callable[..., Any] | None = None
    aliases: tuple[str, ...] = ()
    head_kinds: tuple[str, ...] = ()  # head formats (HeadConfig.kind) it drives
    shipped_head: str = ""  # a directory under checkpoints/: the head for the embedded model
    reads: tuple[str, ...] = ()  # owned [spec] fields it uses
    # A draft without spec.draft_model (the shipped head, the target's own layers): default, a shipped head.
    default_draft: Callable[[SpecSection], bool] | None = None
    draft_hint: str = ""  # how else to give it a draft, for the "needs a draft model" error
    builtin: bool = False

    def has_default_draft(self, spec: SpecSection) -> bool:
        return self.default_draft(spec) if self.default_draft is not None else bool(self.shipped_head)


VERIFY_MODES = SpecSection.__dataclass_fields__["verify"].metadata["choices"]
# "auto": the greedy rule on greedy rows, a lossless sampling rule on sampled rows, per row in one
# batch (`sampling_verify` picks the rule). "greedy" is refused for a sampled request: it would
# silently ignore the temperature.


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


# --------------------------------------------------------------------------
# The registry
# --------------------------------------------------------------------------

_REGISTRY: dict[str, Registration] = {}  # canonical name -> registration, in registration order
_ALIASES: dict[str, str] = {}  # alias -> canonical name
# Plugins from outside the package: modules (or functions) named by this entry-point group in an
# installed distribution, and modules listed in $JAXSPEC_PLUGINS (comma-separated). They are
# imported the first time a name is looked up and not known, so the CLI, `jaxspec.LLM` and the
# server all see them with no edit here (vLLM's general-plugins pattern).
PLUGIN_GROUP = "jaxspec.drafters"
PLUGIN_ENV = "JAXSPEC_PLUGINS"
_plugins_loaded = False


def _require_builtins() -> None:
    if not any(r.builtin for r in _REGISTRY.values()):
        raise SpecConfigError("no built-in drafter is registered: import jaxspec.speculative.drafters (it registers "
                              "them) before looking an algorithm up")


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


def register(name: str, info: AlgorithmInfo, factory: Callable[..., Any] | None = None, *,
             aliases: tuple[str, ...] = (), load: Callable[..., Any] | None = None,
             head_kinds: tuple[str, ...] = (), shipped_head: str = "", reads: tuple[str, ...] = (),
             default_draft: Callable[[SpecSection], bool] | None = None, draft_hint: str = "",
             builtin: bool = False) -> str:
    """Add an algorithm; returns its canonical (lowercase) name. `factory` builds its drafter.

    A name (or alias) registers once, and built-in names are reserved (`unregister` a plugin first
    to replace it), so a name never silently changes meaning."""
    if not isinstance(name, str) or not name.strip():
        raise SpecConfigError(f"plugin algorithm name must be a non-empty string, got {name!r}")
    if not isinstance(info, AlgorithmInfo):
        raise SpecConfigError(f"register({name!r}): info must be an AlgorithmInfo, got {info!r}")
    for what, fn in (("factory", factory), ("load", load), ("default_draft", default_draft)):
        if fn is not None and not callable(fn):
            raise SpecConfigError(f"register({name!r}): {what} must be callable, got {fn!r}")
    owned = [f.name for f in dataclasses.fields(SpecSection) if f.metadata.get("owned")]
    if not set(reads) <= set(owned):
        raise SpecConfigError(f"register({name!r}): reads must name owned spec fields ({', '.join(owned)}); "
                              f"got {list(reads)}")
    key = name.strip().lower()
    keys = (key,) + tuple(a.strip().lower() for a in aliases)
    for k in keys:
        taken = _REGISTRY.get(_ALIASES.get(k, k))
        if taken is not None:
            if taken.builtin:
                raise SpecConfigError(f"algorithm name {k!r} is reserved for a built-in algorithm")
            raise SpecConfigError(f"algorithm {k!r} is already registered as a plugin")
    _REGISTRY[key] = Registration(key, info, factory, load, keys[1:], tuple(head_kinds), shipped_head,
                                  tuple(reads), default_draft, draft_hint, builtin)
    _ALIASES.update({a: key for a in keys[1:]})
    return key


def unregister(name: str) -> None:
    """Remove a plugin (tests); unknown names are ignored, built-ins refused."""
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    reg = _REGISTRY.get(key)
    if reg is None:
        return
    if reg.builtin:
        raise SpecConfigError(f"cannot unregister built-in algorithm {key!r}")
    del _REGISTRY[key]
    for a in reg.aliases:
        _ALIASES.pop(a, None)


# --------------------------------------------------------------------------
# Lookup
# --------------------------------------------------------------------------


def registrations() -> tuple[Registration, ...]:
    _require_builtins()
    return tuple(_REGISTRY.values())


def builtin_names() -> tuple[str, ...]:
    return tuple(r.name for r in registrations() if r.builtin)


def valid_names() -> tuple[str, ...]:
    """Every accepted name: built-ins, aliases, then plugins (lowercase)."""
    regs = registrations()
    return (builtin_names() + tuple(a for r in regs if r.builtin for a in r.aliases)
            + tuple(sorted(r.name for r in regs if not r.builtin)))


def _describe_valid() -> str:
    regs = registrations()
    parts = [r.name for r in regs if r.builtin]
    parts += [f"{a} (alias of {r.name})" for r in regs for a in r.aliases]
    parts += [f"{r.name} (plugin)" for r in sorted(regs, key=lambda r: r.name) if not r.builtin]
    return ", ".join(parts)


def canonical_name(name: str) -> str:
    """Lowercase canonical name of a built-in, alias or plugin; raise if unknown."""
    if not isinstance(name, str):
        raise SpecConfigError(f"algorithm name must be a string, got {name!r}")
    _require_builtins()
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key in _REGISTRY:
        return key
    if not _plugins_loaded:
        load_plugins()
        return canonical_name(name)
    raise SpecConfigError(f"unknown speculative algorithm {name!r}; valid: {_describe_valid()}")


def registration(name: str) -> Registration:
    return _REGISTRY[canonical_name(name)]


def algorithm_info(name: str) -> AlgorithmInfo:
    return registration(name).info


def implemented_names() -> tuple[str, ...]:
    regs = registrations()
    return tuple(r.name for r in regs if r.builtin and r.info.implemented) + tuple(
        sorted(r.name for r in regs if not r.builtin and r.info.implemented))


def algorithm_for_head(kind: str) -> str | None:
    """The algorithm that drives heads of format `kind` (HeadConfig.kind), if any."""
    return next((r.name for r in registrations() if kind in r.head_kinds), None)


def shipped_head(name: str) -> Path:
    """The head directory shipped for `name` and the embedded model; FileNotFoundError naming what is missing."""
    from jaxspec.paths import checkpoints_dir

    reg = registration(name)
    if not reg.shipped_head:
        shipped = [r.name for r in registrations() if r.shipped_head]
        raise FileNotFoundError(f"no head ships for --spec {reg.name}; shipped: "
                                f"{', '.join(shipped) or 'none'} (give --draft-model DIR)")
    path = checkpoints_dir() / reg.shipped_head
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"the shipped {reg.name} head is not at {path} (a source checkout has it under "
                                "checkpoints/; give --draft-model DIR)")
    return path


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


def _owned_checks(s: SpecSection, reg: Registration) -> list[tuple[bool, str]]:
    """A field only some drafters read, set for one that does not, is an error, not a no-op."""
    out = []
    for f in dataclasses.fields(SpecSection):
        if f.metadata.get("owned") and f.name not in reg.reads and getattr(s, f.name) != f.default:
            owners = [r.name for r in registrations() if f.name in r.reads]
            flag = f.metadata.get("flag") or f.name.replace("_", "-")
            who = " and ".join([", ".join(owners[:-1]), owners[-1]] if len(owners) > 1 else owners)
            out.append((False, f"spec.{f.name} (--{flag}) is read by {who or 'no drafter'} only; "
                               f"--spec {reg.name} would ignore it (leave it unset)"))
    return out


def _drafter_checks(s: SpecSection, reg: Registration) -> list[tuple[bool, str]]:
    """Cross-field checks for a speculative algorithm, in reporting order."""
    name, info = reg.name, reg.info
    checks: list[tuple[bool, str]] = [
        (s.num_draft_tokens >= 2,
         f"spec.num_draft_tokens must be >= 2 for algorithm {name!r} (the root plus at least "
         f"one draft token); got {s.num_draft_tokens}"),
        (s.topk == 1 or info.supports_tree,
         f"spec.topk={s.topk} needs a tree drafter, but algorithm {name!r} drafts chains "
         f"only; use spec.topk=1"),
        (not info.needs_draft_model or bool(s.draft_model) or reg.has_default_draft(s),
         f"algorithm {name!r} needs a draft model: set spec.draft_model"
         + (reg.draft_hint or " (a head directory in its published format)")),
    ]
    if s.simulate_accept_length > 0:
        most = max_accept_length(s.num_steps, s.num_draft_tokens) if info.drafts_in_steps else s.num_draft_tokens
        checks.append(
            (s.simulate_accept_length <= most,
             f"spec.simulate_accept_length={s.simulate_accept_length} exceeds the most one "
             f"verify can commit, " + (f"1 + min(num_steps, num_draft_tokens - 1) = {most}"
                                       if info.drafts_in_steps else f"num_draft_tokens = {most}")))
    return checks


def promoted(name: str, draft_model: str) -> str:
    """EAGLE (and its NEXTN alias) given a FROZEN_KV_MTP draft runs as frozen_kv_mtp, as SGLang
    promotes NEXTN/EAGLE when the draft's `architectures` is a Gemma 4 assistant."""
    if name != "eagle" or not draft_model or draft_model == "default":
        return name
    import json

    from jaxspec.models.heads.frozen_kv import detect

    try:
        cfg = json.loads((Path(draft_model).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return name  # the loader reports an unreadable head directory
    return "frozen_kv_mtp" if isinstance(cfg, dict) and detect(cfg) else name


def validate_spec_config(spec: SpecSection) -> SpecSection:
    """Check [spec]; return it with `algorithm` canonicalised. `drafters.validate_config` calls this
    where a config becomes an engine, the one place a spec is validated.

    Raises SpecConfigError naming the field at the first problem. With algorithm "none" only field
    ranges are checked (the drafter fields are unused), except that simulate_accept_length needs a
    drafter. Whether simulate_accept_length may run at all is the front end's call
    (`check_benchmark_only`): a config may hold it, only the benchmarks and the CLI run it.
    """
    try:
        name = canonical_name(spec.algorithm)
    except SpecConfigError as e:
        raise SpecConfigError(f"spec.algorithm: {e}") from None
    name = promoted(name, spec.draft_model)
    reg = registration(name)
    info = reg.info
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
        checks = _drafter_checks(spec, reg)
    else:
        checks.append((spec.simulate_accept_length == 0,
                       "spec.simulate_accept_length > 0 needs a speculative algorithm "
                       "(spec.algorithm is 'none')"))
    for ok, msg in checks + _owned_checks(spec, reg):
        if not ok:
            raise SpecConfigError(msg)
    return dataclasses.replace(spec, algorithm=name)


def check_benchmark_only(spec: SpecSection, benchmark: bool) -> None:
    """simulate_accept_length commits tokens the target did not choose: only a benchmark may run it."""
    if spec.simulate_accept_length > 0 and not benchmark:
        raise SpecConfigError(f"spec.simulate_accept_length={spec.simulate_accept_length} is a benchmark-only "
                              "mode (it commits tokens the target did not choose); set it to 0")
