"""Which prefilling sequences the next prefill call takes, and how many prompt tokens each.

Two call layouts (`ModelRunner.prefill_piece`):

* rectangle (`plan_prefill`): one row per sequence, every row padded to the call's chunk bucket;
* packed (`plan_packed`): a sequence takes as many rows of `piece` tokens as it needs, over the
  same page table (each layer writes every row's K/V before any row attends), so a call pads less
  than one piece per sequence plus the row bucket's rounding. Only for drafters that keep no
  per-sequence state: two rows of one sequence would write the same drafter slot.

Both are pure functions of (data shard, prompt tokens left) per sequence, tested on their own
(tests/test_serve_unit.py).
"""

from __future__ import annotations

from typing import Callable

from jaxspec.engine.types import bucket_for

CALL_OVERHEAD_TOKENS = 32  # a prefill call's fixed cost (weights read, dispatch) in tokens of compute
# What a second prefill call costs the prompts still waiting beyond its overhead: the running batch's
# decode call between the two (one iteration while a prefill waits, `serve.yield_steps`), in tokens
# of prefill compute (~35 ms at batch 8 on the 2-core CPU, at ~1.5 ms a prefill token).
DECODE_GAP_TOKENS = 32
MAX_PREFILL_SKIPS = 8  # prefill calls a sequence may be passed over before it is taken first


def _order(pending: list[tuple[int, int]], urgent: int | None) -> list[int]:
    """Indices of `pending` by fewest prompt tokens left (oldest first among equals), `urgent` first."""
    order = sorted(range(len(pending)), key=lambda i: (pending[i][1], i))
    if urgent is not None:
        order.remove(urgent)
        order.insert(0, urgent)
    return order


def plan_prefill(pending: list[tuple[int, int]], shapes: tuple[tuple[int, int], ...], chunk_buckets: tuple[int, ...],
                 padded_rows: Callable[[list[int]], int | None], chunk: int, *,
                 urgent: int | None = None) -> tuple[list[int], int]:
    """The next prefill call: which of `pending` it takes (indices, ascending) and its chunk bucket.

    pending: (data shard, prompt tokens left) per prefilling sequence, oldest first. shapes: the
    compiled (rows, chunk bucket) programs, rows x chunk within the token budget (the smallest row
    bucket takes any chunk). padded_rows: the row bucket a call taking sequences on these shards is
    padded to (None: no bucket holds them). chunk: the most prompt tokens a row takes per call.

    Rows go to the sequences with the fewest prompt tokens left, each taking min(chunk bucket,
    tokens left), so a long prompt fills its row exactly (chunked prefill) and a 40-token cache-hit
    turn no longer waits behind a 1,500-token prompt's six chunks (oldest-first did, with half the
    multi-turn replay's prefilled tokens padding). Of the compiled shapes, the call is the one that
    brings the most sequences to their first token, then the one with the most prompt tokens per
    unit of cost: on CPU a call costs its padded tokens (rows x chunk) plus a fixed overhead.
    `urgent` (the scheduler's oldest sequence passed over MAX_PREFILL_SKIPS calls) is always
    taken, so a long prompt never starves behind a stream of short ones.
    """
    order = _order(pending, urgent)
    best, best_key = None, None
    for b, c in shapes:
        if c > chunk:
            continue
        taken: list[int] = []
        for i in order:
            if len(taken) == b:
                break
            rows = padded_rows([pending[j][0] for j in taken + [i]])
            if rows is not None and rows <= b:
                taken.append(i)
        if not taken or taken[0] != order[0]:
            continue
        used = bucket_for(max(min(c, pending[i][1]) for i in taken), chunk_buckets, "prefill chunk")
        rows = padded_rows([pending[i][0] for i in taken])
        if (rows, used) not in shapes:
            continue
        useful = sum(min(used, pending[i][1]) for i in taken)
        done = sum(1 for i in taken if pending[i][1] <= used)
        key = (done, useful / (rows * used + CALL_OVERHEAD_TOKENS), useful, used)
        if best_key is None or key > best_key:
            best, best_key = (sorted(taken), used), key
    if best is None:  # the smallest row bucket takes any chunk: one row always fits
        return [order[0]], bucket_for(min(chunk, pending[order[0]][1]), chunk_buckets, "prefill chunk")
    return best


def _fits(shards: list[int], shard: int, want: int, limit: int, padded_rows: Callable[[list[int]], int | None]) -> int:
    """The most of `want` rows on `shard` that `shards` (rows taken) has room for within `limit` rows."""
    lo, hi = 0, want  # rows that fit are a prefix of 0..want: binary search
    while lo < hi:
        mid = (lo + hi + 1) // 2
        rows = padded_rows(shards + [shard] * mid)
        if rows is not None and rows <= limit:
            lo = mid
        else:
            hi = mid - 1
    return lo


def batch_size(rows: list[int], piece: int, gap: int) -> int:
    """How many of the waiting sequences (rows each needs, in planning order) the next call should
    finish, to bring the queue's prompts to their first token soonest in all.

    A prefill call's cost grows with its tokens, so finishing sequences one call each would be
    shortest-job-first; but each further call costs CALL_OVERHEAD_TOKENS and the `gap` (the decode
    call between two prefill calls). Taking sequence i + 1 into a call of i delays those i by its
    rows; giving it a call of its own delays it and the n - i - 1 behind it by one call's overhead
    and gap. It joins while that is the cheaper: few waiting turns get small calls (a cache-hit turn
    is not held up by three others' prompts), a long queue gets one large call."""
    n, k = len(rows), 1
    while k < n and k * rows[k] * piece < (n - k) * (CALL_OVERHEAD_TOKENS + gap):
        k += 1
    return k


def plan_packed(pending: list[tuple[int, int]], row_buckets: tuple[int, ...], piece: int,
                padded_rows: Callable[[list[int]], int | None], *,
                urgent: int | None = None, gap: int = DECODE_GAP_TOKENS) -> list[tuple[int, int]]:
    """The next packed prefill call: (index into `pending`, prompt tokens it takes) per sequence taken,
    ascending by index.

    pending: (data shard, prompt tokens left) per prefilling sequence, oldest first. row_buckets: the
    compiled row counts, each row `piece` tokens. padded_rows: the row bucket a call with rows on
    these shards pads to (None: none holds them).

    Sequences go fewest tokens left first (`urgent` before all), each taking every piece it needs
    while rows are left, so a sequence that does not fit takes the rest of the rows (chunked
    prefill). The call aims to finish the first `batch_size` of them (`gap`: the decode call's cost
    between two prefill calls, 0 when nothing decodes): of the row buckets, the smallest that
    finishes as many of those as any bucket can, its spare rows going to the next sequences'
    pieces; when no bucket finishes even the first (a long prompt), the one with the most prompt
    tokens, then the most per unit of cost (padded tokens plus CALL_OVERHEAD_TOKENS).
    """
    order = _order(pending, urgent)
    want = batch_size([-(-pending[i][1] // piece) for i in order], piece, gap)
    best, best_key = None, None
    for b in row_buckets:
        taken: list[tuple[int, int]] = []
        shards: list[int] = []
        for i in order:
            shard, left = pending[i]
            n = _fits(shards, shard, -(-left // piece), b, padded_rows)
            if n:
                taken.append((i, min(left, n * piece)))
                shards += [shard] * n
        # A bucket whose rows pad to another is that bucket's plan; the first sequence must be in.
        if not taken or taken[0][0] != order[0] or padded_rows(shards) != b:
            continue
        useful = sum(t for _, t in taken)
        done = min(want, sum(1 for i, t in taken if t == pending[i][1]))
        key = (done, -b if done else useful, useful / (b * piece + CALL_OVERHEAD_TOKENS))
        if best_key is None or key > best_key:
            best, best_key = sorted(taken), key
    if best is None:  # cannot happen while the smallest bucket holds one row; a clear error if it does
        raise ValueError(f"no prefill row bucket of {row_buckets} holds a row of sequence {order[0]}")
    return best
