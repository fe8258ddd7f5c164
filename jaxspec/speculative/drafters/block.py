"""Block drafters: DFLASH and DSPARK draft a whole chain in one forward.

The model is `jaxspec.models.heads.block`. The drafter's paged cache (one
layer per draft layer, sharing the target's page table) holds the CONTEXT K/V
of every committed token: slot p holds the projection of the target's features
at position p. At propose time the root (position r = hist_len - 1) is
committed but not yet run through the target, so slots 0 .. r-1 are cached
and the block [root, MASK, ...] sits at positions r .. r + W - 1. `prefill`
and `observe` are one function: project a chunk's features into the cache, no
forward, no attention (the DFlash property that keeps the drafter cheap).

Drafts are a deterministic function of the context on greedy rows. Sampled
rows (rejection verify) draw each position from its own distribution under
the request's temperature / top-k / top-p and return it as q. The block's
per-position q does not look at the earlier drafts, which is still a valid
proposal for rejection sampling: the verifier's output distribution is the
target's whatever q is, q only sets how much is accepted. (Upstream DFlash is
greedy-only on the draft side.) DSPARK's Markov bias makes q_i depend on the
drawn t_{i-1}, exactly as a chain proposal should.

DSPARK also plans: confidences -> survival -> `planner.plan_budgets` over the
whole batch against the SPS table, and drafts past a row's budget become -1
padding. The loop then verifies at the narrowest width holding every live row
(`variable_draft_width`), inside the same compiled program: ragged rows are
masked, never recompiled.
"""

from __future__ import annotations

import dataclasses
import typing

import jax
import jax.numpy as jnp

from jaxspec.cache.attention import gather_pages
from jaxspec.cache.paged import NULL_PAGE, KVCache, slot_to_page, write_layer_kv
from jaxspec.models.heads.block import (
    block_attend, block_hidden, block_logits, block_tokens, block_width, confidence_logit, context_kv, draft_log_odds, markov_bias,
    output_offset, prepare_block_params, project_context, window_mask,
)
from jaxspec.models.heads.config import HeadConfig
from jaxspec.speculative.drafters.features import chain_proposal, choose_draft
from jaxspec.speculative.algorithm import AlgorithmInfo
from jaxspec.speculative.drafters.load import register_head
from jaxspec.speculative.protocol import DrafterBase
from jaxspec.speculative.types import Committed, FeatureRequest, Proposal


def block_attention(
    q: jax.Array,  # [B, W, H, hd]
    k_pages: jax.Array,  # [P, page_size, kvh, hd] one draft layer, read only
    v_pages: jax.Array,  # [P, page_size, kvh, hd]
    page_table: jax.Array,  # [B, max_pages] int32
    ctx_len: jax.Array,  # [B] int32: context slots < ctx_len are visible
    k_block: jax.Array,  # [B, W, kvh, hd]
    v_block: jax.Array,  # [B, W, kvh, hd]
    ctx_mask: jax.Array | None,  # [B, W, S] extra context visibility (sliding window) or None
    blk_mask: jax.Array | None,  # [B, W, W] block visibility, None = bidirectional
) -> jax.Array:  # [B, W, H, hd]
    """The block over the drafter's cached context (read in place by gathering the row's pages)."""
    b, w = q.shape[:2]
    k, v = gather_pages(k_pages, page_table), gather_pages(v_pages, page_table)
    s = k.shape[1]
    vis = jnp.broadcast_to((jnp.arange(s, dtype=jnp.int32)[None, :] < ctx_len[:, None])[:, None], (b, w, s))
    if ctx_mask is not None:
        vis = vis & ctx_mask
    one = lambda x: None if x is None else x[:, None]  # noqa: E731  (one block per row)
    return block_attend(q[:, None], k, v, k_block[:, None], v_block[:, None], vis[:, None], one(blk_mask))[:, 0]


def resolve_sps_table(name: str) -> tuple[tuple[int, ...], tuple[float, ...]] | None:
    """spec.sps_table -> (tokens, steps/s) for the planner, or None (verify every draft).

    "default": configs/sps/<platform>.json shipped for this platform if any; "flat" or
    "": None; anything else is a file, and a missing or malformed one is an error.
    """
    from jaxspec.speculative.drafters.planner import SPSTable

    if name in ("", "flat"):
        return None
    if name == "default":
        from jaxspec.paths import default_sps_table

        path = default_sps_table(jax.default_backend())
        if path is None:
            return None
        name = str(path)
    try:
        table = SPSTable.load(name)
    except (OSError, ValueError) as e:
        raise ValueError(f"spec.sps_table {name!r}: {e}") from None
    return tuple(int(t) for t in table.tokens), tuple(float(x) for x in table.steps_per_s)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class BlockState:
    cache: KVCache  # [num_draft_layers, ...] context K/V


@dataclasses.dataclass(frozen=True)
class BlockDrafter(DrafterBase):
    head: HeadConfig
    num_draft_tokens: int  # N: the root plus N - 1 drafts
    sample_drafts: bool  # rejection verify on sampled rows: sample and return q
    # DSPARK's planner table (tokens, steps per second) as tuples, or None: verify every draft.
    sps_table: tuple[tuple[int, ...], tuple[float, ...]] | None = None
    coupled: bool = False  # coupled verify: drafts race with the target's noise (sampling.draft_noise)

    shares_target = ("embed", "head")
    # Sampled rows plan depth by depth (exact); False restores the joint plan that biased them,
    # kept only as the distribution tests' positive control.
    sequential_sampled_plan: typing.ClassVar[bool] = True

    def __post_init__(self):
        if self.num_draft_tokens < 1:  # 1: the k = 0 plan (plain decoding) of the adaptive policy
            raise ValueError("a block drafter needs num_draft_tokens >= 1")
        if self.head.kind == "dspark" and self.head.markov_rank <= 0:
            raise ValueError("a dspark head needs a Markov head (markov_rank > 0)")
        most = self.head.block_size + output_offset(self.head)  # dflash: block_size; dspark: gamma + 1
        if self.num_draft_tokens > most:
            raise ValueError(
                f"spec.num_draft_tokens={self.num_draft_tokens} is past what this {self.head.kind} drafter was "
                f"trained for: its block of {self.head.block_size} drafts at most {most - 1} tokens, so "
                f"num_draft_tokens <= {most}")

    @property
    def draft_cache_cfg(self):
        return self.head.layer

    @property
    def target_features(self) -> FeatureRequest:
        return FeatureRequest(layers=self.head.feature_layers)

    @property
    def provides_draft_probs(self) -> bool:
        return self.sample_drafts and not self.coupled

    @property
    def width(self) -> int:
        return block_width(self.head, self.num_draft_tokens - 1)

    def prepare_params(self, loaded, *, native: bool, unstack) -> dict:
        return prepare_block_params(loaded, self.head, native=native)

    def init_state(self, draft_cache, batch: int) -> BlockState:
        return BlockState(cache=draft_cache)

    # ---- committed tokens: prefill chunks and the post-verify update ----------------------------

    def _extend(self, params, state: BlockState, c: Committed, page_table) -> BlockState:
        w = c.tokens.shape[1]
        j = jnp.arange(w, dtype=jnp.int32)[None, :]
        slots = c.start[:, None] + j
        ctx = project_context(params["own"], self.head, c.features.astype(jnp.float32))
        k, v = context_kv(params["own"], self.head, ctx, slots)
        pages, offsets = slot_to_page(page_table, slots, state.cache.page_size)
        pages = jnp.where(j < c.count[:, None], pages, NULL_PAGE)
        ck, cv = write_layer_kv(state.cache.k, state.cache.v, slice(None), pages, offsets, k, v)
        return BlockState(cache=KVCache(k=ck, v=cv))

    def prefill(self, params, state, chunk: Committed, page_table):
        return self._extend(params, state, chunk, page_table)

    def observe(self, params, state, committed: Committed, page_table):
        return self._extend(params, state, committed, page_table)

    # ---- drafting ----------------------------------------------------------------------------

    def hidden(self, params, state: BlockState, root, r, page_table):
        """[B, W, H] block states for roots [B] at positions r [B] (context: slots < r)."""
        hc, w = self.head, self.width
        tokens = block_tokens(root, hc, w)
        pos = r[:, None] + jnp.arange(w, dtype=jnp.int32)[None, :]
        s = page_table.shape[1] * state.cache.page_size
        k_pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32)[None, :], (root.shape[0], s))

        def attend(layer, q, k, v):
            return block_attention(q, state.cache.k[layer], state.cache.v[layer], page_table, r, k, v,
                                   window_mask(hc, layer, pos, k_pos), window_mask(hc, layer, pos, pos))

        return block_hidden(params["own"], hc, params["target"], tokens, pos, attend)

    def propose(self, params, state: BlockState, s) -> Proposal:
        hc = self.head
        root = jnp.take_along_axis(s.history, jnp.maximum(s.hist_len - 1, 0)[:, None], axis=1)[:, 0]
        if self.num_draft_tokens == 1:  # k = 0: no block forward; `observe` still keeps the context
            return chain_proposal(root, [], [], self.sample_drafts, state)
        r = jnp.maximum(s.hist_len - 1, 1)
        off = output_offset(hc)
        h = self.hidden(params, state, root, r, s.page_table)
        h = h[:, 1 - off:1 - off + self.num_draft_tokens - 1]  # [B, N-1, H]: the outputs that draft
        logits = block_logits(params["target"], h)
        drafts, qs, odds, prev = [], [], [], root
        for d in range(1, self.num_draft_tokens):
            base = logits[:, d - 1]
            if hc.markov_rank:
                base = base + markov_bias(params["own"], prev)
            tok, q = choose_draft(base, s, drafts, None, hc.layer.vocab_size, self.sample_drafts, self.coupled)
            drafts.append(tok)
            qs.append(q)
            odds.append(draft_log_odds(base))
            prev = tok
        prop = chain_proposal(root, drafts, qs, self.sample_drafts, state)
        if hc.confidence and self.sps_table is not None:
            prop = prop._replace(tokens=self._plan(params, h, jnp.stack(odds, 1), prop.tokens, s.done,
                                                   # Under the coupled rule any budget is exact.
                                                   (s.sampling.temperature > 0)
                                                   if self.sample_drafts and not self.coupled
                                                   else jnp.zeros_like(s.done)))
        return prop

    def _plan(self, params, h, odds, tokens, done, sampled):
        """Tokens [B, N] with the drafts past each row's budget (`plan_row_budgets`) set to -1."""
        from jaxspec.speculative.drafters.planner import plan_row_budgets, survival

        conf = jax.nn.sigmoid(confidence_logit(params["own"], h, odds))  # [B, N-1]
        t_tok = jnp.asarray(self.sps_table[0], jnp.int32)
        t_sps = jnp.asarray(self.sps_table[1], jnp.float32)
        budget = plan_row_budgets(survival(conf), ~done, sampled, t_tok, t_sps,
                                  sequential=self.sequential_sampled_plan)
        d = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
        return jnp.where((d == 0) | (d <= budget[:, None]), tokens, -1)


def _make(plan, spec, head, sample) -> BlockDrafter:
    if spec.sps_table not in ("", "default") and not head.confidence:
        raise ValueError(f"spec.sps_table (--sps-table) drives the planner of a head with a confidence head; this "
                         f"{head.kind} head has none, so it verifies every draft and would ignore the table")
    return BlockDrafter(head, plan.num_draft_tokens, sample, resolve_sps_table(spec.sps_table) if head.confidence
                        else None)


# Block drafters emit a whole chain per forward; their depth is the block, not a number of steps.
# Sampled rows draw each position from the block's own distribution, which is their q. DSPARK's
# planner cuts rows short (-1 padding), so its verify runs at the narrowest width holding the batch.
register_head("dflash", AlgorithmInfo(needs_draft_model=True, drafts_in_steps=False, description=(
    "DFlash block drafter: the whole chain in one forward over [root, MASK...]")), _make,
    head_kinds=("dflash",), shipped_head="dflash-smollm2-135m")
register_head("dspark", AlgorithmInfo(needs_draft_model=True, drafts_in_steps=False, variable_draft_width=True,
                                      description="DSpark: a DFlash block with a Markov head and a confidence "
                                      "planner (ragged verify)"), _make,
              head_kinds=("dspark",), shipped_head="dspark-smollm2-135m", reads=("sps_table",))
