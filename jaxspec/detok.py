"""Incremental token -> text for streaming, and stop strings across token boundaries."""

from __future__ import annotations

from typing import Sequence

_CONTEXT_TOKENS = 5  # prompt tokens kept as left context (SentencePiece drops a leading space otherwise)


class IncrementalDetokenizer:
    """Text deltas for a growing token list, never splitting a multi-byte character.

    The delta is the decode of a short window (from `prefix` to the end) minus
    the decode of its already-emitted part (`prefix` to `read`). While the tail
    decodes to U+FFFD (a UTF-8 sequence cut between tokens) nothing is emitted;
    the next token completes it. When the sequence ends there first (`final`,
    e.g. cut by max_tokens) the unfinished character is dropped, not sent as
    U+FFFD. Special tokens are skipped.
    """

    def __init__(self, tokenizer, prompt_ids: Sequence[int]):
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.prefix = 0
        self.read = len(self.ids)

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, new_ids: Sequence[int], final: bool = False) -> str:
        self.ids.extend(int(t) for t in new_ids)
        before = self._decode(self.ids[self.prefix: self.read])
        full = self._decode(self.ids[self.prefix:])
        if final:  # no token will complete it (a U+FFFD the model really wrote at the very end goes too)
            full = full.rstrip("\ufffd")
        if len(full) <= len(before) or full.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return full[len(before):]


class StopStringMatcher:
    """Finds stop strings in streamed text, holding back a tail that may begin one.

    `feed(delta)` returns (text safe to send, stopped). The output is cut at the
    start of the stop string that completes first (earliest end; on a tie the
    earliest start), whatever the split into deltas. Text that could still be
    the start of a stop string is held until the next delta decides; `flush()`
    releases it when the sequence ends for another reason.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""

    def feed(self, delta: str, armed: bool = True) -> tuple[str, bool]:
        """`armed` False: text of tokens before min_tokens, passed through unmatched (vLLM checks no
        stop string there either)."""
        if not self.stops or not armed:
            return self.flush() + delta, False
        text = self.pending + delta
        hits = [(i + len(s), i) for s, i in ((s, text.find(s)) for s in self.stops) if i >= 0]
        if hits:  # the stop string completed first wins, as it would token by token
            self.pending = ""
            return text[: min(hits)[1]], True
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        self.pending = text[len(text) - hold:] if hold else ""
        return text[: len(text) - hold], False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out
