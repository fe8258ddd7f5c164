"""The scheduler's timeline (`serve.trace`): where a server's time goes, call by call.

Metrics give totals and histograms; finding why time to first token or throughput moved needs the
order of things: which calls a request waited through before its first token, and how long the host
took between calls. With `serve.trace` set to a directory, the server writes
`<dir>/trace-<pid>.jsonl`: a `start` line (the settings that tell two servers apart), then one line
per device call, per held step (the follow-up grace) and per finished request, times in
`time.perf_counter` seconds. `python -m jaxspec.bench trace DIR` summarizes them
(`jaxspec/bench/trace.py`). Off (the default), every method is a no-op.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path


class Trace:
    def __init__(self, directory: str = "", **settings):
        self._file = None
        if directory:
            self.path = Path(directory) / f"trace-{os.getpid()}.jsonl"
            try:
                Path(directory).mkdir(parents=True, exist_ok=True)
                self._file = open(self.path, "w", buffering=1)  # line-buffered: readable while the server runs
            except OSError as e:  # the server's start-up prints OSErrors as "error: ..." and exits 2
                raise OSError(f"serve.trace: cannot write {self.path}: {e.strerror or e}") from None
            self._write({"ev": "start", **settings})

    def _write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")

    def call(self, kind: str, t0: float, t1: float, seqs, **info) -> None:
        """A device call ("prefill" / "decode") or a held step ("wait") from t0 to t1 over these sequences."""
        if self._file is not None:
            self._write({"ev": kind, "t0": t0, "t1": t1, "seqs": [s.seq_id for s in seqs], **info})

    def finished(self, seq) -> None:
        if self._file is not None:
            self._write({"ev": "request", "id": seq.seq_id, "end": time.perf_counter(), "arrival": seq.arrival,
                         "admitted": seq.admitted_time, "first_token": seq.first_token_time, "prompt": len(seq.prompt_ids),
                         "cached": seq.cached_tokens, "generated": seq.num_generated, "reason": seq.finish_reason,
                         "preemptions": seq.num_preemptions})
