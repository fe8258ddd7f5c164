"""Where jaxspec keeps files on disk.

A leaf module (stdlib only), so the model loader, the native-kernel builder and
the server can all find the cache without importing one another.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """`cache_dir`, else $JAXSPEC_CACHE, else ~/.cache/jaxspec."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("JAXSPEC_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "jaxspec"


def checkpoints_dir() -> Path:
    """The repository's `checkpoints/` (beside the package in a source checkout)."""
    return Path(__file__).resolve().parents[1] / "checkpoints"


# DSPARK's planner tables measured per platform (`python -m jaxspec.bench sps`).
SPS_TABLES = {"cpu": "cpu-2core.json"}


def default_sps_table(platform: str) -> Path | None:
    """configs/sps/<table> for `platform` ("cpu", "gpu", "tpu"), or None where none was measured."""
    name = SPS_TABLES.get(platform)
    if name is None:
        return None
    path = Path(__file__).resolve().parents[1] / "configs" / "sps" / name
    return path if path.is_file() else None


def enable_compilation_cache(where: str = "", cache_dir: str | Path | None = None) -> None:
    """XLA's persistent compilation cache, on by default for the CLI, the API and the server: a
    second start of the same configuration loads its programs instead of compiling them.
    `where`: "" = <cache root>/xla, "off" = disabled; a directory set already (JAX_COMPILATION_CACHE_DIR
    or the caller) wins."""
    import jax

    if where == "off":
        return
    from jaxspec import aot

    aot.enable()  # compiled buckets too, found without tracing (jaxspec/aot.py)
    if jax.config.jax_compilation_cache_dir:
        return
    jax.config.update("jax_compilation_cache_dir", where or str(cache_root(cache_dir) / "xla"))
    # Every bucket counts: the default skips programs compiled in under a second.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
