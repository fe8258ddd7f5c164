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
