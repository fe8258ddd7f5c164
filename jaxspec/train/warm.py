"""`--init`: warm-start a training run from a published-format head (the campaign's rounds)."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import ConfigValueError
from jaxspec.train.losses import trainable


def load_init_head(path, hcfg, target_cfg) -> tuple[dict, np.ndarray | None]:
    """(trainable params, draft ids or None) of a published-format head to warm-start from; a
    head of another kind or shape than the run's config is an error naming the path and field."""
    from jaxspec.models.heads.loading import load_draft_head

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"--init {path}: no such head directory")
    head = load_draft_head(path, target_cfg)
    if head.config.kind != hcfg.kind:
        raise ConfigValueError(f"--init {path}: a {head.config.kind} head, but the run trains {hcfg.kind}")
    if tuple(getattr(head.config, "feature_layers", ()) or ()) != tuple(getattr(hcfg, "feature_layers", ()) or ()):
        raise ConfigValueError(f"--init {path}: the head reads target layers {head.config.feature_layers}, "
                               f"the run's config {hcfg.feature_layers}")
    ids = None
    if "d2t" in head.params:  # a reduced draft vocabulary (EAGLE-3): the run keeps the head's
        d2t = np.asarray(head.params["d2t"], np.int64)
        ids = (np.arange(len(d2t)) + d2t).astype(np.int32)
    params = {k: v for k, v in trainable(dict(head.params)).items()}
    return params, ids


def warm_params(fresh: dict, loaded: dict, path) -> dict:
    """`loaded` cast onto the structure of `fresh` (the run's own init), checked leaf by leaf."""
    flat_f, tree_f = jax.tree_util.tree_flatten_with_path(fresh)
    loaded = {k: v for k, v in loaded.items() if k in fresh}
    flat_l, tree_l = jax.tree_util.tree_flatten_with_path(loaded)
    if tree_f != tree_l:
        missing = sorted(set(fresh) - set(loaded))
        raise ConfigValueError(f"--init {path}: the head's tensors do not match the run's config"
                               + (f" (missing {', '.join(missing)})" if missing else ""))
    out = []
    for (kp, a), (_, b) in zip(flat_f, flat_l):
        if tuple(a.shape) != tuple(b.shape):
            raise ConfigValueError(f"--init {path}: {jax.tree_util.keystr(kp)} has shape {tuple(b.shape)}, "
                                   f"the run's config needs {tuple(a.shape)}")
        b = np.asarray(b, np.float32)
        if not np.isfinite(b).all():
            raise ConfigValueError(f"--init {path}: {jax.tree_util.keystr(kp)} holds NaN or Inf")
        out.append(jnp.asarray(b, a.dtype))
    return jax.tree_util.tree_unflatten(tree_f, out)
