"""Paged KV cache: device arrays plus a host-side page allocator.

Layout: `k`, `v` are `[layers, num_pages, page_size, kv_heads, head_dim]`, so one
page holds a run of `page_size` token slots for every layer. A sequence owns a
row of the page table; logical slot `s` lives at page `page_table[b, s // page_size]`,
offset `s % page_size`.

Page 0 is reserved as the *null page*. Unused page-table entries point at it, and
writes from padding tokens (ragged prompts padded to a bucket, padded batch
rows) land there. Nothing ever reads the null page through a valid slot, so the
garbage is harmless, and the scatter needs no masking, which keeps it a single
in-place update inside the donated buffer.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

NULL_PAGE = 0


class OutOfPagesError(RuntimeError):
    """Raised by the allocator when a request needs more pages than are free."""


class CacheMemoryError(ValueError):
    """The KV cache the settings ask for cannot fit in the memory left for it."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    k: jax.Array  # [layers, num_pages, page_size, kv_heads, head_dim]
    v: jax.Array  # [layers, num_pages, page_size, kv_heads, head_dim]

    @property
    def page_size(self) -> int:
        return self.k.shape[2]

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]

    @classmethod
    def zeros(cls, num_layers, num_pages, page_size, num_kv_heads, head_dim, dtype=jnp.float32):
        shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


def slot_to_page(
    page_table: jax.Array,  # [B, max_pages] int32
    slots: jax.Array,  # [B, T] int32 logical token slots
    page_size: int,
) -> tuple[jax.Array, jax.Array]:
    """Physical (page, offset) of each logical slot; out-of-table slots go to the null page."""
    max_pages = page_table.shape[1]
    page_idx = slots // page_size
    in_table = (page_idx >= 0) & (page_idx < max_pages)
    pages = jnp.take_along_axis(page_table, jnp.clip(page_idx, 0, max_pages - 1), axis=1)
    pages = jnp.where(in_table, pages, NULL_PAGE)
    return pages, slots % page_size


def write_layer_kv(
    cache_k: jax.Array,  # [layers, P, page_size, kvh, hd]
    cache_v: jax.Array,  # [layers, P, page_size, kvh, hd]
    layer: jax.Array | int,  # scalar
    pages: jax.Array,  # [B, T] physical page per new token
    offsets: jax.Array,  # [B, T] offset in page per new token
    k_new: jax.Array,  # [B, T, kvh, hd]
    v_new: jax.Array,  # [B, T, kvh, hd]
) -> tuple[jax.Array, jax.Array]:
    """Scatter one layer's new K/V into the cache in place (the cache is a scan carry)."""
    cache_k = cache_k.at[layer, pages, offsets].set(k_new.astype(cache_k.dtype))
    cache_v = cache_v.at[layer, pages, offsets].set(v_new.astype(cache_v.dtype))
    return cache_k, cache_v


class PageAllocator:
    """Host-side free list of physical pages.

    Pages are handed out per sequence (`seq_id`) and returned with `free`.
    Invariant (property-tested): used + free == total allocatable pages, and no
    page is owned twice. Page 0 (the null page) is never handed out.
    """

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is reserved), got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        # LIFO free list: recently freed pages are reused first (warm in cache).
        self._free: list[int] = list(range(num_pages - 1, NULL_PAGE, -1))
        self._owned: dict[object, list[int]] = {}

    @property
    def total(self) -> int:
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.total - len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def owned(self, seq_id) -> list[int]:
        return list(self._owned.get(seq_id, ()))

    def allocate(self, seq_id, num_tokens: int) -> list[int]:
        """Grow `seq_id` so it can hold `num_tokens` slots; returns its full page list."""
        have = self._owned.setdefault(seq_id, [])
        need = self.pages_for(num_tokens) - len(have)
        if need > len(self._free):
            if not have:
                del self._owned[seq_id]
            raise OutOfPagesError(
                f"KV cache out of pages: sequence {seq_id!r} needs {need} more page(s) "
                f"of {self.page_size} tokens, {len(self._free)} free of {self.total}"
            )
        for _ in range(max(need, 0)):
            have.append(self._free.pop())
        return list(have)

    def free(self, seq_id) -> int:
        """Return all pages of `seq_id` to the pool; returns how many were freed."""
        pages = self._owned.pop(seq_id, [])
        self._free.extend(reversed(pages))
        return len(pages)

    def page_table_row(self, seq_id, max_pages: int) -> np.ndarray:
        """One page-table row, padded with the null page."""
        row = np.full((max_pages,), NULL_PAGE, np.int32)
        pages = self._owned.get(seq_id, [])
        if len(pages) > max_pages:
            raise ValueError(
                f"sequence {seq_id!r} owns {len(pages)} pages, more than the table width {max_pages}"
            )
        row[: len(pages)] = pages
        return row

    def usage(self) -> dict[str, int]:
        return {"total": self.total, "used": self.num_used, "free": self.num_free}


class ShardedPageAllocator:
    """One `PageAllocator` per "data" shard, over that shard's slice of the page axis.

    With the cache's pages split over "data", a batch row can only use pages of
    the shard that runs it: `allocate(seq_id, n, shard)` takes them from that
    shard's pool, and page-table rows hold shard-local ids (each shard's page 0
    is its null page), which is what the per-shard code indexes."""

    def __init__(self, num_shards: int, pages_per_shard: int, page_size: int, pool=PageAllocator):
        if num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {num_shards}")
        # `pool(num_pages, page_size)`: each shard's allocator (a prefix cache is per shard).
        self.pools = [pool(pages_per_shard, page_size) for _ in range(num_shards)]
        self.num_pages = num_shards * pages_per_shard
        self.page_size = page_size
        self._shard: dict[object, int] = {}

    @property
    def total(self) -> int:
        return sum(p.total for p in self.pools)

    @property
    def num_free(self) -> int:
        return sum(p.num_free for p in self.pools)

    @property
    def num_used(self) -> int:
        return sum(p.num_used for p in self.pools)

    def _pin(self, seq_id, shard: int) -> None:
        if self._shard.setdefault(seq_id, shard) != shard:
            raise ValueError(f"sequence {seq_id!r} holds pages on shard {self._shard[seq_id]}, not {shard}")

    def allocate(self, seq_id, num_tokens: int, shard: int = 0) -> list[int]:
        self._pin(seq_id, shard)
        try:
            return self.pools[shard].allocate(seq_id, num_tokens)
        except OutOfPagesError as e:
            if not self.pools[shard].owned(seq_id):
                self._shard.pop(seq_id)
            raise OutOfPagesError(f"data shard {shard}: {e}") from None

    def free(self, seq_id) -> int:
        shard = self._shard.pop(seq_id, None)
        return 0 if shard is None else self.pools[shard].free(seq_id)

    def page_table_row(self, seq_id, max_pages: int) -> np.ndarray:
        return self.pools[self._shard.get(seq_id, 0)].page_table_row(seq_id, max_pages)

    def usage(self) -> dict[str, int]:
        return {k: sum(p.usage()[k] for p in self.pools) for k in self.pools[0].usage()}

    # The prefix cache (`cache.prefix`), per shard: a sequence adopts and publishes pages of its own.
    def adopt(self, seq_id, tokens, max_hit: int, shard: int = 0) -> int:
        self._pin(seq_id, shard)
        return self.pools[shard].adopt(seq_id, tokens, max_hit)

    def cache_pages(self, seq_id, tokens, upto: int) -> int:
        shard = self._shard.get(seq_id)
        return 0 if shard is None else self.pools[shard].cache_pages(seq_id, tokens, upto)

    def drop_cached(self) -> None:
        for p in self.pools:
            p.drop_cached()


# ---- sizing against memory ---------------------------------------------------------


def host_memory_available() -> int | None:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def device_memory_available(device) -> int | None:
    """Bytes still free for new arrays on `device`, or None where nothing says."""
    stats = device.memory_stats() or {}  # None on CPU
    if "bytes_limit" in stats:
        return stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    return host_memory_available() if device.platform == "cpu" else None


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.2f} MB"


def check_cache_fits(shape: tuple[int, ...], dtype, mesh=None, what: str = "KV cache") -> None:
    """Refuse (CacheMemoryError) a K/V cache of `shape` that cannot fit, before allocating it.

    A cache too big for the host is otherwise OOM-killed with no message. With a
    mesh, each device holds 1/model of the heads; CPU devices share host memory."""
    num_pages, page_size = shape[1:3]
    total = 2 * math.prod(shape) * jnp.dtype(dtype).itemsize
    devices = list(mesh.local_devices) if mesh is not None else [jax.devices()[0]]
    per_device = total // (mesh.shape["model"] if mesh is not None else 1)
    on_host = [d for d in devices if d.platform == "cpu"]
    pools = [(per_device * len(on_host), on_host[0], "host memory (MemAvailable)")] if on_host else []
    pools += [(per_device, d, f"free on {d}") for d in devices if d.platform != "cpu"]
    for need, device, where in pools:
        free = device_memory_available(device)
        if free is not None and need > free:
            per_token = total // (num_pages * page_size)
            raise CacheMemoryError(
                f"{what} needs {_size(need)} but only {_size(free)} is {where}: {num_pages} pages x "
                f"{page_size} tokens (engine.num_pages x engine.page_size) x {per_token} bytes per token; "
                "lower engine.page_size, or engine.num_pages (when 0 it is max_batch_size x the pages of one "
                "max_context sequence + 1)"
            )
