"""Verify-budget planner for block drafters (SGLang's DSPARK rule).

A block drafter proposes G drafts per row in one forward and a confidence
c_i in (0, 1) per draft; the running product s_i = c_1 * ... * c_i
(`survival`) is the probability that draft i and every draft before it are
accepted. At large batch the target's verify forward is not free, so the
planner picks how many drafts each row verifies:

    k* = argmax_{k in [0, N*G]} (N + sum_{j<=k} s_(j)) * SPS(N + k)

over the live rows' survival probabilities sorted in descending order
s_(1) >= s_(2) >= ..., N = number of live rows (each verifies its root /
anchor token), SPS(t) = measured target verify steps per second at t tokens
in the batch (`SPSTable`, `sps_at`). The k* positions of largest survival are
verified: row b verifies d_b drafts, a prefix of its row (survival does not
grow along a row). Equal objectives prefer the larger k, so a flat table
verifies everything; equal survival values rank in (row, position) order.

Everything here is pure jnp with static shapes (jit-friendly); this module
imports only jax, numpy, jaxtyping and the standard library.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

__all__ = [
    "SPSTable", "SPSTableError", "survival", "sps_at", "plan_verify", "plan_budgets", "calibrate",
    "fit_temperature",
]


# ---- survival ---------------------------------------------------------------------------------------

def survival(conf: Float[Array, "B G"]) -> Float[Array, "B G"]:
    """s[b, i] = conf[b, 0] * ... * conf[b, i]: the probability draft i and all before it are accepted."""
    return jnp.cumprod(jnp.asarray(conf, jnp.float32), axis=-1)


# ---- the SPS table ------------------------------------------------------------------------------------

class SPSTableError(ValueError):
    """An SPS table (or its JSON file) that cannot be used, with the reason."""


@dataclasses.dataclass(frozen=True)
class SPSTable:
    """Target verify steps per second against tokens in the batch (B rows x w tokens = B*w).

    `tokens` strictly ascending positive ints, `steps_per_s` positive finite
    rates, one per token count. Between entries the rate is interpolated
    linearly, outside them it is clamped (`sps_at`). The rest is metadata:
    where and how the table was measured (`python -m jaxspec.bench sps`).
    """

    tokens: tuple[int, ...]
    steps_per_s: tuple[float, ...]
    device: str = ""
    date: str = ""
    model: str = ""
    source: str = ""
    context: int = 0  # tokens in each row's KV cache during the measurement (0: unknown)
    notes: str = ""  # e.g. the machine's load while it was measured
    # Every raw measurement: (batch, width, median steps/s), for reference only.
    measurements: tuple[tuple[int, int, float], ...] = ()

    def __post_init__(self):
        try:
            tokens = tuple(int(t) for t in self.tokens)
            rates = tuple(float(r) for r in self.steps_per_s)
        except (TypeError, ValueError) as e:
            raise SPSTableError(f"SPS table: tokens must be ints and steps_per_s numbers ({e})") from None
        if any(t != float(o) for t, o in zip(tokens, self.tokens)):
            raise SPSTableError(f"SPS table: tokens must be whole numbers, got {list(self.tokens)}")
        if len(tokens) != len(rates):
            raise SPSTableError(f"SPS table: length mismatch, {len(tokens)} token counts but "
                                f"{len(rates)} steps_per_s values")
        if not tokens:
            raise SPSTableError("SPS table: empty (needs at least one token count)")
        if tokens[0] < 1:
            raise SPSTableError(f"SPS table: token counts must be >= 1, got {tokens[0]}")
        bad = [i for i in range(1, len(tokens)) if tokens[i] <= tokens[i - 1]]
        if bad:
            i = bad[0]
            raise SPSTableError(f"SPS table: tokens must be strictly ascending, got {tokens[i - 1]} then "
                                f"{tokens[i]} at index {i}")
        bad = [(t, r) for t, r in zip(tokens, rates) if not (math.isfinite(r) and r > 0)]
        if bad:
            raise SPSTableError(f"SPS table: steps_per_s must be positive and finite, got {bad[0][1]} at "
                                f"{bad[0][0]} tokens")
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "steps_per_s", rates)
        object.__setattr__(self, "context", int(self.context))
        object.__setattr__(self, "measurements",
                           tuple((int(b), int(w), float(r)) for b, w, r in self.measurements))

    @classmethod
    def flat(cls, max_tokens: int, steps_per_s: float = 1.0) -> SPSTable:
        """A constant rate up to `max_tokens`: verifying costs nothing, so the planner verifies everything."""
        if int(max_tokens) < 1:
            raise SPSTableError(f"SPS table: flat(max_tokens) needs max_tokens >= 1, got {max_tokens}")
        tokens = (1,) if int(max_tokens) == 1 else (1, int(max_tokens))
        return cls(tokens, (float(steps_per_s),) * len(tokens), source="flat")

    def as_arrays(self) -> tuple[Int[Array, " K"], Float[Array, " K"]]:
        """(tokens [K] int32, steps_per_s [K] float32), the form `plan_budgets` takes inside jit."""
        return jnp.asarray(self.tokens, jnp.int32), jnp.asarray(self.steps_per_s, jnp.float32)

    def to_dict(self) -> dict:
        return {"tokens": list(self.tokens), "steps_per_s": list(self.steps_per_s), "device": self.device,
                "date": self.date, "model": self.model, "source": self.source, "context": self.context,
                "notes": self.notes,
                "measurements": [{"batch": b, "width": w, "steps_per_s": r} for b, w, r in self.measurements]}

    @classmethod
    def from_dict(cls, d: dict, where: str = "SPS table") -> SPSTable:
        if not isinstance(d, dict):
            raise SPSTableError(f"{where}: expected a JSON object, got {type(d).__name__}")
        missing = [k for k in ("tokens", "steps_per_s") if k not in d]
        if missing:
            raise SPSTableError(f"{where}: missing key(s) {', '.join(missing)}")
        if not isinstance(d["tokens"], list) or not isinstance(d["steps_per_s"], list):
            raise SPSTableError(f"{where}: tokens and steps_per_s must be lists")
        meas = d.get("measurements", [])
        try:
            meas = tuple((m["batch"], m["width"], m["steps_per_s"]) for m in meas)
        except (TypeError, KeyError) as e:
            raise SPSTableError(f"{where}: measurements must be objects with batch, width, steps_per_s ({e})") \
                from None
        try:
            return cls(tuple(d["tokens"]), tuple(d["steps_per_s"]), device=str(d.get("device", "")),
                       date=str(d.get("date", "")), model=str(d.get("model", "")),
                       source=str(d.get("source", "")), context=int(d.get("context", 0)),
                       notes=str(d.get("notes", "")), measurements=meas)
        except SPSTableError as e:
            raise SPSTableError(f"{where}: {str(e).removeprefix('SPS table: ')}") from None

    @classmethod
    def load(cls, path) -> SPSTable:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"SPS table {path}: no such file (measure one with "
                                    f"`python -m jaxspec.bench sps --out {path}`)")
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise SPSTableError(f"SPS table {path}: not valid JSON ({e})") from None
        return cls.from_dict(d, where=f"SPS table {path}")

    def save(self, path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return path


def sps_at(tokens_query: Int[Array, "..."], table_tokens: Int[Array, " K"],
           table_sps: Float[Array, " K"]) -> Float[Array, "..."]:
    """SPS(t): piecewise-linear in t between the table's entries, clamped at its ends (float32)."""
    x = jnp.asarray(tokens_query, jnp.float32)
    xp = jnp.asarray(table_tokens, jnp.float32)
    fp = jnp.asarray(table_sps, jnp.float32)
    return jnp.interp(x, xp, fp).astype(jnp.float32)


# ---- the planner ----------------------------------------------------------------------------------------

def plan_verify(surv: Float[Array, "B G"], live: Bool[Array, " B"], table_tokens: Int[Array, " K"],
                table_sps: Float[Array, " K"]) -> tuple[Int[Array, " B"], Int[Array, ""], Float[Array, " M"]]:
    """(drafts per row [B] int32 in [0, G], k* [] int32, objective [B*G + 1] float32; -inf where k > N*G).

    `surv` is clipped to [0, 1] (NaN counts as 0) and made non-increasing along
    each row by a running minimum (a no-op for products of confidences in
    [0, 1]), so each row's chosen positions are a prefix. Non-live rows count
    neither in N nor in the sort, and get 0.
    """
    surv = jnp.asarray(surv, jnp.float32)
    live = jnp.asarray(live, bool)
    b, g = surv.shape
    m = b * g
    surv = jnp.clip(jnp.nan_to_num(surv, nan=0.0), 0.0, 1.0)
    surv = jax.lax.cummin(surv, axis=1)
    n_live = jnp.sum(live.astype(jnp.int32))
    # Descending order of live entries, dead rows after every live one; a stable sort keeps
    # equal keys in (row, position) order, so ties never break a row's prefix.
    key = jnp.where(live[:, None], -surv, jnp.inf).reshape(m)
    order = jnp.argsort(key, stable=True)
    sorted_s = jnp.where(jnp.isfinite(key[order]), -key[order], 0.0)
    # cumsum of non-negatives, made monotone against any rounding of a parallel scan.
    cum = jax.lax.cummax(jnp.cumsum(sorted_s), axis=0)
    gain = jnp.concatenate([jnp.zeros((1,), jnp.float32), cum])  # [m + 1]: sum of the top k survivals
    k = jnp.arange(m + 1, dtype=jnp.int32)
    nf = n_live.astype(jnp.float32)
    obj = (nf + gain) * sps_at(n_live + k, table_tokens, table_sps)
    obj = jnp.where(k <= n_live * g, obj, -jnp.inf)
    # argmax takes the first maximum: over the reversed objective that is the largest k.
    k_star = (m - jnp.argmax(obj[::-1])).astype(jnp.int32)
    rank = jnp.zeros((m,), jnp.int32).at[order].set(jnp.arange(m, dtype=jnp.int32))
    chosen = (rank < k_star).reshape(b, g) & live[:, None]
    budgets = jnp.sum(chosen.astype(jnp.int32), axis=1)
    return budgets, k_star, obj


def plan_budgets(surv: Float[Array, "B G"], live: Bool[Array, " B"], table_tokens: Int[Array, " K"],
                 table_sps: Float[Array, " K"]) -> Int[Array, " B"]:
    """Drafts each row verifies, [B] int32 in [0, G] (0 for rows not live); see `plan_verify`."""
    return plan_verify(surv, live, table_tokens, table_sps)[0]


def plan_row_budgets(surv: Float[Array, "B G"], live: Bool[Array, " B"], sampled: Bool[Array, " B"],
                     table_tokens: Int[Array, " K"], table_sps: Float[Array, " K"], *,
                     sequential: bool = True) -> Int[Array, " B"]:
    """Budgets [B] that keep sampled rows exact.

    Greedy rows (deterministic drafts: any budget rule is exact) take the batch plan over all
    their survivals. A sampled row may not: its c_{d+1} reads the Markov bias of the sampled x_d,
    so a plan over all survivals decides whether x_d is verified from x_d itself, and given that
    it is verified x_d is no longer distributed as q_d: rejection would not reproduce p
    (docs/semantics.md). A sampled row keeps draft d only if the plan over the first d survivals
    of every row (which read x_1..x_{d-1} only, fixed before x_d is drawn) gives it >= d, and it
    kept every draft before d. `sequential=False` is the old joint rule (the tests' control).
    """
    joint = plan_budgets(surv, live, table_tokens, table_sps)
    if not sequential:
        return joint
    keep = jnp.ones(surv.shape[:1], bool)
    prefix = jnp.zeros_like(joint)
    for d in range(1, surv.shape[1] + 1):
        keep = keep & (plan_budgets(surv[:, :d], live, table_tokens, table_sps) >= d)
        prefix = prefix + keep.astype(prefix.dtype)
    return jnp.where(sampled, prefix, joint)


# ---- confidence calibration (per-position temperature scaling) ------------------------------------------

def calibrate(conf_logits: Float[Array, "B G"], temperature: Float[Array, " G"]) -> Float[Array, "B G"]:
    """c[b, i] = sigmoid(logit[b, i] / T_i): the drafter's confidence logits, temperature-scaled per position."""
    t = jnp.asarray(temperature, jnp.float32)
    return jax.nn.sigmoid(jnp.asarray(conf_logits, jnp.float32) / t)


def fit_temperature(logits: Float[Array, "M G"], correct: Bool[Array, "M G"], mask: Bool[Array, "M G"] | None = None,
                    grid: Float[Array, " T"] | None = None) -> Float[Array, " G"]:
    """Per-position temperature minimising the binary cross-entropy of sigmoid(logit / T) against
    `correct` on held-out pairs, by a grid search (default 241 points log-spaced over [0.05, 20]).

    `mask` leaves out pairs that were never observed (e.g. positions after a
    rejection); a position with no observed pair gets T = 1.
    """
    logits = jnp.asarray(logits, jnp.float32)
    y = jnp.asarray(correct, jnp.float32)
    w = jnp.ones_like(y) if mask is None else jnp.asarray(mask, jnp.float32)
    grid = jnp.logspace(jnp.log10(0.05), jnp.log10(20.0), 241) if grid is None else jnp.asarray(grid, jnp.float32)
    z = logits[None] / grid[:, None, None]  # [T, M, G]
    # BCE with logits, stable: log(1 + e^z) - y z.
    bce = jnp.sum(w[None] * (jax.nn.softplus(z) - y[None] * z), axis=1)  # [T, G]
    best = grid[jnp.argmin(bce, axis=0)]
    return jnp.where(jnp.sum(w, axis=0) > 0, best, 1.0).astype(jnp.float32)
