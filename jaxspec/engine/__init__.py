"""The engine: one executor under the CLI, `jaxspec.LLM` and the server.

    types.py      Request / Result (offline), RowInput / RowOutput (a sequence's slice of a call)
    runner.py     ModelRunner: weights, paged caches, drafter slot store, the compiled prefill and
                  decode programs per bucket; plain decoding is its k = 0 plan
    assemble.py   Config + loaded model -> ModelRunner (offline, or serving)
    offline.py    Engine: whole batches, one prefill and one run-to-completion decode call each
    adaptive.py   the draft-length policies (per server call, per offline batch bucket)
    phases.py     --profile-phases: a decode call with its phases jitted apart and timed
    core.py       the chunked prefill and loop-state builder the runner compiles
    device_sampling.py  the [B] sampling arrays and their one packer

The scheduler (`jaxspec.serve.scheduler`) drives the same `ModelRunner` one bounded call at a
time; `Engine` drives it one whole batch at a time.
"""

from jaxspec.engine.offline import Engine
from jaxspec.engine.types import Request, RequestError, Result, bucket_for

__all__ = ["Engine", "Request", "RequestError", "Result", "bucket_for"]
