"""Evaluation beside training: τ of a head through jaxspec's real Engine, the run's log and its plot."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import jax.numpy as jnp
import numpy as np



class HeadEngine:
    """jaxspec's Engine running greedy speculative decoding of fixed prompts with a head of one
    shape. Each call exports the head to a temporary directory, loads it back through the CLI's
    loader (`drafters.load.load_draft`, the published format) and swaps it into the engine, whose
    compiled programs take the draft params as arguments: one compilation serves every eval."""

    def __init__(self, hcfg, target, prompts, *, draft_ids=None, max_new_tokens: int = 32,
                 num_draft_tokens: int = 4, topk: int = 1, num_steps: int = 3):
        self.hcfg, self.target, self.draft_ids = hcfg, target, draft_ids
        self.prompts = [list(map(int, p)) for p in prompts]
        self.max_new_tokens = max_new_tokens
        from jaxspec.speculative.drafters import algorithm_for_head

        self.spec_kw = dict(algorithm=algorithm_for_head(hcfg.kind), num_draft_tokens=num_draft_tokens, topk=topk,
                            num_steps=num_steps)
        self.engine = None

    def _load(self, params):
        from jaxspec.config import SpecSection
        from jaxspec.speculative.drafters.load import load_draft
        from jaxspec.train.export import export_head

        with tempfile.TemporaryDirectory() as d:
            export_head(params, self.hcfg, d, draft_ids=self.draft_ids)
            spec = SpecSection(draft_model=d, **self.spec_kw)
            return spec, load_draft(spec, self.target, jnp.float32, progress=False)

    def generate(self, params):
        from jaxspec.config import EngineSection
        from jaxspec.engine import Engine, Request
        from jaxspec.sampling_params import SamplingParams

        spec, draft = self._load(params)
        if self.engine is None:
            n = self.spec_kw["num_draft_tokens"]
            longest = max(len(p) for p in self.prompts) + self.max_new_tokens + n + 8
            ctx = 1 << max(5, math.ceil(math.log2(longest)))
            b = len(self.prompts)
            ecfg = EngineSection(max_batch_size=b, max_context=ctx, length_buckets=(ctx,), batch_buckets=(b,))
            self.engine = Engine(self.target.params, self.target.config, ecfg, progress=False, spec=spec, draft=draft)
        else:  # same head shape: new draft params, same executables
            self.engine.runner.set_draft_params(draft[0])
        sp = SamplingParams(max_tokens=self.max_new_tokens)
        return self.engine.generate([Request(p, sp) for p in self.prompts])

    def tau(self, params) -> float:
        """Mean τ (committed tokens per verify step) of greedy speculative decoding with `params`."""
        res = self.generate(params)
        return sum(sum(r.accept_lengths) for r in res) / max(sum(len(r.accept_lengths) for r in res), 1)


def plain_generate(target, prompts, max_new_tokens: int = 32):
    """Greedy output of the target alone (the reference speculative output must equal)."""
    from jaxspec.config import EngineSection
    from jaxspec.engine import Engine, Request
    from jaxspec.sampling_params import SamplingParams

    longest = max(len(p) for p in prompts) + max_new_tokens + 8
    ctx = 1 << max(5, math.ceil(math.log2(longest)))
    ecfg = EngineSection(max_batch_size=len(prompts), max_context=ctx, length_buckets=(ctx,),
                         batch_buckets=(len(prompts),))
    engine = Engine(target.params, target.config, ecfg, progress=False)
    sp = SamplingParams(max_tokens=max_new_tokens)
    return engine.generate([Request(list(map(int, p)), sp) for p in prompts])


def read_log(run_dir) -> list[dict]:
    path = Path(run_dir) / "log.jsonl"
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def plot(run_dir, out: str | None = None) -> Path:
    """Loss and top-1 per TTT step (or Medusa head) against step, plus eval values, to a PNG."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("plot needs matplotlib (pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_log(run_dir)
    if not rows:
        raise ValueError(f"{run_dir}/log.jsonl has no lines")
    steps = [r["step"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    ax1.plot(steps, [r["loss"] for r in rows], label="train loss")
    ev = [(r["step"], r["eval"]) for r in rows if "eval" in r]
    if ev and any("heldout_loss" in e for _, e in ev):
        ax1.plot([s for s, e in ev if "heldout_loss" in e], [e["heldout_loss"] for _, e in ev if "heldout_loss" in e],
                 "o-", label="held-out loss")
    ax1.set_xlabel("step")
    ax1.set_ylabel("loss")
    ax1.set_yscale("log")
    ax1.legend()
    acc = np.array([r["acc"] for r in rows], dtype=float).reshape(len(rows), -1)
    for s in range(acc.shape[1]):
        ax2.plot(steps, acc[:, s], label=f"top-1 step {s}")
    taus = [(s, e["tau"]) for s, e in ev if "tau" in e]
    if taus:
        ax3 = ax2.twinx()
        ax3.plot(*zip(*taus), "k^--", label="τ (engine)")
        ax3.set_ylabel("τ")
        ax3.legend(loc="lower right")
    ax2.set_xlabel("step")
    ax2.set_ylabel("top-1")
    ax2.legend(fontsize=7, loc="upper left")
    fig.suptitle(str(run_dir))
    fig.tight_layout()
    path = Path(out) if out else Path(run_dir) / "curves.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
