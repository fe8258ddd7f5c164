"""Training checkpoints: orbax state + meta, verified when restored, with fallback.

A checkpoint is `checkpoints/<step>/` with the train state (params, optimizer state, step, rng)
and a JSON meta (step, epoch, index, tokens, and a CRC-32 of every state leaf). Orbax writes a
step into a temporary directory and renames it when complete, so a SIGKILL mid-write leaves
only the previous steps (tested). What orbax does not catch is damage after the write: a
flipped bit decodes to wrong numbers (a resumed run then trains from garbage, and its exported
head is non-finite), a truncated file or a removed item raises deep inside tensorstore. So
`restore` checks every step it reads (the checksums where the meta has them, and finite
floating-point leaves always), and walks from the newest step to older ones with a one-line
warning per damaged one, naming its directory.
"""

from __future__ import annotations

import sys
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np


class CheckpointError(ValueError):
    """No intact checkpoint where one was asked for (each damaged one named with its problem)."""


def manager(run_dir: Path, keep: int):
    import orbax.checkpoint as ocp

    opts = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=False)
    return ocp.CheckpointManager((Path(run_dir) / "checkpoints").absolute(), options=opts)


def _leaves(state) -> list[tuple[str, np.ndarray]]:
    flat, _ = jax.tree_util.tree_flatten_with_path(state)
    return [(jax.tree_util.keystr(path), np.asarray(jax.device_get(leaf))) for path, leaf in flat]


def checksums(state) -> dict[str, str]:
    """CRC-32 of every leaf's bytes (dtype and shape folded in), by key path."""
    out = {}
    for name, a in _leaves(state):
        head = f"{a.dtype.str}{a.shape}".encode()
        out[name] = f"{zlib.crc32(np.ascontiguousarray(a).tobytes(), zlib.crc32(head)):08x}"
    return out


def save(mngr, state, meta: dict) -> None:
    import orbax.checkpoint as ocp

    meta = {**meta, "checksums": checksums(state)}
    mngr.save(meta["step"], args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                    meta=ocp.args.JsonSave(meta)), force=True)
    mngr.wait_until_finished()


def damage(state, meta: dict) -> str | None:
    """What is wrong with a restored (state, meta), or None when it is intact."""
    sums = meta.get("checksums")
    if sums is not None:
        got = checksums(state)
        bad = [k for k in got if sums.get(k) != got[k]]
        if bad or set(sums) != set(got):
            return f"checksum mismatch in {', '.join(bad[:3]) or 'the leaf set'}"
    for name, a in _leaves(state):
        if np.issubdtype(a.dtype, np.floating) and not np.isfinite(a).all():
            return f"non-finite values in {name}"
    for key in ("step", "epoch", "index", "tokens"):
        if not isinstance(meta.get(key), int):
            return f"meta has no integer {key!r}"
    return None


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200] if text else ''}"


def _set_aside(mngr, steps: list[int], warn) -> None:
    """Move damaged steps newer than the one resumed from to checkpoints-damaged/ (kept for a
    look; the resumed run saves those steps again, which orbax refuses over an existing one)."""
    root = Path(mngr.directory)
    aside = root.parent / "checkpoints-damaged"
    aside.mkdir(exist_ok=True)
    for step in steps:
        dest = aside / str(step)
        n = 1
        while dest.exists():
            dest, n = aside / f"{step}-{n}", n + 1
        (root / str(step)).rename(dest)
        warn(f"warning: moved the damaged {root / str(step)} to {dest}")
    mngr.reload()


def restore(mngr, state_like, warn=None, set_aside: bool = True):
    """(state, meta) of the newest intact checkpoint, or (None, None) when there is none at all.

    Damaged steps are skipped with a warning (`warn`, default: stderr) and, with `set_aside`
    (resuming, which saves them again), moved out of the way; CheckpointError when every step
    is damaged, naming each one."""
    import orbax.checkpoint as ocp

    warn = warn or (lambda msg: print(msg, file=sys.stderr, flush=True))
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state_like)
    steps = sorted(mngr.all_steps(), reverse=True)
    problems = []
    for step in steps:
        where = Path(mngr.directory) / str(step)
        try:
            r = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                           meta=ocp.args.JsonRestore()))
            # Restored arrays come back committed to a device; fresh ones are not, and jit keys on that:
            # rebuild them uncommitted so the resumed run reuses the compiled step (values bit for bit).
            state = jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), r["state"])
            meta = dict(r["meta"]) if isinstance(r["meta"], dict) else {}
            problem = damage(state, meta)
        except Exception as e:  # noqa: BLE001 - any failure to read a step is that step's damage
            problem = _one_line(e)
        if problem is None:
            if problems and set_aside:
                _set_aside(mngr, steps[:steps.index(step)], warn)
                warn(f"warning: resuming from {where}, the newest intact checkpoint")
            return state, meta
        problems.append(f"{where}: {problem}")
        warn(f"warning: checkpoint {where} is damaged ({problem}); trying an older one")
    if problems:
        raise CheckpointError("no intact checkpoint: " + "; ".join(problems))
    return None, None
