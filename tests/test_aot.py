"""Stored executables (jaxspec/aot.py): a second engine of the same configuration loads its
buckets without tracing, emits the same tokens, and any change of configuration, input shape or
source is another key; a damaged file is compiled again."""

from __future__ import annotations

import numpy as np
import pytest

from jaxspec import aot
from jaxspec.config import EngineSection, SpecSection
from jaxspec.engine import Engine, Request
from jaxspec.sampling_params import SamplingParams

ECFG = EngineSection(max_batch_size=2, batch_buckets=(2,), max_context=64, length_buckets=(16, 64), page_size=4)


@pytest.fixture
def store(tmp_path, monkeypatch):
    """The store in tmp_path, and a count of the real compiles (misses)."""
    monkeypatch.setattr(aot, "store_dir", lambda: tmp_path)
    calls = []
    real = aot._compile

    def counting(build, fresh=False):
        calls.append(fresh)
        return real(build, fresh)

    monkeypatch.setattr(aot, "_compile", counting)
    return tmp_path, calls


def reqs():
    rng = np.random.default_rng(0)
    return [Request([int(t) for t in rng.integers(3, 200, 7)], SamplingParams(max_tokens=10, temperature=t), seed=5)
            for t in (0.0, 1.0)]


def run(model, spec=None, ecfg=ECFG):
    return [r.output_ids for r in Engine(model.params, model.config, ecfg, progress=False, spec=spec).generate(reqs())]


@pytest.fixture(scope="module")
def llama(tiny_dirs):
    from jaxspec.models.loading import load_model

    return load_model(str(tiny_dirs["llama"][0]), progress=False)


def test_second_engine_loads_every_bucket_and_emits_the_same_tokens(llama, store, monkeypatch):
    d, calls = store
    spec = SpecSection(algorithm="ngram", num_draft_tokens=4)
    plain_ref = run(llama)  # misses: compiled and stored
    spec_ref = run(llama, spec)
    first = len(calls)
    assert first == 4 and len(list(d.glob("*.exe"))) == 4  # prefill + decode, plain and speculative
    assert run(llama) == plain_ref and run(llama, spec) == spec_ref
    assert len(calls) == first  # no compile: all four loaded
    # Another configuration is another key: a wider context bucket, another draft length.
    run(llama, spec, EngineSection(**{**ECFG.__dict__, "length_buckets": (16, 32, 64)}))
    assert len(calls) > first
    n = len(calls)
    assert run(llama, SpecSection(algorithm="ngram", num_draft_tokens=3))[0] == plain_ref[0]  # greedy row: exact
    assert len(calls) > n


def test_source_change_and_damaged_file_compile_again(llama, store, monkeypatch, caplog):
    d, calls = store
    ref = run(llama)
    n = len(calls)
    for f in d.glob("*.exe"):
        f.write_bytes(b"garbage")
    assert run(llama) == ref
    assert len(calls) == 2 * n and "did not load" in caplog.text
    monkeypatch.setattr(aot, "source_fingerprint", lambda: "another source tree")
    assert run(llama) == ref
    assert len(calls) == 3 * n


def test_the_store_is_off_unless_enabled_and_under_the_suite(monkeypatch, tmp_path):
    monkeypatch.setattr(aot.jax, "config", type("C", (), {"jax_compilation_cache_dir": str(tmp_path)})())
    monkeypatch.setitem(aot._ENABLED, "on", False)
    assert aot.store_dir() is None
    aot.enable()
    monkeypatch.setenv("JAXSPEC_EXECUTABLE_CACHE", "off")
    assert aot.store_dir() is None
    monkeypatch.delenv("JAXSPEC_EXECUTABLE_CACHE")
    assert aot.store_dir() == tmp_path / "executables"


_STEP = """
import sys, jax, jax.numpy as jnp
from jaxspec import aot
jax.config.update("jax_compilation_cache_dir", sys.argv[2])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
aot.enable()

def f(x, y):  # fusions (broadcast, compare, select) that XLA:CPU resolves by name at run time
    return jnp.where(x[:, None] > y[None, :], jnp.exp(x[:, None] * y[None, :]), 0.0).sum(1)

x, y = jnp.arange(64.0), jnp.arange(64.0) / 3
if sys.argv[1] == "drop":  # the store is lost (a source change gives every bucket a new key)
    import pathlib
    [f.unlink() for f in pathlib.Path(sys.argv[2], "executables").glob("*.exe")]
    sys.exit()
if sys.argv[1] != "load":
    print(jax.jit(f)(x, y)[1])  # "warm" fills XLA's persistent cache; "store" runs the program loaded from it
if sys.argv[1] != "warm":
    print(aot.compile_cached(("f",), lambda: jax.jit(f).trace(x, y))(x, y)[1])
"""


def test_an_executable_stored_after_xlas_cache_loaded_it_runs_in_the_next_process(tmp_path):
    """The server's 'Function broadcast_compare_fusion not found' (2026-12-03): a process that ran a
    program from XLA's persistent cache and then stored it wrote an executable without its object
    code, and the next process that loaded it failed mid-request. Then the same after the store is
    lost: the second fresh compile read back the XLA cache entry the first one wrote (every stored
    prefill failed after a source change, 2026-12-04). Positive control: the store file exists, so
    the loading process really loaded it rather than compiling."""
    import os
    import subprocess
    import sys

    script = tmp_path / "step.py"
    script.write_text(_STEP)
    env = {**os.environ, "JAXSPEC_EXECUTABLE_CACHE": "on"}
    outs = []
    for step in ("warm", "store", "load", "drop", "store", "load"):
        r = subprocess.run([sys.executable, str(script), step, str(tmp_path / "xla")], capture_output=True,
                           text=True, env=env, timeout=300, cwd=os.path.dirname(os.path.dirname(__file__)))
        assert r.returncode == 0, f"{step}: {r.stderr[-2000:]}"
        outs.append(r.stdout.split())
        if step == "store":
            assert len(list((tmp_path / "xla" / "executables").glob("*.exe"))) == 1
    assert outs[2] == outs[1][1:] == outs[1][:1] == outs[0] == outs[4][1:] == outs[5]
