"""N-gram (prompt-lookup) drafting: the on-device lookup, the corpus, and the NGRAM drafter.

The drafter (`NgramDrafter`, at the end) is the lookup's drafter-protocol face: stateless, it
reads the loop's history (with the corpus prepended) directly.

The draft tree follows the convention of `jaxspec.speculative.tree` (N nodes, node 0 =
root = last committed token, parents[i] < i, token < 0 = padding with parent 0,
sibling order = index order, higher priority first).

ON-DEVICE PROPOSAL (`ngram_propose`). Peers copy the history to the host every
step and search it there; here the search is a handful of shifted equality
passes over the history buffer [B, C] that stays on device, so the drafter
adds no host round trip and fuses into the engine step.

THE MATCHING RULE. Per sequence, h = history[b, :L] with L = hist_len[b]
(entries at or past L are never read as tokens), root = h[L-1], D = N - 1.

  * A continuation start q (1 <= q <= L-1) matches with length
    ml(q) = the largest n <= max_match with h[q-n : q] == h[L-n : L]
    (so the occurrence starts at p = q - n >= 0, lies strictly before the
    suffix and has at least the following token h[q]). Matching n implies
    matching every shorter n at the same q, so "n from max_match down to
    min_match" is the same as ranking by ml(q). q is a candidate iff
    ml(q) >= min_match.
  * Its continuation is h[q : q + len(q)], of length
    len(q) = min(L - q, D, cap(ml(q))) >= 1 (it may overlap the suffix; it
    never reads past L). cap(n) = draft_tokens_by_match[n - 1] where that
    entry exists, D otherwise.
  * Branches are picked greedily, up to topk of them. At each pick, a
    candidate is eligible only if its continuation is not a prefix of (or equal
    to) an already picked branch, i.e. it adds at least one new trie node.
    The eligible candidate with the largest key wins:
        (first token differs from every picked branch's first token,
         ml(q), len(q), q)
    i.e. distinct next tokens first, then the longest n-gram (falling back to
    shorter n only for new branches), then the longest continuation (clipped
    to D), then the most recent occurrence. For topk == 1 this is: longest
    matching n; among its occurrences the most recent one whose continuation
    covers the whole chain, or failing that the one with the longest
    continuation.
  * The picked branches are merged into a trie (shared prefixes become one
    node, credited to the first branch that reaches it) and nodes are laid out
    depth by depth, within a depth by that branch's pick order, truncated to
    the N - 1 draft slots. That order is ancestor-closed, so parents precede
    children, and padding (-1, parent 0) follows the real nodes. With topk == 1
    the result is a chain: parents[i] = i - 1.

Note the longest n wins even when its continuation is short: for h = 7 7 7 7
the 3-gram match at q = 3 proposes one token, not the 1-gram's three.

WHY A CAP PER MATCH LENGTH. A verify forward costs the same for up to 4
nodes as for 1 on CPU (the weights are read once either way) and more from
there on (1.10x at 8, 1.62x at 16), and the loop verifies at the narrowest
width holding the draft (`speculative.loop.verify_widths`). A 1-gram match is weak
evidence: its drafts are mostly rejected. Capping it at 3 tokens keeps such
steps at the free width while a longer match still drafts the whole chain,
so min_match = 1 adds the accepted drafts of 1-gram matches without paying
for full-width verifies of the rejected ones.

THE CORPUS (`corpus_token_array`). An external JSONL corpus (`--ngram-corpus FILE`) becomes
one flat int32 array on device, documents joined by CORPUS_SEPARATOR, which the loop prepends
to every sequence's history: matches can come from the corpus with no host round trip, and
nothing leaves the device.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import numbers
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

from jaxspec.speculative.algorithm import AlgorithmInfo, register
from jaxspec.speculative.protocol import DrafterBase
from jaxspec.speculative.types import Proposal

if TYPE_CHECKING:
    from jaxspec.speculative.loop import SpecPlan, SpecState

_INT32_MAX = 2**31 - 1


def check_ngram_config(num_draft_tokens: int, topk: int, min_match: int,
                       max_match: int, draft_tokens_by_match: tuple[int, ...] = ()) -> None:
    """Raise ValueError for an n-gram config the proposer cannot run."""
    if num_draft_tokens < 1 or topk < 1:
        raise ValueError(f"ngram: need num_draft_tokens >= 1 and topk >= 1, got "
                         f"num_draft_tokens={num_draft_tokens}, topk={topk}")
    if not 1 <= min_match <= max_match:
        raise ValueError(f"ngram: need 1 <= min_match <= max_match, got "
                         f"min_match={min_match}, max_match={max_match}")
    if any(t < 1 for t in draft_tokens_by_match) or len(draft_tokens_by_match) > max_match:
        raise ValueError(f"ngram: draft_tokens_by_match needs at most max_match={max_match} entries, "
                         f"each >= 1, got {tuple(draft_tokens_by_match)}")


# --------------------------------------------------------------------------
# On-device proposal
# --------------------------------------------------------------------------


def _shift_right(x: Int[Array, "B C"], k: int) -> Int[Array, "B C"]:
    """out[:, q] = x[:, q - k]; the first k columns are filler (callers mask them)."""
    return jnp.pad(x, ((0, 0), (k, 0)))[:, : x.shape[1]]


def _shift_left(x: Int[Array, "B C"], d: int) -> Int[Array, "B C"]:
    """out[:, q] = x[:, q + d]; the last d columns are filler (callers mask them)."""
    return jnp.pad(x, ((0, 0), (0, d)))[:, d:]


def match_lengths(
    history: Int[Array, "B C"],
    hist_len: Int[Array, "B"],  # clipped to [1, C]
    max_match: int,
) -> Int[Array, "B C"]:
    """ml[b, q] = largest n <= max_match with h[q-n:q] == h[L-n:L], for
    1 <= q < L; 0 elsewhere (see the module docstring)."""
    _, c = history.shape
    q = jnp.arange(c, dtype=jnp.int32)[None, :]
    # A run of matches from k = 1 upward: position q keeps counting while the
    # token k back from q equals the token k back from the end.
    run = (q >= 1) & (q < hist_len[:, None])
    ml = jnp.zeros(history.shape, jnp.int32)
    for k in range(1, max_match + 1):
        # L - k < 0 only when every q < L is also < k, so clamping is safe.
        suffix_tok = jnp.take_along_axis(history, jnp.maximum(hist_len - k, 0)[:, None], axis=1)
        run = run & (q >= k) & (_shift_right(history, k) == suffix_tok)
        ml = ml + run.astype(jnp.int32)
    return ml


def _gather_rows(
    history: Int[Array, "B C"],
    idx: Int[Array, "B K D"],  # any in-range column indices
) -> Int[Array, "B K D"]:
    b, k, d = idx.shape
    return jnp.take_along_axis(history, idx.reshape(b, k * d), axis=1).reshape(b, k, d)


def _pick_branches(
    history: Int[Array, "B C"],
    ml: Int[Array, "B C"],
    cont_len: Int[Array, "B C"],  # min(L - q, D), 0 outside 1 <= q < L
    *,
    topk: int,
    min_match: int,
    max_match: int,
    depth: int,
) -> tuple[jax.Array, jax.Array]:
    """Greedy branch choice of the module docstring.

    Returns (starts [B, K] int32, lengths [B, K] int32); length 0 = no branch.
    """
    b, c = history.shape
    qpos = jnp.arange(c, dtype=jnp.int32)[None, :]
    dpos = jnp.arange(depth, dtype=jnp.int32)
    # One int32 key per candidate encodes (new_first, ml, len, q)
    # lexicographically, so each pick is a single argmax over C.
    stride = (max_match + 1) * (depth + 1) * c
    if 3 * stride > _INT32_MAX:
        raise ValueError(f"ngram: history length {c} x max_match {max_match} x "
                         f"num_draft_tokens {depth + 1} overflows the int32 rank key")
    base = (ml * (depth + 1) + cont_len) * c + qpos
    eligible = ml >= min_match
    first_new = jnp.ones((b, c), bool)
    # The novelty test compares every candidate's continuation with a picked
    # branch: shifted views of h, one per depth (chains never need them).
    # A running AND over views fuses into one pass; a stacked [B, C, D]
    # window array would be written and re-read once per pick.
    views = [_shift_left(history, d) for d in range(depth)] if topk > 1 else []
    starts, lengths = [], []
    for s in range(topk):
        key = jnp.where(eligible, jnp.where(first_new, 2, 1) * stride + base, -1)
        best = jnp.argmax(key, axis=1).astype(jnp.int32)
        ok = jnp.max(key, axis=1) >= 0
        start = jnp.where(ok, best, 0)
        length = jnp.where(ok, jnp.take_along_axis(cont_len, start[:, None], axis=1)[:, 0], 0)
        starts.append(start)
        lengths.append(length)
        if s + 1 == topk:
            break
        br = _gather_rows(history, jnp.minimum(start[:, None, None] + dpos, c - 1))[:, 0]
        # A candidate whose (clipped) continuation is a prefix of this branch
        # would add no trie node; the picked one is a prefix of itself.
        dup = (cont_len <= length[:, None]) & ok[:, None]
        for d in range(depth):
            dup = dup & ((views[d] == br[:, d : d + 1]) | (cont_len <= d))
        eligible = eligible & ~dup
        first_new = first_new & ~((history == br[:, :1]) & ok[:, None])
    return jnp.stack(starts, axis=1), jnp.stack(lengths, axis=1)


def _branches_to_tree(
    root: Int[Array, "B"],
    btok: Int[Array, "B K D"],
    blen: Int[Array, "B K"],
    num_draft_tokens: int,
) -> tuple[jax.Array, jax.Array]:
    """Merge K branches into a trie laid out depth-major, branch order within
    a depth; returns (tokens [B, N], parents [B, N]) in the tree convention."""
    b, k, d = btok.shape
    n = num_draft_tokens
    kid = jnp.arange(k, dtype=jnp.int32)
    dpos = jnp.arange(d, dtype=jnp.int32)

    # 1. Shared prefixes: same[b, i, j, t] iff branches i and j agree on
    #    depths 0..t; the node (i, t) belongs to the first such real branch.
    real = dpos[None, None, :] < blen[:, :, None]  # [B, K, D]
    eq = btok[:, :, None, :] == btok[:, None, :, :]  # [B, K, K, D]
    same = jnp.cumprod(eq.astype(jnp.int32), axis=-1).astype(bool) & real[:, None, :, :]
    owner = jnp.min(jnp.where(same, kid[None, None, :, None], k), axis=2)  # [B, K, D]
    unique = real & (owner == kid[None, :, None])

    # 2. Output slots: a cumulative count in depth-major order; that order is
    #    ancestor-closed, so truncating at N keeps every kept node's parent.
    uniq_dm = jnp.swapaxes(unique, 1, 2).reshape(b, d * k)
    slot_dm = jnp.where(uniq_dm, jnp.cumsum(uniq_dm, axis=1, dtype=jnp.int32), n)
    slot = jnp.swapaxes(slot_dm.reshape(b, d, k), 1, 2)  # [B, K, D]; n = dropped

    # 3. Parent slot = slot of the owner of the same branch one level up.
    node_slot = jnp.take_along_axis(slot, jnp.minimum(owner, k - 1), axis=1)  # [B, K, D]
    parent = jnp.concatenate([jnp.zeros((b, k, 1), jnp.int32), node_slot[:, :, :-1]], axis=2)

    # 4. Scatter; non-unique and over-budget nodes land on slot n and drop.
    bidx = jnp.arange(b)[:, None]
    flat_slot = slot.reshape(b, k * d)
    tokens = jnp.full((b, n), -1, jnp.int32).at[:, 0].set(root)
    tokens = tokens.at[bidx, flat_slot].set(btok.reshape(b, k * d), mode="drop")
    parents = jnp.zeros((b, n), jnp.int32).at[:, 0].set(-1)
    parents = parents.at[bidx, flat_slot].set(parent.reshape(b, k * d), mode="drop")
    return tokens, parents


@functools.partial(jax.jit, static_argnames=("num_draft_tokens", "topk", "min_match",
                                             "max_match", "draft_tokens_by_match"))
def ngram_propose(
    history: Int[Array, "B C"],  # prompt + committed output; garbage at >= hist_len
    hist_len: Int[Array, "B"],  # >= 1; history[b, hist_len[b] - 1] is the root
    *,
    num_draft_tokens: int,
    topk: int,
    min_match: int,
    max_match: int,
    draft_tokens_by_match: tuple[int, ...] = (),
) -> tuple[Int[Array, "B N"], Int[Array, "B N"]]:
    """Draft tree from the sequence's own history (rule: module docstring).

    draft_tokens_by_match[n - 1] caps the continuation of a length-n match;
    lengths past the tuple are capped only by the N - 1 draft slots.

    Returns (tokens [B, N] int32, parents [B, N] int32), N = num_draft_tokens,
    in the tree convention; a chain (parents i - 1) when topk == 1. hist_len is
    clipped to [1, C].
    """
    check_ngram_config(num_draft_tokens, topk, min_match, max_match, draft_tokens_by_match)
    b, c = history.shape
    depth = num_draft_tokens - 1
    history = history.astype(jnp.int32)
    hist_len = jnp.clip(hist_len.astype(jnp.int32), 1, c)
    root = jnp.take_along_axis(history, (hist_len - 1)[:, None], axis=1)[:, 0]
    if depth == 0:
        return root[:, None], jnp.full((b, 1), -1, jnp.int32)

    # 1. Match length at every continuation start, and continuation length.
    ml = match_lengths(history, hist_len, min(max_match, c))
    qpos = jnp.arange(c, dtype=jnp.int32)[None, :]
    in_range = (qpos >= 1) & (qpos < hist_len[:, None])
    # Negative tokens separate documents (a prepended corpus, `corpus_token_array`):
    # a continuation stops there, so no draft crosses from one text into another.
    next_sep = jax.lax.cummin(jnp.where(history < 0, qpos, c), axis=1, reverse=True)
    # cap[n] for match length n (ml <= max_match; check_ngram_config bounds the tuple).
    cap = jnp.array([depth] + [min(depth, t) for t in draft_tokens_by_match]
                    + [depth] * (max_match - len(draft_tokens_by_match)), jnp.int32)  # [max_match + 1]
    cont_len = jnp.minimum(jnp.minimum(hist_len[:, None], next_sep) - qpos, cap[ml])
    cont_len = jnp.where(in_range, cont_len, 0)

    # 2. Pick up to topk branches.
    starts, lengths = _pick_branches(history, ml, cont_len, topk=topk, min_match=min_match,
                                     max_match=max_match, depth=depth)

    # 3. Branch tokens; positions past a branch's length are masked in the trie.
    dpos = jnp.arange(depth, dtype=jnp.int32)
    idx = jnp.minimum(starts[:, :, None] + dpos, c - 1)
    btok = _gather_rows(history, idx)

    # 4. Trie, BFS layout.
    return _branches_to_tree(root, btok, lengths, num_draft_tokens)


class CorpusError(ValueError):
    """A corpus line jaxspec cannot use; the message names the file, line and id."""


def check_corpus_ids(ids: Sequence[Any], vocab_size: int | None, where: str) -> list[int]:
    """ids as ints, or CorpusError naming `where` (e.g. "file:line") and the bad id.

    Corpus ids become drafts unchecked, and an id past the vocabulary reads a
    clamped (real) probability in a gather, so it must be refused at load. A
    negative id would also pass for a document separator. vocab_size None
    checks only that ids are non-negative integers.
    """
    out = []
    for pos, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise CorpusError(f"{where}: token id {t!r} (position {pos}) is not an integer")
        t = int(t)
        if t < 0 or (vocab_size is not None and t >= vocab_size):
            bound = (f"the vocabulary of {vocab_size} ids (0..{vocab_size - 1})"
                     if vocab_size is not None else "ids >= 0")
            raise CorpusError(f"{where}: token id {t} (position {pos}) is outside {bound}")
        out.append(t)
    return out


def read_corpus(path: str | os.PathLike, tokenizer: Any = None, vocab_size: int | None = None) -> list[list[int]]:
    """The documents of a JSONL corpus, in file order.

    A line is {"text": str} (needs `tokenizer`: an object with `.encode(text)` or a callable
    text -> ids; special tokens are not added when the tokenizer supports that) or
    {"prompt_ids": [...]}, {"output_ids": [...]} or both (one document, prompt then output).
    Every id must be an integer in [0, vocab_size) (`check_corpus_ids`; pass the model's
    vocab_size), else CorpusError names the line.
    """
    docs = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            rec = json.loads(line)
            if "prompt_ids" in rec or "output_ids" in rec:
                ids = list(rec.get("prompt_ids", [])) + list(rec.get("output_ids", []))
            elif "text" in rec:
                if tokenizer is None:
                    raise ValueError(f"{path}:{lineno}: a 'text' line needs a tokenizer")
                ids = _encode(tokenizer, rec["text"])
            else:
                raise ValueError(f"{path}:{lineno}: expected 'text', 'prompt_ids' or "
                                 f"'output_ids', got keys {sorted(rec)}")
            docs.append(check_corpus_ids(ids, vocab_size, f"{path}:{lineno}"))
    return docs


CORPUS_SEPARATOR = -2


def corpus_token_array(path: str | os.PathLike, tokenizer: Any = None, max_tokens: int = 16384,
                       vocab_size: int | None = None) -> np.ndarray:
    """A JSONL corpus (see `read_corpus`) as one flat int32 array for the
    on-device drafter: documents joined by CORPUS_SEPARATOR, most recent last,
    cut to the last `max_tokens`. The loop prepends it to every sequence's
    history, so matches can come from the corpus without any host round trip.
    vocab_size: the target model's; ids outside [0, vocab_size) raise CorpusError."""
    out: list[int] = [CORPUS_SEPARATOR]
    for doc in read_corpus(path, tokenizer, vocab_size):
        if len(doc) >= 2:  # a single token is followed by nothing it could draft
            out += doc[-max_tokens:] + [CORPUS_SEPARATOR]
    arr = np.asarray(out[-max_tokens:], np.int32)
    arr[0] = CORPUS_SEPARATOR  # a cut document must not run into the history
    return arr


def _encode(tokenizer: Any, text: str) -> list[int]:
    if hasattr(tokenizer, "encode"):
        try:
            return list(tokenizer.encode(text, add_special_tokens=False))
        except TypeError:
            return list(tokenizer.encode(text))
    return list(tokenizer(text))


@dataclasses.dataclass(frozen=True)
class NgramDrafter(DrafterBase):
    """Prompt lookup on the on-device history (and the optional corpus); stateless."""

    plan: "SpecPlan"
    min_match: int = 1
    max_match: int = 4
    draft_tokens_by_match: tuple[int, ...] = ()

    def propose(self, params, state, s: "SpecState") -> Proposal:
        plan = self.plan
        history, hist_len = s.history, s.hist_len
        if s.corpus is not None:
            corpus = jnp.broadcast_to(s.corpus, (history.shape[0], s.corpus.shape[1]))
            history = jnp.concatenate([corpus, history], 1)
            hist_len = hist_len + s.corpus.shape[1]
        tokens, parents = ngram_propose(
            history, hist_len, num_draft_tokens=plan.num_draft_tokens, topk=plan.topk,
            min_match=self.min_match, max_match=self.max_match, draft_tokens_by_match=self.draft_tokens_by_match,
        )
        return Proposal(tokens, None if plan.chain else parents, None, None)


register(
    "ngram", AlgorithmInfo(supports_tree=True, drafts_in_steps=False, variable_draft_width=True,
                           description="n-gram lookup in the prompt/generated tokens (and an optional corpus)"),
    lambda *, plan, spec, **_: NgramDrafter(plan, spec.ngram_min_match, spec.ngram_max_match,
                                           spec.ngram_draft_tokens_by_match),
    reads=("ngram_corpus",), builtin=True)
