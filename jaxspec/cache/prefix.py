"""Prefix caching: full KV pages shared between sequences by the hash of their tokens.

A page is named by a hash chain, so equal tokens at equal positions after an
equal prefix give equal names:

    key(p) = H(key(p - 1), tokens[p*S : (p+1)*S], tokens[(p+1)*S])      key(-1) = H(namespace)

The key also covers the first token *after* the page (the lookahead). A
feature drafter's cache pairs the target feature at slot i with token i + 1
(`drafters/features.py`), so a page's drafter state is only right for the
token that followed it; with the lookahead in the key, a hit brings the
target's K/V and every drafter's state for the prefix together, and no shared
page is ever rewritten (the one pair a resumed prefill would write, at slot
hit - 1, is already there: `Committed.after_cache`).

Pages enter the cache when their state is final (`cache_pages`: after a
prompt's prefill, and when a sequence ends or is preempted). A cached page is
held by a reference count; at zero it stays cached but evictable, in LRU
order, and the allocator takes evictable pages only when the free list is dry,
so eviction always comes before preemption. Freed pages go to the LRU tail
first, so a chain's deepest pages are evicted before the pages they extend.

Invariant (property-tested): free + evictable + held == total; a page with a
positive reference count is never evicted or handed out again.
"""

from __future__ import annotations

import collections
import hashlib
from typing import Sequence

import numpy as np

from jaxspec.cache.paged import NULL_PAGE, OutOfPagesError, PageAllocator


def root_key(namespace: str) -> bytes:
    """The chain's seed: everything that makes K/V differ for equal tokens (model, drafter, dtype,
    weights' version), so caches of different runners or weights can never mix."""
    return hashlib.blake2b(namespace.encode(), digest_size=16).digest()


def page_keys(tokens: Sequence[int], page_size: int, root: bytes, limit: int | None = None) -> list[bytes]:
    """Keys of the leading full pages of `tokens` whose lookahead token is known, at most
    `limit` tokens' worth (pages p with (p + 1) * page_size < len(tokens), within limit)."""
    n = len(tokens) - 1 if limit is None else min(len(tokens) - 1, limit)
    arr = np.asarray(tokens, np.int64)
    keys, parent = [], root
    for p in range(max(n, 0) // page_size):
        end = (p + 1) * page_size
        parent = hashlib.blake2b(parent + arr[p * page_size: end + 1].tobytes(), digest_size=16).digest()
        keys.append(parent)
    return keys


def shared_in_batch(prompts: Sequence[Sequence[int]], pools: Sequence["PrefixCachingAllocator"]) -> tuple[list[int], int]:
    """Rows of one batch to prefill after the others: each shares full pages with an earlier row's
    prompt (same pool) that the cache does not hold yet. Returns (those rows, the prompt tokens they
    would not recompute if the other rows were prefilled and published first).

    pools: the pool each row's pages come from (its data shard's). A row that gains nothing from an
    earlier one is a leader: its prompt's keys become available to the rows after it. One level
    only: a follower's own pages are published after its call, too late for the others of the batch."""
    followers, saved = [], 0
    published: dict[int, set] = {}  # id(pool) -> keys the leaders' prefills will publish
    for i, (tokens, pool) in enumerate(zip(prompts, pools)):
        if not pool.enabled:
            continue
        keys = page_keys(tokens, pool.page_size, pool.root, len(tokens) - 1)
        mine = published.setdefault(id(pool), set())
        now = pool.cached_run(keys)  # `match`'s pages, the keys hashed once
        after = now
        while after < len(keys) and (keys[after] in mine or pool.holds(keys[after])):
            after += 1
        if after > now:
            followers.append(i)
            saved += (after - now) * pool.page_size
        else:
            mine.update(keys)
    return followers, saved


class PrefixCachingAllocator(PageAllocator):
    """A `PageAllocator` whose full pages outlive their sequence, shared by content.

    `adopt(seq_id, tokens, max_hit)` gives a new sequence the longest cached prefix
    (call it before the sequence's first `allocate`); `cache_pages` publishes a
    sequence's finished pages; `free` returns private pages to the free list and
    drops one reference from cached ones. With `enabled=False` it is a plain
    allocator (every query misses, nothing is cached)."""

    def __init__(self, num_pages: int, page_size: int, *, namespace: str = "", enabled: bool = True):
        super().__init__(num_pages, page_size)
        self.enabled = enabled
        self.root = root_key(namespace)
        self._page_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._refs: dict[int, int] = {}  # cached page -> sequences holding it
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # cached, unheld
        self.evicted_pages = 0

    # ---- counts ----------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Pages a new allocation can take: the free list plus evictable cached pages."""
        return len(self._free) + len(self._lru)

    @property
    def num_used(self) -> int:
        return self.total - self.num_free

    @property
    def num_cached(self) -> int:
        """Pages in the cache (held or evictable)."""
        return len(self._key_of)

    def usage(self) -> dict[str, int]:
        return {"total": self.total, "used": self.num_used, "free": self.num_free, "cached": self.num_cached}

    # ---- lookup and sharing ----------------------------------------------------

    def holds(self, key: bytes) -> bool:
        """Whether a page with this key (`page_keys`) is cached."""
        return key in self._page_of

    def cached_run(self, keys: Sequence[bytes]) -> int:
        """How many of `keys` (a prompt's `page_keys`, in order) lead with cached pages."""
        return next((p for p, key in enumerate(keys) if key not in self._page_of), len(keys))

    def match(self, tokens: Sequence[int], max_hit: int) -> int:
        """Tokens of `tokens`' longest cached prefix, at most `max_hit` (whole pages); no side effects."""
        if not self.enabled:
            return 0
        return self.cached_run(page_keys(tokens, self.page_size, self.root, max_hit)) * self.page_size

    def adopt(self, seq_id, tokens: Sequence[int], max_hit: int) -> int:
        """Start `seq_id` (which owns no pages yet) on the cached pages of its longest cached
        prefix of at most `max_hit` tokens; returns the tokens hit (a multiple of page_size)."""
        if self._owned.get(seq_id):
            raise ValueError(f"sequence {seq_id!r} already owns pages: adopt a prefix before allocating")
        if not self.enabled:
            return 0
        pages = []
        for key in page_keys(tokens, self.page_size, self.root, max_hit):
            page = self._page_of.get(key)
            if page is None:
                break
            pages.append(page)
        for page in pages:
            self._refs[page] += 1
            self._lru.pop(page, None)
        if pages:
            self._owned[seq_id] = pages
        return len(pages) * self.page_size

    def cache_pages(self, seq_id, tokens: Sequence[int], upto: int) -> int:
        """Publish `seq_id`'s full pages whose K/V and drafter state are final for the first `upto`
        tokens of `tokens` (its whole history); returns how many pages became cached. A page whose
        key another page already holds stays private (freed with the sequence)."""
        if not self.enabled:
            return 0
        owned = self._owned.get(seq_id, [])
        added = 0
        for p, key in enumerate(page_keys(tokens, self.page_size, self.root, upto - 1)):
            if p >= len(owned):
                break
            page = owned[p]
            if page in self._key_of or key in self._page_of:
                continue  # already shared, or the same content cached from another page
            self._page_of[key], self._key_of[page], self._refs[page] = page, key, 1
            added += 1
        return added

    def drop_cached(self) -> None:
        """Forget every cached page (their K/V is no longer valid: caches reset, weights swapped).
        Evictable pages return to the free list. A held page keeps its reference count, now under
        no key: it returns to the free list when its last holder frees it (once, however many
        sequences held it)."""
        self._free.extend(reversed(list(self._lru)))
        for page in self._lru:
            del self._refs[page]
        self._lru.clear()
        self._page_of.clear()
        self._key_of.clear()

    # ---- the allocator's own operations ---------------------------------------

    def _take(self, need: int) -> None:
        """Make `need` pages available on the free list, evicting the least recently used."""
        while len(self._free) < need and self._lru:
            page, _ = self._lru.popitem(last=False)
            del self._page_of[self._key_of.pop(page)]
            del self._refs[page]
            self._free.append(page)
            self.evicted_pages += 1

    def allocate(self, seq_id, num_tokens: int) -> list[int]:
        need = self.pages_for(num_tokens) - len(self._owned.get(seq_id, ()))
        if need > self.num_free:
            raise OutOfPagesError(
                f"KV cache out of pages: sequence {seq_id!r} needs {need} more page(s) of {self.page_size} "
                f"tokens, {self.num_free} free of {self.total} ({len(self._lru)} of them cached)")
        self._take(need)
        return super().allocate(seq_id, num_tokens)

    def free(self, seq_id) -> int:
        pages = self._owned.pop(seq_id, [])
        private = []
        # Reversed: a chain's tail pages reach the LRU (and the free list) first.
        for page in reversed(pages):
            if page in self._refs:
                self._refs[page] -= 1
                if self._refs[page] > 0:
                    continue
                if page in self._key_of:
                    self._lru[page] = None
                else:  # dropped from the cache while held
                    del self._refs[page]
                    private.append(page)
            else:
                private.append(page)
        self._free.extend(private)
        return len(pages)

    def check(self) -> None:
        """Assert the invariants (tests): every page exactly once among free, evictable and held."""
        held = [p for pages in self._owned.values() for p in pages]
        private_held = [p for p in held if p not in self._refs]
        assert len(set(private_held)) == len(private_held), "a private page is owned twice"
        every = list(self._free) + list(self._lru) + private_held + [p for p, r in self._refs.items() if r > 0]
        assert sorted(every) == list(range(NULL_PAGE + 1, self.num_pages)), "pages lost or duplicated"
        for page, r in self._refs.items():
            assert r >= 0, f"page {page} has a negative reference count"
            assert r == sum(p == page for p in held), f"page {page}: {r} references, {held.count(page)} holders"
            assert (r == 0) == (page in self._lru), f"page {page}: evictable iff unreferenced"
