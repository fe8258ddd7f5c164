"""Multi-threaded streaming-read bandwidth (bandwidth.cc), the roofline of the CPU benchmarks.

The old roofline figure, the best of a numpy and an XLA sum, does not measure the
peak: numpy sums on one thread (~24 GB/s on the 2-core EPYC), and whether XLA
splits its reduce across threads varies from run to run (47-76 GB/s), while
llama.cpp's F32 decode alone streams ~59 GB/s. This sums a buffer 16x the
last-level cache on every core at once, from transparent huge pages, best of N
passes (81-89 GB/s there when the machine was quiet, though some runs
read ~50: the caller takes the best of a few rounds spaced apart). The kernel is plain C++
loaded with ctypes, compiled on first use like the XLA kernels (build.py) into
its own small library, so it works whether or not those kernels build.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import os
import platform
import threading
from pathlib import Path

from jaxspec.native.build import NativeKernelError, _cpu_signature, compile_library

SOURCE = Path(__file__).parent / "bandwidth.cc"
MIN_BYTES, MAX_BYTES = 256 << 20, 1 << 30


@dataclasses.dataclass(frozen=True)
class ReadBandwidth:
    bytes_per_pass: int  # what one pass read (all threads together)
    seconds: tuple[float, ...]  # each pass, first thread's start to last thread's end
    threads: int
    checksum: float  # sum of the buffer of ones: equals bytes_per_pass / 4

    @property
    def gb_per_s(self) -> float:
        """Best pass: bytes / seconds / 1e9."""
        return gb_per_s(self.bytes_per_pass, self.seconds)


def gb_per_s(bytes_per_pass: int, seconds) -> float:
    return bytes_per_pass / min(seconds) / 1e9


def last_level_cache_bytes() -> int:
    """Largest CPU cache reported by sysfs (0 when unknown)."""
    best = 0
    for size in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = size.read_text().strip().upper()
            mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            best = max(best, int(text.rstrip("KMG")) * mult)
        except (OSError, ValueError):
            continue
    return best


def default_num_bytes() -> int:
    """16x the last-level cache, clamped to [256 MiB, 1 GiB]."""
    return max(MIN_BYTES, min(MAX_BYTES, 16 * last_level_cache_bytes()))


def default_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def library_path(cache_dir: str | Path | None = None) -> Path:
    from jaxspec.paths import cache_root

    key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), platform.machine().encode(),
                                     _cpu_signature().encode()])).hexdigest()[:16]
    return cache_root(cache_dir) / "native" / key / "libjaxspec_bandwidth.so"


def build(cache_dir: str | Path | None = None) -> Path:
    """Compile bandwidth.cc once per (source, CPU); raises NativeKernelError."""
    return compile_library(library_path(cache_dir), [SOURCE], ["-pthread"], "the bandwidth kernel", timeout=300)


_lock = threading.Lock()
_lib: dict[str, object] = {}


def _load(cache_dir=None):
    with _lock:
        if "fn" not in _lib:
            try:
                fn = ctypes.CDLL(str(build(cache_dir))).jaxspec_read_bandwidth
            except (OSError, AttributeError) as e:
                raise NativeKernelError(f"loading the bandwidth kernel failed: {e}") from None
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_int64, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, ctypes.POINTER(ctypes.c_int64),
                           ctypes.POINTER(ctypes.c_double), ctypes.POINTER(ctypes.c_double)]
            _lib["fn"] = fn
        return _lib["fn"]


def available(cache_dir=None) -> bool:
    try:
        _load(cache_dir)
        return True
    except NativeKernelError:
        return False


def read_bandwidth(num_bytes: int | None = None, passes: int = 10, threads: int | None = None,
                   huge_pages: bool = True, cache_dir=None) -> ReadBandwidth:
    """Run the kernel: `passes` streaming sums of ~`num_bytes` on `threads` threads, the
    buffer advised onto transparent huge pages unless `huge_pages` is False."""
    num_bytes = default_num_bytes() if num_bytes is None else int(num_bytes)
    threads = default_threads() if threads is None else int(threads)
    fn = _load(cache_dir)
    got, checksum = ctypes.c_int64(0), ctypes.c_double(0.0)
    secs = (ctypes.c_double * passes)()
    rc = fn(num_bytes, threads, passes, int(huge_pages), ctypes.byref(got), secs, ctypes.byref(checksum))
    if rc != 0:
        why = {-1: "bad arguments (buffer smaller than 256 bytes per thread?)", -2: "out of memory",
               -3: "could not start the threads"}.get(rc, f"error {rc}")
        raise NativeKernelError(f"the bandwidth kernel failed: {why} ({num_bytes} bytes, {threads} threads)")
    return ReadBandwidth(int(got.value), tuple(secs), threads, checksum.value)


def measure_read_bandwidth(num_bytes: int | None = None, passes: int = 10, threads: int | None = None) -> float:
    """Best-of-`passes` multi-threaded streaming-read bandwidth in GB/s (1e9 bytes/s).

    Raises NativeKernelError when there is no C++ compiler or the kernel fails."""
    return read_bandwidth(num_bytes, passes, threads).gb_per_s


__all__ = ["ReadBandwidth", "available", "default_num_bytes", "gb_per_s", "measure_read_bandwidth", "read_bandwidth"]
