"""XLA flags for the test processes and for the subprocesses the tests start.

The suite compiles thousands of small programs and runs most of them a few times, so XLA:CPU's LLVM
optimisation passes are most of its time. At `--xla_backend_optimization_level=0` a tiny engine's
compile-and-generate (plain and n-gram) took 12.6-14.0 s against 19.1-19.6 s at the default;
test_gguf_blocks' int8 case (the real model) 25 s against 79 s alone; tests/test_smollm.py 498 s
against 626 s on a busy machine (2026-12-06). Results do not change: fast-math is off at every
level (no reassociation), and the matmuls are library calls whatever the level. The product keeps
XLA's default; only tests set this.

Tried and dropped (2026-12-07): `--xla_cpu_use_fusion_emitters=false` (XLA:CPU's older elemental
emitter) cut backend compile time ~30% on tiny-model files (tests/test_spec_loop.py's standalone
rows: 25-28 s against 36-46 s), but the whole suite on 2 cores ran 2,029 s against 1,597 s: the
real model's tests run its slower code (tests/test_smollm.py 343 against 219 s of test time,
tests/test_gguf_blocks.py 146 against 52). A shared persistent compilation cache for the run was
slower too (duplicate programs across files are few; writing every entry cost more than the hits
saved).
"""

from __future__ import annotations

import os

TEST_FLAGS = ("--xla_backend_optimization_level=0",)


def with_test_flags(flags: str = "") -> str:
    """`flags` (an XLA_FLAGS value) with the test flags added where the same flag is not set already."""
    have = {f.split("=")[0] for f in flags.split()}
    return " ".join([*flags.split(), *(f for f in TEST_FLAGS if f.split("=")[0] not in have)])


def subprocess_env(host_devices: int, **extra: str) -> dict[str, str]:
    """This process's environment for a subprocess with `host_devices` CPU devices (XLA fixes the
    count when a process starts, hence a subprocess), and the test flags."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    flags.append(f"--xla_force_host_platform_device_count={host_devices}")
    return {**os.environ, **extra, "XLA_FLAGS": with_test_flags(" ".join(flags)), "JAX_PLATFORMS": "cpu"}
