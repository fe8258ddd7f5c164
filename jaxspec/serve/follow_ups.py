"""Follow-ups: the next request a client sends as soon as its answer ends.

A client at a fixed concurrency (a chat agent's next turn, a tool loop, a benchmark's next
request) sends its next request a few ms after an answer ends (5-10 ms median on the 2-core CPU,
HTTP included). The scheduler's next call has started by then; a full decode call (4 iterations,
~150 ms at batch 8) or a prefill call (~0.2 s) is waited out before that request's prefill. Two
rules, both off at 0 (docs/serving.md, scheduler steps 0 and 4):

* window (`serve.follow_up_window`): for that long after an end, decode calls run `yield_steps`
  iterations until as many requests have arrived as ended;
* grace (`serve.follow_up_grace`, counted from the latest end, within the window): the next call
  waits for them to reach the inbox, so they join it.

One request, one follow-up: the `n` samples (and prompts) of a request count once, when the last
ends. Aborted requests count none (a disconnected client sends nothing after).
"""

from __future__ import annotations

import threading
import time
from typing import Callable


class FollowUps:
    def __init__(self, window: float = 0.0, grace: float = 0.0):
        self.window = window
        self.grace = grace
        self.expected = 0  # ended lately, their client's next request not arrived yet
        self.until = 0.0  # perf_counter when the window closes
        self.last_end = 0.0  # perf_counter of the latest end (the grace counts from it)
        self.num_waits = 0  # steps held for a follow-up (tests)

    def ended(self) -> None:
        """A request's last sample ended (not aborted)."""
        if not self.window:
            return
        now = time.perf_counter()
        self.expected = 1 + (self.expected if now < self.until else 0)
        self.last_end, self.until = now, now + self.window

    def arrived(self) -> None:
        self.expected = max(0, self.expected - 1)

    def due(self) -> bool:
        """Follow-ups are expected and the window is open: decode calls stay short."""
        return self.expected > 0 and time.perf_counter() < self.until

    def wait(self, queued: Callable[[], int], wake: threading.Event, stop: threading.Event) -> bool:
        """Hold the caller until `queued()` (requests in the inbox) covers the follow-ups expected, for
        at most `grace` after the latest end; `wake` is set on every submission. True: it held."""
        if not self.grace or self.expected <= 0:
            return False
        end = min(self.last_end + self.grace, self.until)
        waited = False
        while queued() < self.expected and not stop.is_set():
            left = end - time.perf_counter()
            if left <= 0:
                break
            waited = True
            wake.wait(left)
            wake.clear()
        self.num_waits += waited
        return waited
