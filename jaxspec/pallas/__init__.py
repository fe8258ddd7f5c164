"""Pallas kernels, each beside its pure-jnp reference.

Dispatch rule, shared by every kernel: on GPU and TPU the compiled kernel runs;
on CPU the jnp reference runs (Pallas on XLA:CPU exists only in interpret mode,
10-120x slower than jnp). Tests call kernels with `interpret=True` on CPU and
hold them equal to the reference. The platform is this process's backend, or
the one `lowering_for` names while tracing for another platform from this host
(`python -m jaxspec.bench lower`), so a lowering shows exactly what would run.
"""

from __future__ import annotations

import contextlib
import contextvars
import os

import jax

# Set by `lowering_for`: the platform being lowered for from another host
# (`python -m jaxspec.bench lower`), so dispatchers pick that platform's kernels.
_LOWERING_FOR: contextvars.ContextVar[str | None] = contextvars.ContextVar("jaxspec_lowering_for", default=None)
# jax lowering-platform names -> the backend names kernels are chosen by.
_BACKEND_OF = {"cuda": "gpu", "rocm": "gpu", "gpu": "gpu", "tpu": "tpu", "cpu": "cpu"}


@contextlib.contextmanager
def lowering_for(platform: str):
    """Trace under this to choose kernels for `platform` ("tpu", "cuda", ...) instead of this host's backend.

    Only tracing reads it: lower the traced function with
    `lowering_platforms=(platform,)`; running it here would run the wrong kernels."""
    if platform not in _BACKEND_OF:
        raise ValueError(f"unknown platform {platform!r}; expected one of {sorted(_BACKEND_OF)}")
    token = _LOWERING_FOR.set(_BACKEND_OF[platform])
    try:
        yield
    finally:
        _LOWERING_FOR.reset(token)


def target_platform() -> str:
    """The backend kernels are chosen for: the one `lowering_for` names, else this process's."""
    return _LOWERING_FOR.get() or jax.default_backend()


def kernel_backend() -> str | None:
    """The platform a compiled Pallas kernel would target, or None on CPU.

    `JAXSPEC_KERNELS=ref` forces the jnp references everywhere (debugging);
    `JAXSPEC_KERNELS=interpret` forces interpret-mode kernels (slow; tests only).
    """
    mode = os.environ.get("JAXSPEC_KERNELS", "auto")
    if mode == "ref":
        return None
    if mode == "interpret":
        return "interpret"
    platform = target_platform()
    return platform if platform in ("gpu", "tpu") else None


def use_kernel(platforms: tuple[str, ...] = ("gpu", "tpu")) -> bool:
    """Whether a dispatcher should call a kernel that compiles for `platforms`.

    Interpret mode runs any kernel. A kernel that does not lower on some
    accelerator (the Triton-only ones on TPU) passes the platforms it does
    lower on, and its dispatcher runs the reference elsewhere: the fallback is
    the dispatcher's business, so a kernel never imports its reference.
    """
    backend = kernel_backend()
    return backend == "interpret" or backend in platforms


def interpret_mode() -> bool:
    return kernel_backend() == "interpret"
