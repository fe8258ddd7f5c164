"""The plots of `bench ablate`, from its summary (one entry per point; `ablate_report.summarize`).

Each is written as PNG and SVG under plots/: acceptance per draft position, tau
against draft budget per drafter, speedup against batch size, tau by prompt set,
and the forced-acceptance ceiling against the measured points. Headless (Agg).
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

MAX_LINES = 12  # lines per plot before the legend stops being readable


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, out: Path, name: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{name}.png", out / f"{name}.svg"]
    fig.tight_layout()
    for p in paths:
        fig.savefig(p, dpi=120)
    _plt().close(fig)
    return paths


def _drafter(s: dict) -> str:
    return s["labels"].get("drafter") or s["algorithm"]


def _mean(xs) -> float:
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(xs) / len(xs) if xs else math.nan


def _where(s: dict, vary: set) -> str:
    """The point's method, plus the prompt set / batch size when those vary in the plot."""
    extra = [f"{s['prompt_set']}" if "prompt_set" in vary else "", f"b={s['batch_size']}" if "batch_size" in vary else ""]
    return " | ".join([s["method"], *[e for e in extra if e]])


def plot_position(points: list[dict], out: Path, title: str) -> list[Path]:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    vary = {k for k in ("prompt_set", "batch_size") if len({s[k] for s in points}) > 1}
    shown = [s for s in points if s["cond_acceptance"]][:MAX_LINES]
    for s in shown:
        ys = s["cond_acceptance"]
        ax.plot(range(1, len(ys) + 1), ys, marker="o", label=f"{_where(s, vary)} (tau {s['tau']:.2f})")
    cut = len([s for s in points if s["cond_acceptance"]]) - len(shown)
    ax.set_title(f"{title}: acceptance per draft position" + (f" (first {MAX_LINES}; {cut} more in summary.md)"
                                                              if cut > 0 else ""))
    ax.xaxis.get_major_locator().set_params(integer=True)  # positions are whole numbers
    ax.set_xlabel("draft position i (depth in the tree)")
    ax.set_ylabel("P(position i accepted | i-1 accepted)")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    if shown:
        ax.legend(fontsize=7)
    return _save(fig, out, "acceptance_by_position")


def plot_budget(points: list[dict], out: Path, title: str) -> list[Path]:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series: dict[tuple, dict[int, list]] = defaultdict(lambda: defaultdict(list))
    for s in points:
        series[(_drafter(s), "chain" if s["topk"] == 1 else "tree")][s["num_draft_tokens"]].append(s["tau"])
    for (drafter, kind), by_budget in sorted(series.items()):
        xs = sorted(by_budget)
        ax.plot(xs, [_mean(by_budget[x]) for x in xs], marker="o" if kind == "chain" else "^",
                linestyle="-" if kind == "chain" else "--", label=f"{drafter} ({kind})")
    ax.set_title(f"{title}: tau against draft budget")
    ax.set_xlabel("draft budget (num_draft_tokens: tree nodes incl. the root)")
    ax.set_ylabel("tau (tokens per verify step, bonus incl.)")
    ax.grid(alpha=0.3)
    if series:
        ax.legend(fontsize=8)
    return _save(fig, out, "tau_vs_budget")


def plot_batch(points: list[dict], out: Path, title: str) -> list[Path]:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series: dict[str, dict[int, list]] = defaultdict(lambda: defaultdict(list))
    for s in points:
        series[s["method"]][s["batch_size"]].append(s["speedup_aggregate"])
    for method, by_b in list(sorted(series.items()))[:MAX_LINES]:
        xs = sorted(by_b)
        ax.plot(xs, [_mean(by_b[x]) for x in xs], marker="o", label=method)
    ax.axhline(1.0, color="gray", linestyle=":", label="plain decoding")
    ax.set_title(f"{title}: speedup against batch size")
    ax.set_xlabel("batch size (rows decoded together)")
    ax.set_ylabel("speedup vs plain (x, decode tok/s ratio)")
    ax.set_xscale("log", base=2)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, out, "speedup_vs_batch")


def plot_sets(points: list[dict], out: Path, title: str) -> list[Path]:
    plt = _plt()
    sets = sorted({s["prompt_set"] for s in points})
    methods = sorted({s["method"] for s in points})[:MAX_LINES]
    fig, ax = plt.subplots(figsize=(max(7, 1.2 * len(sets) * max(1, len(methods)) / 2), 4.5))
    width = 0.8 / max(len(methods), 1)
    for j, m in enumerate(methods):
        taus = [_mean([s["tau"] for s in points if s["method"] == m and s["prompt_set"] == p]) for p in sets]
        ax.bar([i + j * width for i in range(len(sets))], taus, width, label=m)
    ax.set_xticks([i + width * (len(methods) - 1) / 2 for i in range(len(sets))], sets)
    ax.set_title(f"{title}: tau by prompt set")
    ax.set_xlabel("prompt set")
    ax.set_ylabel("tau (tokens per verify step, bonus incl.)")
    ax.grid(alpha=0.3, axis="y")
    if methods:
        ax.legend(fontsize=8)
    return _save(fig, out, "tau_by_prompt_set")


def plot_ceiling(points: list[dict], ceiling: list[dict], out: Path, title: str) -> list[Path]:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for b in sorted({s["batch_size"] for s in ceiling}):
        cs = sorted((s for s in ceiling if s["batch_size"] == b), key=lambda s: s["tau"])
        ax.plot([s["tau"] for s in cs], [s["speedup_aggregate"] for s in cs], color="black", marker="s",
                linestyle="-" if b == 1 else "--", label=f"ceiling: forced acceptance, batch {b}")
    for s in points[: 3 * MAX_LINES]:
        ax.scatter([s["tau"]], [s["speedup_aggregate"]], label=f"{s['method']} | {s['prompt_set']} | b={s['batch_size']}")
    ax.axhline(1.0, color="gray", linestyle=":")
    note = "" if ceiling else " (no [ceiling] in this grid)"
    ax.set_title(f"{title}: measured tau against the synthetic ceiling{note}")
    ax.set_xlabel("tau (tokens per verify step, bonus incl.)")
    ax.set_ylabel("speedup vs plain (x, decode tok/s ratio)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    return _save(fig, out, "ceiling_vs_measured")


def plot_all(summary: list[dict], out: Path, title: str) -> list[Path]:
    """Every plot; the measured points are the grid points (not the baselines or the ceiling)."""
    points = [s for s in summary if s["kind"] == "point"]
    ceiling = [s for s in summary if s["kind"] == "ceiling"]
    return (plot_position(points, out, title) + plot_budget(points, out, title) + plot_batch(points, out, title)
            + plot_sets(points, out, title) + plot_ceiling(points, ceiling, out, title))
