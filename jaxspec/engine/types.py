"""The host-side types of the engine: a request and its result (offline), a sequence's slice of
one device call (`RowInput`) and what the call gave it (`RowOutput`)."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np


@dataclasses.dataclass
class Request:
    prompt_ids: list[int]
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()


@dataclasses.dataclass
class Result:
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: str  # "stop" (a stop token) or "length"
    accept_lengths: list[int] | None = None  # speculative: committed tokens per verify step


class RequestError(ValueError):
    """A request the engine cannot serve; the message names the problem."""


def bucket_for(n: int, buckets: Sequence[int], what: str) -> int:
    for b in sorted(buckets):
        if n <= b:
            return b
    raise RequestError(f"{what} {n} exceeds the largest bucket {max(buckets)}")


@dataclasses.dataclass
class RowInput:
    """One sequence's slice of a call, built by the caller."""

    tokens: Sequence[int]  # prompt + committed tokens; the last one's K/V is not cached
    prompt_len: int  # the original prompt (max_new counts from here)
    max_new: int
    page_row: np.ndarray  # [max_pages] int32
    slot: int  # the sequence's row in the drafter-state store (stable while active)
    temperature: float
    top_k: int
    top_p: float
    seed: int
    stop_ids: Sequence[int]
    shard: int | None = None  # split pages: the data shard the sequence is pinned to (checked against its row)


@dataclasses.dataclass
class RowOutput:
    tokens: list[int]  # newly committed tokens, cut at a stop id or max_new
    done: bool
    accept_lens: list[int]  # committed tokens per verify step in this call
