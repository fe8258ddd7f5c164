"""The host side of one runner call: the numpy inputs of a bucket, and the per-row results.

Plain numpy on both ends, so a multi-host leader can broadcast the inputs
(`jaxspec.serve.multihost`) and the outputs never hold device arrays. A None
row or chunk is padding (split pages: the caller lays rows out by data shard,
`ModelRunner.place`). The runner picks the bucket; these functions only fill it.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from jaxspec.engine.device_sampling import DeviceSampling
from jaxspec.engine.types import RowInput, RowOutput, TokenScores

# The key suffix of the constrained build of a program (a batch holding a structured-output row).
GRAMMAR = "+grammar"

# check(i, b, row): raises when row i of a b-row call sits on a data shard its sequence is not pinned to.
ShardCheck = Callable[[int, int, RowInput], None]


def grammar_suffix(rows: Sequence[RowInput | None]) -> str:
    return GRAMMAR if any(r is not None and r.grammar is not None for r in rows) else ""


def pack_prefill(chunks: Sequence[tuple[RowInput, int, int] | None], *, b: int, c: int, ctx: int, width: int,
                 num_slots: int, max_context: int, check: ShardCheck) -> tuple[tuple, dict]:
    """(the program key, its host inputs) for chunks of (row, q_start, chunk_len) in a b x c prefill
    bucket whose page table is `width` pages wide. A padding row gets slot `num_slots` (the store's
    scratch row) and zero lengths."""
    tokens = np.zeros((b, c), np.int32)  # [b, c]
    q_start, lens = np.zeros((b,), np.int32), np.zeros((b,), np.int32)  # [b] each
    table = np.zeros((b, width), np.int32)  # [b, width]
    slots = np.full((b,), num_slots, np.int32)  # [b]
    history, prompt_lens = np.zeros((b, max_context), np.int32), np.zeros((b,), np.int32)  # [b, max_context], [b]
    resume = np.zeros((b,), bool)  # [b]
    for i, chunk in enumerate(chunks):
        if chunk is None:
            continue
        row, start, n = chunk
        check(i, b, row)
        tokens[i, :n] = row.tokens[start: start + n]
        q_start[i], lens[i], slots[i] = start, n, row.slot
        m = min(len(row.page_row), width)  # pages past the chunk's end (decode lookahead) are not read
        table[i, :m] = row.page_row[:m]
        history[i, : start + n] = row.tokens[: start + n]
        prompt_lens[i] = row.prompt_len
        resume[i] = 0 < start == row.cached
    rows = [ch and ch[0] for ch in chunks]
    inputs = dict(slots=slots, tokens=tokens, q_start=q_start, lens=lens, table=table,
                  sampling=DeviceSampling.pack(rows, b), history=history, prompt_lens=prompt_lens, resume=resume)
    return ("prefill" + grammar_suffix(rows), b, c, ctx), inputs


def prefill_outputs(chunks: Sequence[tuple[RowInput, int, int] | None], result: tuple) -> tuple[list[int], list]:
    """(the token sampled at each chunk's end, its TokenScores or None) from `run_prefill`'s
    (first [b], logprob entries or None)."""
    first, lp = result
    asked = lambda ch: lp is not None and ch is not None and ch[0].params.logprobs is not None  # noqa: E731
    return first[: len(chunks)].tolist(), [TokenScores.pick(lp, slice(i, i + 1), ch[0].params.logprobs)
                                           if asked(ch) else None for i, ch in enumerate(chunks)]


def pack_decode(k: int, rows: Sequence[RowInput | None], *, b: int, ctx: int, width: int, num_slots: int,
                check: ShardCheck) -> tuple[tuple, dict]:
    """(the program key, its host inputs) for a decode call of draft length k over a b-row bucket
    with `ctx` tokens of history. A padding row starts done."""
    history = np.zeros((b, ctx), np.int32)  # [b, ctx]
    hist_len, prompt_lens = np.ones((b,), np.int32), np.zeros((b,), np.int32)  # [b] each
    slots = np.full((b,), num_slots, np.int32)  # [b]
    table = np.zeros((b, width), np.int32)  # [b, width]
    done = np.ones((b,), bool)  # [b]
    for i, r in enumerate(rows):
        if r is None:
            continue
        check(i, b, r)
        n = len(r.tokens)
        history[i, :n] = r.tokens
        hist_len[i], prompt_lens[i], slots[i] = n, r.prompt_len, r.slot
        m = min(len(r.page_row), width)
        table[i, :m] = r.page_row[:m]
        done[i] = False
    # Host arrays only: a jnp.zeros here would compile a fill op per new shape while serving.
    inputs = dict(table=table, history=history, hist_len=hist_len, prompt_lens=prompt_lens, done=done,
                  slots=slots, sampling=DeviceSampling.pack(rows, b))
    return ("decode" + grammar_suffix(rows), k, b, ctx), inputs


def decode_outputs(rows: Sequence[RowInput | None], result: tuple[np.ndarray, ...]):
    """([RowOutput | None per row], iterations run) from `ModelRunner.fetch`'s host arrays."""
    hist, new_len, done_out, acc, nv, lp = result
    outs = []
    for i, r in enumerate(rows):
        if r is None:
            outs.append(None)
            continue
        n = len(r.tokens)
        scores = None
        if lp is not None and r.params.logprobs is not None:
            scores = TokenScores.pick(lp, (i, slice(0, new_len[i] - n)), r.params.logprobs)
        outs.append(RowOutput(tokens=hist[i, n: new_len[i]].tolist(), done=bool(done_out[i]),
                              accept_lens=acc[i, : nv[i]].tolist(), logprobs=scores))
    return outs, int(nv[: len(rows)].max(initial=0))
