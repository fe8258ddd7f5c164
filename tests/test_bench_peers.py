"""The honest roofline and the CPU peer of `python -m jaxspec.bench decode`.

The native multi-threaded read-bandwidth kernel (a tiny buffer: correctness, not
speed) and its bytes / seconds arithmetic; the llama.cpp peer against a fake
`llama_cpp` module, so its code path runs without llama-cpp-python; the line
printed when llama_cpp is missing. No timing assertions.
"""

from __future__ import annotations

import ctypes
import math
import sys
import types

import numpy as np
import pytest

from jaxspec.bench import common, decode
from jaxspec.native import bandwidth
from jaxspec.native.build import NativeKernelError

needs_kernel = pytest.mark.skipif(not bandwidth.available(), reason="no C++ compiler for the bandwidth kernel")


# --------------------------------------------------------------------------- #
# Read bandwidth
# --------------------------------------------------------------------------- #


@needs_kernel
@pytest.mark.parametrize("threads,huge_pages", [(1, True), (2, True), (3, True), (2, False)])
def test_native_read_bandwidth_reads_the_whole_buffer(threads, huge_pages):
    r = bandwidth.read_bandwidth(num_bytes=(4 << 20) + 1000, passes=3, threads=threads, huge_pages=huge_pages)
    assert math.isfinite(r.gb_per_s) and r.gb_per_s > 0
    assert len(r.seconds) == 3 and all(s > 0 for s in r.seconds)
    # Whole 256-byte blocks per thread, no more than asked, and every float (a 1.0) was summed.
    assert r.bytes_per_pass % (256 * threads) == 0 and (4 << 20) - 256 * threads < r.bytes_per_pass <= (4 << 20) + 1000
    assert r.checksum == r.bytes_per_pass / 4
    assert r.gb_per_s == pytest.approx(r.bytes_per_pass / min(r.seconds) / 1e9)


@needs_kernel
def test_native_read_bandwidth_rejects_a_buffer_too_small_to_split():
    with pytest.raises(NativeKernelError, match="bad arguments"):
        bandwidth.read_bandwidth(num_bytes=100, passes=1, threads=2)


def test_bandwidth_is_bytes_over_the_best_pass_in_gb_per_s():
    r = bandwidth.ReadBandwidth(bytes_per_pass=6_000_000_000, seconds=(0.2, 0.1, 0.3), threads=2, checksum=0.0)
    assert r.gb_per_s == 60.0  # 6e9 bytes / 0.1 s / 1e9
    assert bandwidth.gb_per_s(1 << 30, [0.5]) == (1 << 30) / 0.5 / 1e9


def test_ctypes_plumbing_against_a_fake_kernel(monkeypatch):
    """A C-callable stand-in for the kernel writes known bytes and per-pass seconds; the
    Python side must hand them back unchanged and do the arithmetic."""
    proto = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int64, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32,
                             ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_double),
                             ctypes.POINTER(ctypes.c_double))
    seen = {}

    def kernel(num_bytes, threads, passes, huge_pages, bytes_out, seconds_out, checksum_out):
        seen.update(num_bytes=num_bytes, threads=threads, passes=passes, huge_pages=huge_pages)
        bytes_out[0] = 1_000_000_000
        for i in range(passes):
            seconds_out[i] = 0.05 * (i + 1)  # best pass: 0.05 s
        checksum_out[0] = 250_000_000.0
        return 0

    fake = proto(kernel)
    monkeypatch.setattr(bandwidth, "_load", lambda cache_dir=None: fake)
    r = bandwidth.read_bandwidth(num_bytes=123 << 20, passes=4, threads=2)
    assert seen == {"num_bytes": 123 << 20, "threads": 2, "passes": 4, "huge_pages": 1}
    assert r.bytes_per_pass == 1_000_000_000 and r.seconds == pytest.approx((0.05, 0.10, 0.15, 0.20))
    assert bandwidth.measure_read_bandwidth(passes=4) == pytest.approx(20.0)  # 1e9 B / 0.05 s = 20 GB/s

    monkeypatch.setattr(bandwidth, "_load", lambda cache_dir=None: proto(lambda *a: -2))
    with pytest.raises(NativeKernelError, match="out of memory"):
        bandwidth.read_bandwidth(num_bytes=1 << 20, passes=1, threads=1)


def test_default_buffer_is_several_times_the_last_level_cache():
    n = bandwidth.default_num_bytes()
    assert bandwidth.MIN_BYTES <= n <= bandwidth.MAX_BYTES
    llc = bandwidth.last_level_cache_bytes()
    if llc:
        assert n >= min(bandwidth.MAX_BYTES, 8 * llc)


def test_roofline_uses_the_multi_threaded_figure_and_the_header_prints_both(monkeypatch):
    # Rounds read 30, 59, 45, 59, 50 GB/s: the best one counts; the rounds are spaced apart.
    figures = iter([30, 59, 45, 59, 50] * 2)
    monkeypatch.setattr(bandwidth, "read_bandwidth",
                        lambda passes=10: bandwidth.ReadBandwidth(next(figures) * 1_000_000, (0.001,), 2, 0.0))
    sleeps = []
    monkeypatch.setattr(common.time, "sleep", sleeps.append)
    monkeypatch.setattr(common, "measure_single_thread_bandwidth", lambda: 27e9)
    bw = common.measure_bandwidths()
    assert bw.multi == pytest.approx(59e9) and bw.single == 27e9 and bw.roofline == bw.multi
    header = bw.header()
    assert "59.0 GB/s multi-threaded" in header and "27.0 GB/s numpy/XLA sum (old figure" in header
    assert sleeps == [0.2] * 4
    assert common.measure_read_bandwidth() == pytest.approx(59e9)


def test_without_a_compiler_the_roofline_falls_back_with_a_note(monkeypatch, capsys):
    def no_compiler(passes=10):
        raise NativeKernelError("no C++ compiler found")

    monkeypatch.setattr(bandwidth, "read_bandwidth", no_compiler)
    monkeypatch.setattr(common, "measure_single_thread_bandwidth", lambda: 25e9)
    assert common.measure_read_bandwidth() == 25e9
    assert "no C++ compiler found" in capsys.readouterr().out
    bw = common.measure_bandwidths()
    assert bw.multi != bw.multi and bw.roofline == 25e9
    assert "25.0 GB/s numpy/XLA sum" in bw.header() and "no C++ compiler" in bw.header()


# --------------------------------------------------------------------------- #
# llama.cpp peer against a fake llama_cpp module
# --------------------------------------------------------------------------- #


class FakeQuantizeParams(ctypes.Structure):
    _fields_ = [("nthread", ctypes.c_int32), ("ftype", ctypes.c_int), ("allow_requantize", ctypes.c_bool)]


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def fake_llama_cpp(clock: FakeClock, step_s: float = 0.01) -> types.ModuleType:
    """The surface of llama_cpp the peer uses: Llama(...).reset/generate/close and
    llama_model_quantize. Each generated token advances the fake clock by step_s."""
    mod = types.ModuleType("llama_cpp")
    mod.LLAMA_FTYPE_ALL_F32 = 0
    mod.log = {"models": [], "generate": [], "tokens": [], "quantize": [], "closed": 0}

    class Llama:
        def __init__(self, model_path, **kw):
            mod.log["models"].append((model_path, kw))

        def reset(self):
            pass

        def generate(self, tokens, **kw):
            mod.log["generate"].append((list(tokens), kw))
            i = 0
            while True:
                clock.t += step_s
                mod.log["tokens"].append(i)
                yield 7
                i += 1

        def close(self):
            mod.log["closed"] += 1

    def llama_model_quantize(inp, out, params_ref):
        params = params_ref._obj
        mod.log["quantize"].append((inp, out, params.ftype, params.allow_requantize, params.nthread))
        with open(out, "wb") as f:
            f.write(b"F32 copy of " + inp)
        return 0

    mod.Llama = Llama
    mod.llama_model_quantize = llama_model_quantize
    mod.llama_model_quantize_default_params = FakeQuantizeParams
    return mod


def tiny_gguf(path, file_type: int = 3):
    """A real (tiny) GGUF: general.file_type 3 = MOSTLY_Q4_1, one 4x8 float tensor."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_file_type(file_type)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_llama_cpp_peer_with_a_fake_module(tmp_path, monkeypatch):
    clock = FakeClock()
    fake = fake_llama_cpp(clock)
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    monkeypatch.setattr(common.time, "perf_counter", clock)
    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path / "cache"))
    src = tiny_gguf(tmp_path / "tiny.Q4_1.gguf")
    prompts, n, reps = [[1, 2, 3], [4, 5]], 5, 2

    rows, notes = decode.llama_cpp_rows(str(src), prompts, n, reps, threads=2, jaxspec_tps=250.0, bandwidth=1e9)
    assert notes == []
    assert [r[0] for r in rows] == ["Q4_1", "F32"]
    # Timed: n tokens over the n - 1 single-token forwards after prefill (0.01 s each on the fake clock).
    tps = n / ((n - 1) * 0.01)
    for label, mib, got, jx, ratio, roof, of_roof, batched in rows:
        assert got == pytest.approx(tps) and jx == 250.0 and ratio == pytest.approx(250.0 / tps)
        assert batched != batched  # NaN: no batch prompts given, the parallel-sequence figure is not run
    assert rows[0][5] == pytest.approx(1e9 / common.gguf_weight_bytes(src))  # its own roofline, its own bytes

    # Both files loaded with the asked threads; greedy; the prompts as given; a warm-up, then reps passes.
    (m0, kw0), (m1, kw1) = fake.log["models"]
    assert m0 == str(src) and m1.endswith(".F32.gguf") and kw0["n_threads"] == 2 and kw0["verbose"] is False
    calls = fake.log["generate"]
    assert len(calls) == 2 * (1 + reps * len(prompts))
    assert [c[0] for c in calls[: 1 + reps * len(prompts)]] == [prompts[0]] + prompts * reps
    assert all(c[1]["top_k"] == 1 and c[1]["temp"] == 0.0 for c in calls)
    assert len(fake.log["tokens"]) == len(calls) * n  # exactly n tokens drawn per run, EOS never consulted
    assert fake.log["closed"] == 2

    # The F32 copy: llama.cpp's quantizer with ftype ALL_F32 and requantize allowed, cached under the jaxspec cache.
    ((inp, out, ftype, requant, nthread),) = fake.log["quantize"]
    assert inp == str(src).encode() and ftype == 0 and requant and nthread == 2
    assert out.decode().startswith(str(tmp_path / "cache" / "llama_cpp"))
    again = common.llama_cpp_f32_gguf(fake, src)
    assert str(again) == m1 and len(fake.log["quantize"]) == 1  # second call: the cached file


def test_llama_cpp_peer_reports_a_failed_conversion_and_keeps_the_shipped_row(tmp_path, monkeypatch):
    fake = fake_llama_cpp(FakeClock())
    fake.llama_model_quantize = lambda inp, out, params: 1
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path / "cache"))
    src = tiny_gguf(tmp_path / "tiny.gguf")
    rows, notes = decode.llama_cpp_rows(str(src), [[1, 2]], 3, 1, threads=1, jaxspec_tps=1.0, bandwidth=1e9)
    assert [r[0] for r in rows] == ["Q4_1"]
    assert len(notes) == 1 and "F32" in notes[0] and "returned 1" in notes[0]
    assert not list((tmp_path / "cache" / "llama_cpp").iterdir())  # no half-written file left behind


def test_llama_cpp_peer_skips_a_model_that_is_not_a_gguf(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", fake_llama_cpp(FakeClock()))
    rows, notes = decode.llama_cpp_rows(str(tmp_path), [[1]], 3, 1, 1, 1.0, 1e9)
    assert rows == [] and "not a GGUF" in notes[0]


def test_llama_cpp_missing_prints_one_line_with_the_install_command(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # makes `import llama_cpp` raise ImportError
    rows, notes = decode.llama_cpp_rows("default", [[1]], 3, 1, 1, 1.0, 1e9)
    assert rows == [] and len(notes) == 1
    decode.print_llama_cpp(rows, notes, 128)
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "not installed" in out[0] and "pip install llama-cpp-python" in out[0]


def test_llama_cpp_table_prints_rows(capsys):
    decode.print_llama_cpp([["Q4_1", "92", 200.0, 110.0, 0.55, 600.0, "33%"]], [], 128)
    out = capsys.readouterr().out
    assert "| Q4_1 | 92 | 200.00 | 110.00 | 0.55 | 600.00 | 33% |" in out
