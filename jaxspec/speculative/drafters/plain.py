"""The k = 0 drafter: plain decoding as the speculative loop with nothing drafted.

Every iteration verifies the root alone (a one-token forward) and commits the
bonus token, which is plain decoding's token under every verify rule: the
greedy argmax, or the coupled race at that position, which is what plain
sampling draws (`sampling.race_filtered`). So there is one loop, one prefill
and one sampler whether speculation is on or off; this drafter is what
`spec.algorithm = "none"` builds, and what the offline engine's adaptive
policy runs when it picks plain decoding.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxspec.speculative.algorithm import AlgorithmInfo, register
from jaxspec.speculative.protocol import DrafterBase
from jaxspec.speculative.types import Proposal


class PlainDrafter(DrafterBase):
    """Proposes the root only: no state, no cache, no features."""

    def propose(self, params, state, s) -> Proposal:
        # s.history [B, C] int32; the root is the last committed token, at hist_len - 1.
        root = jnp.take_along_axis(s.history, jnp.maximum(s.hist_len - 1, 0)[:, None], axis=1)
        return Proposal(root, None, None, state)

    def __repr__(self) -> str:
        return "PlainDrafter()"


register("none", AlgorithmInfo(speculative=False, description="plain autoregressive decode"),
         lambda **_: PlainDrafter(), builtin=True)
