"""The host half of constrained decoding: llguidance matchers and the token masks they give.

Design. The loop stays one XLA program. A decode call whose batch holds a constrained row runs
the constrained build of the programs (`SpecPlan.constrained`), whose verify step calls back to
the host once per iteration (`speculative.grammar`): with the committed history and the draft
tree, it gets one bitmask per tree node, and the verify applies them to the target's logits.
Rows without a grammar pay nothing beyond the call, and batches without one run the ordinary
programs (no callback compiled in, stored executables kept).

State. A `Grammar` is one sequence's matcher. It holds no position of its own that the device
could disagree with: each callback hands it the committed output tokens, and `sync` consumes
what is new (rolling back first if the history is not an extension of what it consumed: a
preempted and recomputed sequence, a repeated call). So a callback is a function of its inputs,
as `jax.pure_callback` requires, and the matcher is only a cache of that function's work.

Tree masks (SGLang's `traverse_tree`): node i's mask is the set of tokens the grammar allows
after the committed output and the draft path root -> i. A depth-first walk consumes each
node's token on the way down and rolls it back on the way up, so each node costs one token step
and one mask. A node whose own token the grammar refuses is unreachable (its parent's mask
forbids it, so no verifier accepts it): its subtree is skipped and left all-allowed.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import weakref
from typing import Sequence

import numpy as np

from jaxspec.sampling_params import StructuredOutputs

log = logging.getLogger(__name__)

_IDS = itertools.count()
# Host time spent in mask callbacks, process-wide (the server's /metrics; `bench serve --workload
# constrained` reports seconds per call): callbacks, node masks computed, seconds.
STATS = {"calls": 0, "masks": 0, "seconds": 0.0}
_LIVE: "weakref.WeakValueDictionary[int, Grammar]" = weakref.WeakValueDictionary()
_LOCK = threading.Lock()


def mask_words(vocab: int) -> int:
    """int32 words of one token bitmask (llguidance's layout: bit t % 32 of word t // 32)."""
    return (vocab + 31) // 32


class GrammarCompiler:
    """The tokenizer bridge: one llguidance tokenizer built from the model's own (a Hugging Face
    fast tokenizer), over the model's vocabulary and its stop ids, built on first use (~0.5 s).
    `ll_tokenizer`: an llguidance LLTokenizer to use instead (a vocabulary given as token bytes)."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: Sequence[int], ll_tokenizer=None):
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, int(vocab_size), tuple(eos_ids)
        self._ll = ll_tokenizer
        self._templates: dict[str, object] = {}  # grammar text -> a fresh matcher to copy (insertion = LRU order)

    @property
    def ll_tokenizer(self):
        if self._ll is None:
            import llguidance.hf

            if self.tokenizer is None:
                raise ValueError("structured output needs the model's tokenizer, and this model has none")
            try:
                self._ll = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size,
                                                        eos_token=list(self.eos_ids) or None)
            except ValueError as e:
                raise ValueError(f"structured output: cannot use this tokenizer with llguidance ({e})") from None
        return self._ll

    def matcher(self, spec: StructuredOutputs) -> "Grammar":
        """A fresh matcher for one sequence; ValueError naming spec.field when llguidance refuses the
        grammar with this tokenizer (what the tokenizer-free check of `StructuredOutputs` cannot see)."""
        import llguidance

        template = self._templates.pop(spec.lark, None)
        if template is None:  # a new grammar: built once, then copied (a copy skips the compile)
            template = llguidance.LLMatcher(self.ll_tokenizer, spec.lark, log_level=0)
            if template.is_error():
                raise ValueError(f"{spec.field}: {' '.join(template.get_error().split())}")
        self._templates[spec.lark] = template
        while len(self._templates) > 64:
            self._templates.pop(next(iter(self._templates)))
        return Grammar(template.deep_copy(), self.vocab_size, self.eos_ids)


class Grammar:
    """One sequence's matcher, registered under `id` (what the device arrays carry) while alive."""

    def __init__(self, matcher, vocab_size: int, eos_ids: Sequence[int] = ()):
        self.matcher, self.vocab_size, self.eos_ids = matcher, vocab_size, tuple(eos_ids)
        self.consumed: list[int] = []
        self.id = next(_IDS) % (2**31 - 1)
        self.errors = 0  # callbacks that met a matcher in its error state (a token it refused got committed)
        with _LOCK:
            _LIVE[self.id] = self

    def sync(self, output: Sequence[int]) -> None:
        """Make the matcher's consumed tokens equal `output` (the committed output so far)."""
        out = [int(t) for t in output]
        n = 0
        limit = min(len(out), len(self.consumed))
        while n < limit and out[n] == self.consumed[n]:
            n += 1
        if n < len(self.consumed):
            self.matcher.rollback(len(self.consumed) - n)
            del self.consumed[n:]
        for t in out[n:]:
            if not self.matcher.consume_token(t):
                break
            self.consumed.append(t)

    def _fill(self, row: np.ndarray) -> None:
        if self.matcher.is_error():
            # Only a committed token the matcher refused gets here (a bug, not a request's fault):
            # allow everything rather than mask every token, and say so once per sequence.
            if not self.errors:
                log.warning("grammar %d is in its error state (%s); its output is no longer constrained",
                            self.id, self.matcher.get_error())
            self.errors += 1
            row[:] = -1
            return
        self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def tree_masks(self, output: Sequence[int], tokens: np.ndarray, parents: np.ndarray, out: np.ndarray) -> int:
        """out [N, W] int32 := each node's mask (see the module's "Tree masks"); returns how many
        masks it computed (the reachable nodes).

        tokens [N] (node 0 the root, -1 padding), parents [N] (-1 for the root and padding;
        a parent's index is below its child's, the tree convention)."""
        self.sync(output)
        out[:] = -1
        self._fill(out[0])
        computed = 1
        children: list[list[int]] = [[] for _ in range(len(tokens))]
        for i in range(1, len(tokens)):
            if tokens[i] >= 0 and parents[i] >= 0:
                children[parents[i]].append(i)
        m = self.matcher
        # Depth-first: a stack of (node, entering); a node consumed on entry is rolled back on exit.
        stack = [(c, True) for c in reversed(children[0])]
        while stack:
            i, entering = stack.pop()
            if not entering:
                m.rollback(1)
                continue
            t = int(tokens[i])
            word, bit = divmod(t, 32)
            parent_mask = out[parents[i]]
            if t >= self.vocab_size or not (int(parent_mask[word]) >> bit) & 1:
                continue  # unreachable: the verify never accepts it, so neither it nor its subtree needs a mask
            if not m.consume_token(t):  # allowed by the mask yet refused: leave the subtree open
                continue
            self._fill(out[i])
            computed += 1
            stack.append((i, False))
            stack.extend((c, True) for c in reversed(children[i]))
        return computed

    def release(self) -> None:
        with _LOCK:
            _LIVE.pop(self.id, None)


def lookup(gid: int) -> Grammar | None:
    with _LOCK:
        return _LIVE.get(int(gid))


def batch_masks(ids: np.ndarray, history: np.ndarray, upto: np.ndarray, prompt_lens: np.ndarray,
                tokens: np.ndarray, parents: np.ndarray, words: int) -> np.ndarray:
    """The host callback of `speculative.grammar`: [B, N, words] int32 masks of a batch's trees.

    ids [B] (-1: unconstrained), history [B, C], upto [B] (row b's committed output is
    history[b, prompt_lens[b]:upto[b]]), tokens / parents [B, N]. Unconstrained rows (and ids no
    longer live: a finished sequence's padding row) get all-allowed masks."""
    t0 = time.perf_counter()
    b, n = tokens.shape
    out = np.full((b, n, words), -1, np.int32)
    masks = 0
    for r in range(b):
        g = lookup(ids[r]) if ids[r] >= 0 else None
        if g is None:
            continue
        masks += g.tree_masks(history[r, prompt_lens[r]: upto[r]], tokens[r], parents[r], out[r])
    with _LOCK:
        STATS["calls"] += 1
        STATS["masks"] += masks
        STATS["seconds"] += time.perf_counter() - t0
    return out
