"""Multi-host serving: process 0 runs HTTP and the scheduler; every process runs the same device calls.

A mesh that spans processes is SPMD across them: each process must launch the
same executable with the same inputs, in the same order. The leader wraps its
ModelRunner in `LeaderRunner`, which broadcasts each call's bucket key and host
inputs (`multihost_utils.broadcast_one_to_all`) and then runs it; followers sit
in `follow`, receive, and run the same bucket. Compilation and the start-up
calibration need no messages: every process does them in the same order on
the same dummy inputs.
"""

from __future__ import annotations

import numpy as np

from jaxspec.engine import host_io
from jaxspec.engine.runner import ModelRunner

_OPS = ("stop", "prefill", "decode")


def _broadcast(tree):
    import jax
    from jax.experimental import multihost_utils

    # bool does not survive the psum-based broadcast; ship it as int32.
    packed = jax.tree.map(lambda x: x.astype(np.int32) if x.dtype == bool else x, tree)
    out = multihost_utils.broadcast_one_to_all(packed)
    return jax.tree.map(lambda ref, x: np.asarray(x).astype(ref.dtype), tree, out)


def _header(key: tuple) -> np.ndarray:
    if key[0] == "prefill":
        return np.array([1, key[1], key[2], key[3]], np.int32)
    if key[0] == "decode":
        return np.array([2, key[1], key[2], key[3]], np.int32)
    return np.zeros(4, np.int32)


def input_template(runner: ModelRunner, key: tuple) -> dict:
    """Host inputs of a bucket with every row padding: built by the runner's own packers, so a
    follower's template has whatever inputs the leader's calls have (a broadcast needs both trees
    alike; only shapes and dtypes matter)."""
    if key[0] == "prefill":
        _, b, c, ctx = key
        return host_io.pack_prefill([None] * b, b=b, c=c, ctx=ctx, width=runner.table_width(ctx),
                                    num_slots=runner.num_slots, max_context=runner.max_context,
                                    check=runner._check_shard)[1]
    _, k, b, ctx = key
    return runner.decode_inputs(k, [None] * b, ctx)[1]


class LeaderRunner:
    """The scheduler's runner on process 0: every device call is announced to the followers first."""

    def __init__(self, runner: ModelRunner):
        self._runner = runner

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def _announce(self, key: tuple, inputs: dict) -> None:
        _broadcast(_header(key))
        _broadcast(inputs)

    def prefill(self, chunks):
        return self.prefill_scored(chunks)[0]

    def prefill_scored(self, chunks):
        key, inputs = self._runner.prefill_inputs(chunks)
        self._announce(key, inputs)
        return self._runner.prefill_outputs(chunks, self._runner.run_prefill(key, inputs))

    def decode(self, k, rows, ctx, iters=None):
        key, inputs = self._runner.decode_inputs(k, rows, ctx, iters)
        self._announce(key, inputs)
        return self._runner.decode_outputs(rows, self._runner.run_decode(key, inputs))

    def stop(self) -> None:
        """Release the followers (they return from `follow`)."""
        _broadcast(_header(("stop",)))


def follow(runner: ModelRunner) -> int:
    """Run the leader's device calls until it says stop; returns how many ran."""
    calls = 0
    while True:
        op, a, b, c = (int(v) for v in _broadcast(np.zeros(4, np.int32)))
        if _OPS[op] == "stop":
            return calls
        key = ("prefill", a, b, c) if _OPS[op] == "prefill" else ("decode", a, b, c)
        inputs = _broadcast(input_template(runner, key))
        if key[0] == "prefill":
            runner.run_prefill(key, inputs)
        else:
            runner.run_decode(key, inputs)
        calls += 1
