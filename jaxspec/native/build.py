"""Build, load and register the native XLA:CPU kernels; the policy that turns them on.

Pallas has no compiled CPU backend (interpret mode only), so the CPU kernels are
C++ behind `jax.ffi`. They are compiled on first use with the machine's C++
compiler (`$CXX`, else g++/c++/clang++) into the jaxspec cache, keyed by source,
jax/jaxlib version and CPU (the library is built with -march=native), and
registered as custom-call targets. Without a compiler the engine keeps XLA's own
ops (`engine.cpu_kernels = "auto"`) or fails with a clear error (`"native"`).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib

HERE = Path(__file__).parent
SOURCES = (HERE / "packed_matmul.cc", HERE / "block_matmul.cc", HERE / "paged_attention.cc")
HEADERS = (HERE / "parallel.h", HERE / "tile_gemm.h")
# custom-call target -> exported handler symbol
TARGETS = {"jaxspec_packed_matmul": "JaxspecPackedMatmul", "jaxspec_packed_matmul_i8": "JaxspecPackedMatmulI8",
           "jaxspec_block_matmul_q4": "JaxspecBlockMatmulQ4", "jaxspec_block_matmul_q8": "JaxspecBlockMatmulQ8",
           "jaxspec_paged_attention": "JaxspecPagedAttention"}


class NativeKernelError(RuntimeError):
    """The native CPU kernels could not be built or loaded, or cannot be used here (message says why)."""


def _compiler() -> str | None:
    for cand in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if cand and shutil.which(cand):
            return cand
    return None


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def library_path(cache_dir: str | Path | None = None) -> Path:
    from jaxspec.paths import cache_root

    parts = [p.read_bytes() for p in SOURCES + HEADERS]
    parts += [jax.__version__.encode(), jaxlib.__version__.encode(), platform.machine().encode(),
              _cpu_signature().encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    return cache_root(cache_dir) / "native" / key / "libjaxspec_native.so"


def compile_library(lib: Path, sources, flags, what: str, timeout: int = 600) -> Path:
    """Compile `sources` into the shared library `lib` unless it exists; returns `lib`.

    Built beside the target and renamed, so concurrent processes never load a
    half-written file. Raises NativeKernelError naming `what` and the command.
    """
    if lib.is_file():
        return lib
    cxx = _compiler()
    if cxx is None:
        raise NativeKernelError(f"no C++ compiler found (set $CXX or install g++) to build {what}")
    lib.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
    os.close(fd)
    cmd = [cxx, "-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w", *flags, *map(str, sources),
           "-o", tmp]
    try:
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise NativeKernelError(f"building {what} failed ({' '.join(cmd)}): {e}") from None
        if proc.returncode != 0:
            raise NativeKernelError(f"building {what} failed ({' '.join(cmd)}): {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def build(cache_dir: str | Path | None = None) -> Path:
    """Compile the kernel library once per (sources, jax, CPU); returns its path."""
    return compile_library(library_path(cache_dir), SOURCES, [f"-I{jax.ffi.include_dir()}"], "the native CPU kernels")


_lock = threading.Lock()
_state: dict[str, object] = {}


def ensure_registered(cache_dir: str | Path | None = None) -> None:
    """Build (if needed), load and register every target once per process; raises NativeKernelError."""
    with _lock:
        if _state.get("registered"):
            return
        if "error" in _state:
            raise NativeKernelError(str(_state["error"]))
        try:
            lib = ctypes.cdll.LoadLibrary(str(build(cache_dir)))
            for target, symbol in TARGETS.items():
                jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
        except (OSError, AttributeError, NativeKernelError) as e:
            err = e if isinstance(e, NativeKernelError) else NativeKernelError(f"loading the native CPU kernels failed: {e}")
            _state["error"] = err
            raise err from None
        _state["registered"] = True


def available(cache_dir: str | Path | None = None) -> bool:
    try:
        ensure_registered(cache_dir)
        return True
    except NativeKernelError:
        return False


_warned: set[str] = set()


def use_native_kernels(mode: str, dtype, mesh) -> bool:
    """Policy for `engine.cpu_kernels` (auto | native | xla); see config.EngineSection.

    The kernels are float32, XLA:CPU only, and opaque to GSPMD (a sharded operand
    would be gathered around them), so "auto" takes them only on one CPU device."""
    if mode == "xla":
        return False
    why_not = None
    if jax.default_backend() != "cpu":
        why_not = f"the backend is {jax.default_backend()}, not cpu"
    elif jnp.dtype(dtype) != jnp.float32:
        why_not = f"the model dtype is {jnp.dtype(dtype).name}, not float32"
    elif mesh is not None:
        why_not = "a device mesh is in use"
    if why_not is not None:
        if mode == "native":
            raise NativeKernelError(f"engine.cpu_kernels = native is impossible: {why_not}")
        return False
    try:
        ensure_registered()
    except NativeKernelError as e:
        if mode == "native":
            raise
        if "auto" not in _warned:
            _warned.add("auto")
            print(f"warning: {e}; using XLA's own ops on CPU (engine.cpu_kernels = xla)", file=sys.stderr)
        return False
    return True
