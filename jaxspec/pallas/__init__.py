"""Pallas kernels, each beside its pure-jnp reference.

Dispatch rule, shared by every kernel: on GPU and TPU the compiled kernel runs;
on CPU the jnp reference runs (Pallas on XLA:CPU exists only in interpret mode,
10-120x slower than jnp). Tests call kernels with `interpret=True` on CPU and
hold them equal to the reference.
"""

from __future__ import annotations

import os

import jax


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
    platform = jax.default_backend()
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
