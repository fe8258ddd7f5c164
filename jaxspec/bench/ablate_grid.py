"""Ablation grids: a TOML file -> the points `python -m jaxspec.bench ablate` runs.

Pure (stdlib only, no JAX), so a grid is checked in milliseconds and the tests
can expand one without a model. A grid file:

    name = "tree-vs-chain"
    model = "default"           # the target: "default" (embedded SmolLM2) or a path
    num_prompts = 10            # per prompt set (--max-prompts shrinks it)
    max_new_tokens = 128        # per prompt, EOS ignored (--max-new-tokens overrides)
    seed = 0                    # request seed = seed + prompt index (sampled rows)
    time_split = true           # draft / verify / other split: reruns a point's first batch phase by phase

    [fixed]                     # keys every point gets
    verify = "auto"

    [axes]                      # the cross product, in this order
    prompt_set = ["mtbench", "humaneval"]          # a set name, or "jsonl:PATH"
    drafter = [{ name = "ngram", algorithm = "ngram" },
               { name = "eagle3", algorithm = "eagle3", draft_model = "default" }]
    shape = [{ name = "chain 8", topk = 1, num_steps = 7, num_draft_tokens = 8 },
             { name = "tree 8", topk = 2, num_steps = 3, num_draft_tokens = 8 }]
    temperature = [0.0, 1.0]

    [[exclude]]                 # a point matching every key of one rule is pruned
    drafter = "ngram"
    shape = ["tree 8"]

    [ceiling]                   # optional: forced-acceptance points (output NOT exact)
    algorithm = "ngram"
    num_steps = 8
    num_draft_tokens = 9
    accept_lengths = [1, 2, 4, 6, 8]

An axis is a list of levels. A level is a scalar for an axis named after a
point key (`temperature = [0.0, 1.0]`), or a table of point keys with an
optional `name` (its label; default "k=v, ..."). Point keys: every [spec] key
(SpecSection), temperature, top_p, top_k, batch_size, prompt_set, seed and
time_split (so a level can turn the split on or off for its points).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import tomllib
from pathlib import Path
from typing import Any

from jaxspec.config import SpecSection

SPEC_KEYS = tuple(f.name for f in dataclasses.fields(SpecSection))
RUN_KEYS = ("temperature", "top_p", "top_k", "batch_size", "prompt_set", "seed", "time_split")
POINT_KEYS = SPEC_KEYS + RUN_KEYS
TOP_KEYS = {"name": str, "description": str, "model": str, "dtype": str, "num_prompts": int,
            "max_new_tokens": int, "seed": int, "time_split": bool}
# The axes that say where a method runs, not which method: the report groups by the rest.
WHERE_AXES = ("prompt_set", "batch_size")
RUN_DEFAULTS = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "batch_size": 1, "prompt_set": "mtbench"}


class GridError(ValueError):
    """A grid file that cannot be run; the message names the file and the key."""


@dataclasses.dataclass(frozen=True)
class Grid:
    name: str
    path: str
    model: str = "default"
    dtype: str = "float32"
    num_prompts: int = 10
    max_new_tokens: int = 128
    seed: int = 0
    time_split: bool = True
    description: str = ""
    fixed: dict = dataclasses.field(default_factory=dict)
    axes: tuple = ()  # ((axis, ((label, {key: value}), ...)), ...)
    exclude: tuple = ()  # ({axis: (label, ...)}, ...)
    ceiling: dict | None = None  # spec keys + accept_lengths

    def shrink(self, max_prompts: int | None = None, max_new_tokens: int | None = None) -> "Grid":
        """The grid with fewer prompts per set and/or another token count (--max-prompts / --max-new-tokens)."""
        for flag, v in (("--max-prompts", max_prompts), ("--max-new-tokens", max_new_tokens)):
            if v is not None and v < 1:
                raise GridError(f"{flag} must be >= 1, got {v}")
        return dataclasses.replace(self, num_prompts=min(self.num_prompts, max_prompts or self.num_prompts),
                                   max_new_tokens=max_new_tokens or self.max_new_tokens)


@dataclasses.dataclass(frozen=True)
class Point:
    """One grid point: which method (spec keys), where it runs, and its labels.

    kind: "point" (a grid point), "baseline" (plain decoding beside the points of
    one prompt set / batch / sampling), "ceiling" (forced acceptance)."""

    kind: str
    labels: tuple  # ((axis, label), ...) in axis order
    spec: dict  # SpecSection keys given for this point
    run: dict  # RUN_KEYS, defaults filled in

    @property
    def method(self) -> str:
        """The label without where it ran: what the report compares across prompt sets / batch sizes."""
        return ", ".join(lab for ax, lab in self.labels if ax not in WHERE_AXES) or "plain"

    def config(self, grid: Grid) -> dict:
        """Everything that decides this point's rows (JSON-able); its hash is the point id."""
        spec = {**dataclasses.asdict(SpecSection()), **self.spec}
        spec = {k: list(v) if isinstance(v, tuple) else v for k, v in spec.items()}
        return {"kind": self.kind, "method": self.method, "labels": dict(self.labels), "spec": spec, **self.run,
                "model": grid.model, "dtype": grid.dtype, "num_prompts": grid.num_prompts,
                "max_new_tokens": grid.max_new_tokens}

    def point_id(self, grid: Grid) -> str:
        blob = json.dumps(self.config(grid), sort_keys=True, default=str).encode()
        return hashlib.sha1(blob).hexdigest()[:12]


def _where(path: str, what: str) -> str:
    return f"{path}: {what}"


def _check_keys(table: dict, path: str, where: str, allowed=POINT_KEYS, extra=()) -> dict:
    bad = sorted(k for k in table if k not in allowed and k not in extra)
    if bad:
        raise GridError(_where(path, f"{where}: unknown key {bad[0]!r}; point keys: {', '.join(POINT_KEYS)}"))
    return table


def _label(table: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in table.items())


def _levels(axis: str, values: Any, path: str) -> tuple:
    if not isinstance(values, list) or not values:
        raise GridError(_where(path, f"axes.{axis} must be a non-empty list of levels"))
    out, seen = [], set()
    for i, v in enumerate(values):
        where = f"axes.{axis}[{i}]"
        if isinstance(v, dict):
            keys = {k: x for k, x in v.items() if k != "name"}
            _check_keys(keys, path, where)
            if not keys:
                raise GridError(_where(path, f"{where} sets no point key"))
            label = str(v.get("name") or _label(keys))
        elif axis in POINT_KEYS:
            keys, label = {axis: v}, str(v)
        else:
            raise GridError(_where(path, f"{where}: axis {axis!r} is not a point key, so its levels must be "
                                         f"tables ({{ name = ..., key = value }}); got {v!r}"))
        if label in seen:
            raise GridError(_where(path, f"{where}: label {label!r} repeats in axis {axis!r}"))
        seen.add(label)
        out.append((label, keys))
    return tuple(out)


def _exclude_rule(rule: Any, axes: dict, path: str, i: int) -> dict:
    if not isinstance(rule, dict) or not rule:
        raise GridError(_where(path, f"exclude[{i}] must be a table of axis = label(s)"))
    out = {}
    for axis, labels in rule.items():
        if axis not in axes:
            raise GridError(_where(path, f"exclude[{i}]: no axis {axis!r}; axes: {', '.join(axes)}"))
        labels = labels if isinstance(labels, list) else [labels]
        known = [lab for lab, _ in axes[axis]]
        for lab in labels:
            if not any(_same(lab, k) for k in known):
                raise GridError(_where(path, f"exclude[{i}].{axis}: no level {lab!r}; levels: {', '.join(known)}"))
        out[axis] = tuple(labels)
    return out


def _same(a: Any, label: str) -> bool:
    """A rule value matches a level label: numerically for numbers (1 == "1.0"), else as text."""
    try:
        return float(a) == float(label)
    except (TypeError, ValueError):
        return str(a) == label


def parse_grid(text: str, path: str = "<grid>") -> Grid:
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise GridError(_where(path, f"not valid TOML: {e}")) from None
    known = set(TOP_KEYS) | {"fixed", "axes", "exclude", "ceiling"}
    bad = sorted(k for k in raw if k not in known)
    if bad:
        raise GridError(_where(path, f"unknown top-level key {bad[0]!r}; keys: {', '.join(sorted(known))}"))
    top = {}
    for k, typ in TOP_KEYS.items():
        if k in raw:
            if not isinstance(raw[k], typ) or (typ is int and isinstance(raw[k], bool)):
                raise GridError(_where(path, f"{k} must be a {typ.__name__}, got {raw[k]!r}"))
            top[k] = raw[k]
    for k in ("num_prompts", "max_new_tokens"):
        if top.get(k, 1) < 1:
            raise GridError(_where(path, f"{k} must be >= 1, got {top[k]}"))
    fixed = _check_keys(raw.get("fixed", {}), path, "fixed")
    axes_raw = raw.get("axes", {})
    if not isinstance(axes_raw, dict):
        raise GridError(_where(path, "[axes] must be a table of axis = [levels]"))
    axes = {name: _levels(name, v, path) for name, v in axes_raw.items()}
    rules = raw.get("exclude", [])
    if not isinstance(rules, list):
        raise GridError(_where(path, "exclude must be an array of tables ([[exclude]])"))
    exclude = tuple(_exclude_rule(r, axes, path, i) for i, r in enumerate(rules))
    ceiling = raw.get("ceiling")
    if ceiling is not None:
        _check_keys(ceiling, path, "ceiling", allowed=SPEC_KEYS, extra=("accept_lengths",))
        lens = ceiling.get("accept_lengths")
        if not (isinstance(lens, list) and lens and all(isinstance(x, int) and x >= 1 for x in lens)):
            raise GridError(_where(path, "ceiling.accept_lengths must be a non-empty list of integers >= 1"))
    name = top.pop("name", None) or Path(path).stem
    return Grid(name=name, path=path, fixed=fixed, axes=tuple(axes.items()), exclude=exclude, ceiling=ceiling, **top)


def load_grid(path: str | Path) -> Grid:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise GridError(f"grid file not found: {p}") from None
    return parse_grid(text, str(p))


def _excluded(labels: dict, rules: tuple) -> bool:
    return any(all(any(_same(v, labels[ax]) for v in vals) for ax, vals in rule.items()) for rule in rules)


def _point(kind: str, labels: tuple, keys: dict, grid: Grid) -> Point:
    spec = {k: v for k, v in keys.items() if k in SPEC_KEYS}
    run = {**RUN_DEFAULTS, "seed": grid.seed, "time_split": grid.time_split,
           **{k: v for k, v in keys.items() if k in RUN_KEYS}}
    return Point(kind, labels, spec, run)


def expand(grid: Grid) -> tuple[list[Point], int]:
    """(the cross product of the axes less the excluded points, how many were excluded), in axis order
    (the last axis varies fastest). Keys merge fixed first, then each axis's level in order."""
    combos: list[tuple[tuple, dict]] = [((), dict(grid.fixed))]
    for axis, levels in grid.axes:
        combos = [(labels + ((axis, lab),), {**keys, **lk}) for labels, keys in combos for lab, lk in levels]
    kept = [(labels, keys) for labels, keys in combos if not _excluded(dict(labels), grid.exclude)]
    return [_point("point", labels, keys, grid) for labels, keys in kept], len(combos) - len(kept)


def ceiling_points(grid: Grid, points: list[Point]) -> list[Point]:
    """Forced-acceptance points: the [ceiling] chain at each accept length, greedy, on the first prompt
    set, at every batch size the grid runs (the speedup a drafter of that tau could reach)."""
    if not grid.ceiling:
        return []
    spec = {k: v for k, v in grid.ceiling.items() if k != "accept_lengths"}
    spec.setdefault("algorithm", "ngram")
    first = points[0].run["prompt_set"] if points else RUN_DEFAULTS["prompt_set"]
    batches = sorted({p.run["batch_size"] for p in points}) or [1]
    return [_point("ceiling", (("prompt_set", str(first)), ("batch_size", str(b)), ("ceiling", f"ceiling L={n}")),
                   {**spec, "simulate_accept_length": n, "prompt_set": first, "batch_size": b}, grid)
            for b in batches for n in grid.ceiling["accept_lengths"]]


def baseline_of(point: Point, grid: Grid) -> Point:
    """Plain decoding where `point` runs: same prompt set, batch size and sampling."""
    run = {**point.run, "time_split": False}  # plain decoding has no phases
    return _point("baseline", (("prompt_set", str(point.run["prompt_set"])), ("batch_size", str(point.run["batch_size"])),
                               ("method", "plain")), run, grid)


def plan(grid: Grid) -> tuple[list[Point], int]:
    """(every point to run: the baselines first, then the grid points, then the ceiling; excluded count)."""
    points, excluded = expand(grid)
    extra = ceiling_points(grid, points)
    baselines: dict[str, Point] = {}
    for p in points + extra:
        b = baseline_of(p, grid)
        baselines.setdefault(b.point_id(grid), b)
    return list(baselines.values()) + points + extra, excluded
