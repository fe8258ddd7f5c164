"""Compiled bucket executables kept on disk, found again without tracing.

XLA's persistent compilation cache (`paths.enable_compilation_cache`) skips the XLA compile of
a program it has seen, but it is keyed by the lowered program, so every start still traces and
lowers every bucket in Python: about 5 s of the CLI's start and most of the server's. Here a
bucket's compiled executable is serialized (`jax.experimental.serialize_executable`) under a key
computed without tracing:
- the source of the jaxspec package (every .py, .cc and .h file), jax and jaxlib versions,
  XLA_FLAGS and the devices;
- what the caller says shapes the program: the bucket key, the configs, the drafter;
- the abstract inputs: tree structure, shapes, dtypes and shardings of every argument.

Any change to any of these is another key, so a stale executable is never loaded. A file that
does not load (another jaxlib wrote it, truncated) is compiled again and rewritten. The store
lives beside XLA's cache and is off when that cache is off.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import pickle
from pathlib import Path
from typing import Any, Callable

import jax

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1)
def source_fingerprint() -> str:
    """sha256 over the package's source files (path and bytes), jax/jaxlib versions and XLA_FLAGS."""
    import jaxlib

    root = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for f in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".cc", ".h") and p.is_file()):
        h.update(str(f.relative_to(root)).encode())
        h.update(f.read_bytes())
    env = {k: os.environ.get(k, "") for k in ("XLA_FLAGS", "JAXSPEC_KERNELS")}
    h.update(f"jax={jax.__version__} jaxlib={jaxlib.__version__} {sorted(env.items())}".encode())
    return h.hexdigest()


def code_of(obj: Any) -> str:
    """sha256 of the source file defining obj's class: a plugin drafter outside the package
    changes the key when its code changes ("" for None and builtins)."""
    import inspect

    if obj is None:
        return ""
    try:
        return hashlib.sha256(Path(inspect.getfile(type(obj))).read_bytes()).hexdigest()
    except (TypeError, OSError):
        return repr(type(obj))


_ENABLED = {"on": False}


def enable() -> None:
    """Turn the store on (the CLI, the API and the server do, with XLA's cache); JAXSPEC_EXECUTABLE_CACHE=off
    keeps it off (the test suite: tests that patch functions must compile what they patched)."""
    _ENABLED["on"] = True


def store_dir() -> Path | None:
    """<XLA cache dir>/executables, or None when the persistent cache is off (or multi-process)."""
    base = jax.config.jax_compilation_cache_dir
    if not (_ENABLED["on"] and base) or os.environ.get("JAXSPEC_EXECUTABLE_CACHE") == "off" or jax.process_count() > 1:
        return None
    return Path(base) / "executables"


def abstract_signature(args: Any) -> str:
    """The tree structure, shapes, dtypes and shardings of `args` (arrays or ShapeDtypeStructs)."""
    def leaf(x):
        sharding = getattr(x, "sharding", None)
        return (tuple(getattr(x, "shape", ())), str(getattr(x, "dtype", type(x).__name__)),
                repr(sharding) if sharding is not None else None)

    leaves, tree = jax.tree_util.tree_flatten(args)
    return repr((tree, [leaf(x) for x in leaves]))


def compile_cached(parts: tuple, build: Callable[[], Any], before_load: Callable[[], None] | None = None):
    """`build().lower().compile()`, or the executable stored for `parts` by an earlier process.

    `parts`: everything that shapes the program besides the source (reprs are hashed).
    `build`: returns the jax.stages.Traced (or Lowered) program; it runs only on a miss.
    `before_load`: run before a stored executable is loaded (FFI targets it calls must be
    registered in this process first)."""
    from jax.experimental import serialize_executable as se

    d = store_dir()
    if d is None or not _can_turn_cache_off():
        return _compile(build)
    key = hashlib.sha256(repr((source_fingerprint(), jax.devices(), parts)).encode()).hexdigest()
    f = d / f"{key[:40]}.exe"
    if f.is_file():
        try:
            if before_load is not None:
                before_load()
            payload, in_tree, out_tree = pickle.loads(f.read_bytes())
            return se.deserialize_and_load(payload, in_tree, out_tree)
        except Exception as e:  # noqa: BLE001 - a bad file is a miss, never an error
            log.warning("stored executable %s did not load (%s); compiling again", f, type(e).__name__)
    compiled = _compile(build, fresh=True)
    try:
        d.mkdir(parents=True, exist_ok=True)
        tmp = f.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(pickle.dumps(se.serialize(compiled)))
        tmp.replace(f)  # atomic: a reader never sees half a file
    except Exception as e:  # noqa: BLE001 - an executable that cannot be stored is still good to run
        log.info("executable not stored (%s: %s)", type(e).__name__, e)
    return compiled


def _compile(build, fresh: bool = False):
    lowered = build()
    lowered = lowered.lower() if hasattr(lowered, "lower") else lowered
    if not fresh:
        return lowered.compile()
    # An XLA:CPU executable that XLA's persistent cache loaded serializes without its object
    # code (running one stored from it fails with "Function broadcast_compare_fusion not found"),
    # so what is stored is compiled afresh:
    # - if this process already ran the program (loaded from that cache), JAX's in-memory compile
    #   cache hands the same executable back: a compile option at its default value makes that
    #   key new;
    # - XLA's cache must be off for this compile, or the entry the last fresh compile of the same
    #   program wrote (same option, same key) is read back: every stored prefill failed after a
    #   source change that left its HLO alone (2026-12-04). jax decides "cache used" once per
    #   process, so the `enable_compilation_cache` flag alone does nothing here.
    options = {"xla_dump_to": ""} if jax.default_backend() == "cpu" else None
    with _persistent_cache_off():
        return lowered.compile(compiler_options=options)


def _can_turn_cache_off() -> bool:
    """Whether this jax has the memo `_persistent_cache_off` resets (else nothing is stored)."""
    from jax._src import compilation_cache as cc

    return all(hasattr(cc, a) for a in ("_cache_checked", "_cache_used", "_cache_initialized_mutex"))


@contextlib.contextmanager
def _persistent_cache_off():
    """XLA's persistent cache neither read nor written inside (jax memoizes `is_cache_used`)."""
    from jax._src import compilation_cache as cc
    from jax._src import config as jax_config

    with cc._cache_initialized_mutex:
        saved = cc._cache_checked, cc._cache_used
        cc._cache_checked, cc._cache_used = True, False
    try:
        with jax_config.enable_compilation_cache(False):
            yield
    finally:
        with cc._cache_initialized_mutex:
            cc._cache_checked, cc._cache_used = saved
