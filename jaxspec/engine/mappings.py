"""The process's memory mappings: a budget for resident compiled programs.

XLA:CPU maps every compiled kernel's code and data into the process, three mappings per kernel.
A 30-layer SmolLM2 program has 300-360 kernels with its layers unrolled (the CPU default), so
900-1,100 mappings (measured per serve bucket). Linux caps a process at `vm.max_map_count` (65,530
by default). Past it the next mmap fails, and LLVM aborts the whole process ("Unable to allocate
section memory"). The default
server (37 buckets, then their 37 structured-output builds in the background) died this way two
minutes after it was ready.

So the runner measures what each program costs. It refuses at start-up a bucket set that cannot
fit, with the limit and the knobs in the message. Once serving, it keeps the evictable programs
(structured-output builds) within what is left (`MapBudget`). Elsewhere (no /proc) nothing is
counted and nothing is refused.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Callable

# Left free for what the runner does not count: other jitted helpers (the prompt scorer, host
# sampling), threads' stacks, the allocator's arenas, and a grammar build larger than the rest.
RESERVE_FRACTION = 0.08


class MapLimitError(RuntimeError):
    """The programs a configuration needs cannot all be resident under vm.max_map_count."""


def count() -> int | None:
    """Mappings the process holds now (None where /proc is absent)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


def limit() -> int | None:
    try:
        return int(Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        return None


class MapBudget:
    """Per-program mapping costs as measured, and whether `n` more programs fit."""

    def __init__(self, max_maps: int | None = None):
        self.max_maps = limit() if max_maps is None else max_maps
        self.per_program = 0  # the most one compiled program has added so far

    @property
    def usable(self) -> int | None:
        return None if self.max_maps is None else int(self.max_maps * (1 - RESERVE_FRACTION))

    def observe(self, before: int | None, after: int | None) -> None:
        if before is not None and after is not None:
            self.per_program = max(self.per_program, after - before)

    def room_for(self, n: int, now: int | None = None) -> bool:
        """Whether `n` more programs of the largest size seen fit (True until one has been measured)."""
        now = count() if now is None else now
        if self.usable is None or now is None or not self.per_program:
            return True
        return now + n * self.per_program <= self.usable

    def refuse(self, needed: int, resident: int) -> MapLimitError:
        return MapLimitError(
            f"the compiled buckets need about {(resident + needed) * self.per_program:,} memory mappings "
            f"({resident + needed} programs x ~{self.per_program}), more than this process may hold: "
            f"vm.max_map_count is {self.max_maps:,}, less {RESERVE_FRACTION:.0%} kept free. Raise it "
            f"(`sudo sysctl -w vm.max_map_count=262144`), or compile fewer buckets: serve.context_buckets, "
            f"serve.prefill_tokens, serve.max_prefill_batch, serve.adaptive_steps, engine.batch_buckets")


def make_room(budget: MapBudget, last_used: dict, compiled: dict, need: int, evictable: Callable[[tuple], bool]) -> None:
    """Evict `evictable` programs, least recently used first (`last_used` in that order), until `need`
    more fit; raise MapLimitError if they still do not. The count (a read of /proc/self/maps, ~60K
    lines near the limit) is taken again only after an eviction."""
    if budget.room_for(need):
        return
    for old in [k for k in last_used if evictable(k)]:
        compiled.pop(old, None)
        del last_used[old]
        gc.collect()  # the executable's mappings go with its last reference
        if budget.room_for(need):
            return
    raise budget.refuse(need, len(compiled))
