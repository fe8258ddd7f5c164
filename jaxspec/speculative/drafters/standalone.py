"""STANDALONE drafter: a smaller model with the same tokenizer and its own paged cache.

The draft cache shares the target's page table (same page geometry, its own
layer count), so drafting needs no extra page allocation.

Catch-up: at the start of each iteration the tokens committed since the last
one (the accepted drafts plus the bonus, at most max_depth + 1) are fed to
the draft model as one causal block; the logits at the last of them give the
first draft distribution. Draft K/V written past the committed length during
drafting is scratch and gets overwritten by the next catch-up.

Chain mode (topk = 1) feeds one token per step. Tree mode (topk > 1) expands
the top-k frontier by cumulative log-prob (EAGLE-2 / SGLang), re-running the
growing block of fed nodes with a tree mask at each step (simple and exact; a
prefix-aware draft mask would avoid the recompute), then keeps the best
num_draft_tokens - 1 nodes with `organize_draft_tree`. Sampled rows under
rejection verify draft a sampled multi-draft tree instead (`drafters.sampled_tree`):
a fixed rank tree, its levels' children drawn from the draft model's q without
replacement, the same growing block re-run per level.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.cache.paged import KVCache
from jaxspec.models.config import ModelConfig
from jaxspec.models.llama import forward, prepare_params
from jaxspec.speculative.algorithm import AlgorithmInfo, SpecConfigError, register
from jaxspec.speculative.protocol import DrafterBase
from jaxspec.speculative.types import Committed, Proposal
from jaxspec.speculative.drafters.features import choose_draft, expand_frontier
from jaxspec.speculative.drafters.sampled_tree import SampledTrees, TreeDraws, greedy_or_sampled, parse_choices
from jaxspec.speculative.tree import organize_draft_tree, root_step, select_frontier


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DraftState:
    cache: KVCache  # draft geometry, target page table
    draft_len: jax.Array  # [B] int32 tokens whose draft K/V is committed


@dataclasses.dataclass(frozen=True)
class StandaloneDrafter(SampledTrees, DrafterBase):
    cfg: ModelConfig
    num_steps: int
    topk: int
    num_draft_tokens: int
    sample_drafts: bool  # rejection verify: chain drafts are sampled from q, with q returned
    # Catch-up block width; 0 = max_depth + 1. A server that switches between
    # draft lengths (adaptive speculation) sets the widest one, so a step after
    # a deep one still feeds every committed token.
    catch_up_width: int = 0
    coupled: bool = False  # coupled verify: the chain races with the target's noise (sampling.draft_noise)
    tree_sampling: str = "sampled"  # sampled rows' trees: "sampled" (from q) or "topk" (one-hot)
    choices: tuple[tuple[int, ...], ...] = ()  # the sampled tree's rank paths; () = the default shape

    @property
    def draft_cache_cfg(self) -> ModelConfig:
        return self.cfg

    @property
    def max_depth(self) -> int:
        return self.num_draft_tokens - 1 if self.topk == 1 else self.num_steps

    @property
    def scratch_tokens(self) -> int:
        """Draft K/V slots written past hist_len: a chain feeds N - 2 drafts, a
        tree re-runs its block of (num_steps - 1) * topk fed nodes, a sampled
        tree its rank tree's fed nodes."""
        if self.topk == 1:
            return max(self.num_draft_tokens - 2, 0)
        return max((self.num_steps - 1) * self.topk, len(self.rank_tree.fed()) if self.sampled_tree else 0)

    def prepare_params(self, loaded, *, native: bool, unstack) -> dict:
        return prepare_params(loaded, self.cfg, unstack=unstack, native=native)

    def init_state(self, draft_cache: KVCache, batch: int) -> "DraftState":
        return DraftState(cache=draft_cache, draft_len=jnp.zeros((batch,), jnp.int32))

    def prefill(self, params, state: DraftState, chunk: Committed, page_table) -> DraftState:
        # chunk.tokens [B, L] at slots chunk.start..; chunk.count [B] (0 = padding row)
        b, length = chunk.tokens.shape
        positions = chunk.start[:, None] + jnp.arange(length, dtype=jnp.int32)[None, :]
        kv_len = chunk.start + chunk.count
        out = forward(
            params["own"], self.cfg, chunk.tokens, positions, state.cache, page_table,
            q_start=chunk.start, kv_len=kv_len, logits_index=jnp.zeros((b, 1), jnp.int32),
        )
        return DraftState(cache=out.cache, draft_len=kv_len)

    def _catch_up(self, params, state, history, hist_len, page_table, live):
        """Feed committed-but-unseen tokens; return logits at the newest one [B, V]."""
        width = max(self.catch_up_width, self.max_depth + 1)
        cols = state.draft_len[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]
        block = jnp.take_along_axis(history, jnp.minimum(cols, history.shape[1] - 1), axis=1)
        kv_len = jnp.where(live, hist_len, state.draft_len)
        last = jnp.maximum(hist_len - state.draft_len - 1, 0)[:, None]
        out = forward(
            params, self.cfg, block, cols, state.cache, page_table,
            q_start=state.draft_len, kv_len=kv_len, logits_index=last,
        )
        return out.logits[:, 0], DraftState(cache=out.cache, draft_len=kv_len)

    def propose(self, params, state: DraftState, s) -> Proposal:
        """Catch up on the committed tokens, then draft a chain or a tree for loop state `s`."""
        history, hist_len, page_table = s.history, s.hist_len, s.page_table
        params = params["own"]
        logits, state = self._catch_up(params, state, history, hist_len, page_table, ~s.done)
        root = jnp.take_along_axis(history, (hist_len - 1)[:, None], axis=1)[:, 0]
        if self.topk == 1:
            return Proposal(*self._chain(params, state, logits, root, hist_len, page_table, s))
        if not self.sampled_tree:
            tokens, parents, cache = self._tree(params, state, logits, root, hist_len, page_table)
            return Proposal(tokens, parents, None, DraftState(cache=cache, draft_len=state.draft_len))
        tokens, parents, probs, cache = greedy_or_sampled(
            s, lambda: self._tree(params, state, logits, root, hist_len, page_table),
            lambda: self._sampled_tree(params, state, logits, root, s),
            (root.shape[0], self.num_draft_tokens, logits.shape[-1]))
        return Proposal(tokens, parents, probs, DraftState(cache=cache, draft_len=state.draft_len))

    def _chain(self, params, state, logits, root, hist_len, page_table, s):
        n = self.num_draft_tokens
        tokens, qs = [root], []
        cache = state.cache
        for step in range(n - 1):
            if self.sample_drafts:
                # The request's own temperature/top-k/top-p, so greedy requests draft greedily
                # (q one-hot); the step's own key (first emitted index = hist_len) per depth.
                tok, q = choose_draft(logits, s, tokens[1:], None, logits.shape[-1], True, self.coupled)
                if q is not None:
                    qs.append(q)
            else:
                tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            tokens.append(tok)
            if step < n - 2:
                slot = hist_len + step
                out = forward(
                    params, self.cfg, tok[:, None], slot[:, None], cache, page_table,
                    q_start=slot, kv_len=slot + 1,
                )
                logits, cache = out.logits[:, 0], out.cache
        draft_probs = None
        if self.sample_drafts and qs:
            draft_probs = jnp.stack([jnp.zeros_like(qs[0])] + qs, axis=1)  # [B, N, V]; root unused
        return jnp.stack(tokens, axis=1), None, draft_probs, DraftState(cache=cache, draft_len=state.draft_len)

    def _tree(self, params, state, logits, root, hist_len, page_table):
        # 1. Step 0 expands the root.
        k, steps = self.topk, self.num_steps
        b = root.shape[0]
        logp = jax.nn.log_softmax(logits, axis=-1)
        s0, t0 = jax.lax.top_k(logp, k)
        tok0, sc0 = root_step(t0.astype(jnp.int32), s0)
        step_tokens, step_scores = [tok0], [sc0]
        step_frontier = [jnp.zeros((b, k), jnp.int32)]
        fed_tokens, fed_parent, fed_scores = [], [], []  # per fed node (block order)
        cache = state.cache
        # 2. Steps 1..S-1: feed the frontier chosen from the previous step's grid.
        for s in range(1, steps):
            front = select_frontier(step_scores[-1])  # [B, K] flat f*K + c
            step_frontier.append(front)
            prev_tok = step_tokens[-1].reshape(b, k * k)
            prev_sc = step_scores[-1].reshape(b, k * k)
            fed_tokens.append(jnp.take_along_axis(prev_tok, front, axis=1))
            fed_scores.append(jnp.take_along_axis(prev_sc, front, axis=1))
            # Parent of a fed node: the fed node of step s-1 in frontier row front // K (root at s = 1).
            base = (s - 2) * k
            fed_parent.append(jnp.where(s == 1, -1, base + front // k))
            block = jnp.concatenate(fed_tokens, axis=1)  # [B, s*K]
            parents = jnp.concatenate(fed_parent, axis=1)
            mask = _ancestor_mask(parents)  # [B, s*K, s*K]
            depth = mask.sum(-1).astype(jnp.int32)  # 1 for step-1 nodes
            positions = (hist_len - 1)[:, None] + depth
            out = forward(
                params, self.cfg, jnp.maximum(block, 0), positions, cache, page_table,
                q_start=hist_len, kv_len=hist_len + block.shape[1], tree_mask=mask,
                logits_index=jnp.broadcast_to(jnp.arange((s - 1) * k, s * k, dtype=jnp.int32), (b, k)),
            )
            cache = out.cache
            ct, cs = expand_frontier(out.logits, fed_tokens[-1], fed_scores[-1], k, None)  # [B, K, K]
            step_tokens.append(ct)
            step_scores.append(cs)
        tokens, parents, _ = organize_draft_tree(
            root, jnp.stack(step_tokens, 1), jnp.stack(step_scores, 1), jnp.stack(step_frontier, 1),
            self.num_draft_tokens,
        )
        return tokens, parents, cache

    def _sampled_tree(self, params, state, logits, root, s):
        """The rank tree level by level: draw a level's children, then re-run the block of every
        expanded node so far (static ancestor mask) for the logits of the level's expanded nodes."""
        t, b, hist_len = self.rank_tree, root.shape[0], s.hist_len
        draws = TreeDraws.start(t, root)
        fed, level_logits, cache = [], logits[:, None], state.cache
        for depth in range(1, t.depth + 1):
            draws.draw_level(depth, level_logits, s, None, logits.shape[-1])
            new = t.expanded(depth)
            if not new:
                break
            fed += new
            mask = jnp.broadcast_to(jnp.asarray(t.ancestors(fed)), (b, len(fed), len(fed)))
            depths = jnp.asarray([t.depths[n] for n in fed], jnp.int32)
            block = jnp.stack([jnp.maximum(draws.tokens[n], 0) for n in fed], axis=1)
            out = forward(
                params, self.cfg, block, (hist_len - 1)[:, None] + depths[None], cache, s.page_table,
                q_start=hist_len, kv_len=hist_len + len(fed), tree_mask=mask,
                logits_index=jnp.broadcast_to(jnp.arange(len(fed) - len(new), len(fed), dtype=jnp.int32),
                                              (b, len(new))),
            )
            level_logits, cache = out.logits, out.cache
        return (*draws.proposal(), cache)


def truncate_layers(params: dict, cfg: ModelConfig, num_layers: int) -> tuple[dict, ModelConfig]:
    """Self-speculative draft: the first `num_layers` layers plus the final norm and LM head.

    The layer leaves are slices of the target's stacked arrays, so no training is needed.
    """
    if not 1 <= num_layers <= cfg.num_layers:
        raise SpecConfigError(f"draft_layers must be in [1, {cfg.num_layers}], got {num_layers}")
    layers = params["layers"]
    if isinstance(layers, (list, tuple)):  # runtime params, unstacked
        layers = list(layers[:num_layers])
    else:
        layers = jax.tree.map(lambda x: x[:num_layers], layers)
    return {**params, "layers": layers}, dataclasses.replace(cfg, num_layers=num_layers)


def _ancestor_mask(parents: jax.Array) -> jax.Array:
    """[B, T, T] ancestor-or-self among fed nodes; parents [B, T] (-1 = root, outside the block)."""
    b, t = parents.shape
    eye = jnp.eye(t, dtype=bool)[None]
    par = (parents[:, :, None] == jnp.arange(t)[None, None, :]) & (parents[:, :, None] >= 0)
    mask = eye | par
    for _ in range(max(1, (t - 1).bit_length())):
        mask = mask | jnp.einsum("bij,bjk->bik", mask.astype(jnp.int32), mask.astype(jnp.int32)).astype(bool)
    return mask


def load_standalone(spec, model, dtype, *, cache_dir: str | None = None, progress: bool = True):
    """(params, config) of the draft model: spec.draft_model, else the target, cut to spec.draft_layers."""
    from jaxspec.models.loading import load_model

    if spec.draft_model:
        d = load_model(spec.draft_model, dtype=dtype, cache_dir=cache_dir, progress=progress)
        params, dcfg = d.params, d.config
    else:
        params, dcfg = model.params, model.config
    if spec.draft_layers:
        params, dcfg = truncate_layers(params, dcfg, spec.draft_layers)
    return params, dcfg


def _build(*, plan, spec, draft_cfg, catch_up_width: int = 0, **_) -> StandaloneDrafter:
    if not isinstance(draft_cfg, ModelConfig):
        raise SpecConfigError("standalone speculation needs a draft model")
    try:
        return StandaloneDrafter(draft_cfg, plan.num_steps, plan.topk, plan.num_draft_tokens,
                                 sample_drafts=plan.sampled_rule in ("rejection", "coupled"),
                                 catch_up_width=catch_up_width, coupled=plan.sampled_rule == "coupled",
                                 tree_sampling=spec.tree_sampling,
                                 choices=tuple(parse_choices(spec.tree_choices)) if spec.tree_choices else ())
    except ValueError as e:
        raise SpecConfigError(str(e)) from None


register("standalone", AlgorithmInfo(needs_draft_model=True, supports_tree=True,
                                     description="a smaller LM (or the target's first layers) drafts token by token"),
         _build, load=load_standalone, reads=("draft_layers", "tree_choices", "tree_sampling"), default_draft=lambda s: s.draft_layers > 0,
         draft_hint=", or spec.draft_layers > 0 to draft with the target's first layers", builtin=True)
