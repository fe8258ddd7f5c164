"""The host-side types of the engine: a request and its result (offline), a sequence's slice of
one device call (`RowInput`) and what the call gave it (`RowOutput`).

Each holds the caller's public `SamplingParams` by reference (the server's request params, the
API's, the CLI's): the fields are read once, where `DeviceSampling.pack` builds the device
arrays, and never copied hop to hop. What a SamplingParams cannot say per sample travels beside
it: the sample's own seed (SamplingParams.seed + its index, resolved by the front end) and the
stop token ids (the model's EOS unless ignore_eos)."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from jaxspec.sampling_params import SamplingParams

GREEDY = SamplingParams()


@dataclasses.dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams = GREEDY  # max_tokens, temperature, top_p, top_k (by reference)
    seed: int = 0  # this sample's noise key
    stop_token_ids: tuple[int, ...] = ()
    grammar: object = None  # a grammar.matcher.Grammar for params.structured_outputs (one per sample)


@dataclasses.dataclass
class Result:
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: str  # "stop" (a stop token) or "length"
    accept_lengths: list[int] | None = None  # speculative: committed tokens per verify step
    logprobs: TokenScores | None = None  # output_ids' own, when params.logprobs asked
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache


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
    prompt_len: int  # the original prompt (params.max_tokens counts from here)
    page_row: np.ndarray  # [max_pages] int32
    slot: int  # the sequence's row in the drafter-state store (stable while active)
    params: SamplingParams = GREEDY
    seed: int = 0
    stop_ids: Sequence[int] = ()
    # Leading tokens whose K/V and drafter state came from the prefix cache (cache/prefix.py): a
    # prefill chunk starting there resumes after a prefix this sequence never computed.
    cached: int = 0
    shard: int | None = None  # split pages: the data shard the sequence is pinned to (checked against its row)
    grammar: object = None  # a grammar.matcher.Grammar: the sequence's structured-output constraint


@dataclasses.dataclass
class TokenScores:
    """Log-probabilities of a run of tokens: token_logprobs [T] (log p of each token where it was
    produced; NaN where nothing predicts it, a prompt's first token), token_ranks [T] (1 =
    likeliest), top_ids / top_logprobs [T, k] (the k likeliest tokens there, likeliest first)."""

    token_logprobs: np.ndarray
    token_ranks: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray

    def arrays(self) -> tuple[np.ndarray, ...]:
        return self.token_logprobs, self.token_ranks, self.top_ids, self.top_logprobs

    def __getitem__(self, i: slice) -> "TokenScores":
        return TokenScores(*(x[i] for x in self.arrays()))

    @staticmethod
    def pick(entries: tuple, index, k: int) -> "TokenScores":
        """Some of a device call's entries (chosen, rank, top ids, top logprobs; `index` into each),
        with the k likeliest kept."""
        chosen, rank, ids, lps = (x[index] for x in entries)
        return TokenScores(chosen, rank, ids[:, :k], lps[:, :k])

    @staticmethod
    def concat(parts: Sequence["TokenScores"], k: int = 0) -> "TokenScores":
        """The parts one after another (none: no tokens, k top entries each)."""
        if not parts:
            return TokenScores(np.zeros(0, np.float32), np.zeros(0, np.int32), np.zeros((0, k), np.int32),
                               np.zeros((0, k), np.float32))
        return TokenScores(*(np.concatenate(xs) for xs in zip(*(p.arrays() for p in parts))))


@dataclasses.dataclass
class RowOutput:
    tokens: list[int]  # newly committed tokens, cut at a stop id or max_tokens
    done: bool
    accept_lens: list[int]  # committed tokens per verify step in this call
    logprobs: TokenScores | None = None  # the tokens' own (top: the row's params.logprobs), when it asked
