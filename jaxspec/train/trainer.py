"""The drafter training loop: optax AdamW, orbax checkpoints that resume bit for bit, logs, plots.

    state = {"params": head weights (HF layout, trainable), "opt": optax state,
             "step": int32, "rng": uint32[2] PRNG key}         (one jitted step, state donated)
    meta  = {"step", "epoch", "index" (batches of that epoch consumed), "tokens"}   (JSON beside it)

Run directory: train_config.json, draft_vocab.npy (EAGLE-3), log.jsonl (one line per log or eval
step), checkpoints/<step>/ (orbax: state + meta), head/ (the exported head, published format),
curves.png (`plot`; it and engine τ live in jaxspec/train/evaluate.py). Resuming restores state
and the data position, and replays the same batch order (each epoch's order is a function of
(seed, epoch)), so a resumed run equals an uninterrupted one exactly.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
import json
import time
import typing
from pathlib import Path
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import ConfigValueError, _coerce
from jaxspec.models.heads.family import family_of, head_config, init_head_params, trainable_kinds
from jaxspec.train import checkpoint
from jaxspec.train.losses import LossConfig, trainable
from jaxspec.train.warm import load_init_head, warm_params



@dataclasses.dataclass(frozen=True)
class TrainConfig:
    drafter: str = "eagle3"
    lr: float = 1e-4
    warmup_ratio: float = 0.015  # of total_steps, linear from 0; then cosine to 0
    total_steps: int = 2000
    batch_size: int = 4
    max_len: int = 512  # rows cut to this many tokens
    # Rows padded to the smallest bucket holding the batch's longest row (one compiled step per
    # bucket; () = always max_len); length_group sorts runs of that many examples by length so
    # batches hold similar lengths (FeatureCache.order). Both change the data order: fixed at resume.
    length_buckets: tuple[int, ...] = ()
    length_group: int = 0
    ttt_length: int = 7
    step_weight_decay: float = 0.8
    draft_vocab_size: int = 32000  # EAGLE-3; capped at the target vocabulary
    feature_layers: tuple[int, ...] = ()  # EAGLE-3 "entering layer k" ids; () = (2, L//2, L-3)
    target_kv_layers: tuple[int, ...] = ()  # FROZEN_KV_MTP: the target layers it reads; () = the last two
    num_medusa_heads: int = 4
    medusa_labels: str = "argmax"  # or "tokens"
    # "own": a trained LM head per Medusa head (Medusa-1; 4 x V x H weights, 226 MB in bf16 for
    # SmolLM2); "target": the frozen target LM head serves every head (exported as version "2",
    # the ResBlocks alone: a few MB)
    medusa_head: str = "own"
    # EAGLE-3's own LM head starts "random" (SpecForge's nn.Linear) or as the target's: its rows at
    # the draft ids and its final norm, so the head only has to learn the target's next-state
    # space, not a V_d x H classifier from scratch (what a small data budget cannot afford)
    eagle3_head_init: str = "random"
    data_parallel: int = 1  # devices on a "data" mesh axis: batch rows split, params replicated
    # DFLASH / DSPARK (jaxspec/train/block.py): draft layers, block (0 = 16 for dflash, gamma 7 for
    # dspark), the MASK token (-1 = a special token chat never emits, see heads/block.mask_token_for), anchors
    # per sequence, the depth decay, DSPARK's Markov rank.
    block_layers: int = 1
    block_size: int = 0
    mask_token_id: int = -1
    block_anchors: int = 16
    block_decay: float = 7.0
    markov_rank: int = 64
    eagle_noise: float = 0.2
    eagle_ploss_weight: float = 0.1
    b1: float = 0.9
    b2: float = 0.999
    weight_decay: float = 0.0
    clip_norm: float = 0.5
    seed: int = 0
    log_every: int = 10
    eval_every: int = 0  # 0 = only at the end
    save_every: int = 500
    keep_checkpoints: int = 2
    remat: bool = False  # True: recompute each TTT step in backward (less memory, ~2x slower on CPU)

    def validate(self) -> "TrainConfig":
        checks = [
            (self.drafter in trainable_kinds(), f"drafter must be one of {trainable_kinds()}"), (self.lr > 0, "lr must be > 0"),
            (0 <= self.warmup_ratio < 1, "warmup_ratio must be in [0, 1)"), (self.total_steps >= 1, "total_steps >= 1"),
            (self.batch_size >= 1, "batch_size >= 1"), (self.max_len >= 4, "max_len >= 4"),
            (self.ttt_length >= 1, "ttt_length >= 1"), (self.draft_vocab_size >= 1, "draft_vocab_size >= 1"),
            (self.num_medusa_heads >= 1, "num_medusa_heads >= 1"), (self.clip_norm > 0, "clip_norm > 0"),
            (self.medusa_labels in ("argmax", "tokens"), "medusa_labels must be argmax or tokens"),
            (self.medusa_head in ("own", "target"), "medusa_head must be own or target"),
            (self.eagle3_head_init in ("random", "target"), "eagle3_head_init must be random or target"),
            (self.data_parallel >= 1 and self.batch_size % self.data_parallel == 0,
             f"batch_size {self.batch_size} must be a multiple of data_parallel {self.data_parallel}"),
            (self.log_every >= 1 and self.save_every >= 1 and self.eval_every >= 0, "intervals must be >= 1"),
            (len(self.feature_layers) in (0, 3), "feature_layers: three layer ids or none"),
            (all(4 <= b <= self.max_len for b in self.length_buckets), "length_buckets must lie in [4, max_len]"),
            (self.length_group >= 0, "length_group >= 0"),
            (self.block_layers >= 1 and self.block_size >= 0 and self.block_anchors >= 1 and self.block_decay > 0
             and self.markov_rank >= 1, "block_layers, block_anchors, markov_rank >= 1; block_size >= 0; "
             "block_decay > 0"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ConfigValueError(f"train config: {msg}")
        return self

    def loss_config(self) -> LossConfig:
        return LossConfig(ttt_length=self.ttt_length, step_weight_decay=self.step_weight_decay,
                          eagle_noise=self.eagle_noise, eagle_ploss_weight=self.eagle_ploss_weight,
                          medusa_labels=self.medusa_labels, remat=self.remat, block_anchors=self.block_anchors,
                          block_decay=self.block_decay)


# What must not change between a run and its resume (the rest, e.g. intervals or total_steps, may).
_FIXED = ("drafter", "draft_vocab_size", "feature_layers", "target_kv_layers", "num_medusa_heads", "medusa_head",
          "batch_size", "max_len", "seed", "length_group", "eagle3_head_init", "block_layers", "block_size", "mask_token_id",
          "markov_rank")


def train_config(path=None, overrides: dict[str, Any] | None = None, *, base: TrainConfig | None = None) -> TrainConfig:
    """`base` < a TOML file (top-level keys or a [train] table) < overrides ("key" or "train.key")."""
    from jaxspec.config import read_toml

    cfg = base or TrainConfig()
    values: dict[str, Any] = {}
    if path:
        data = read_toml(path)
        values.update(data.pop("train", {}))
        values.update(data)
    for k, v in (overrides or {}).items():
        values[k.removeprefix("train.")] = v
    hints = typing.get_type_hints(TrainConfig)
    upd = {}
    for k, v in values.items():
        if k not in hints:
            raise ConfigValueError(f"unknown train key {k!r}; valid keys: {', '.join(sorted(hints))}")
        upd[k] = _coerce(f"train.{k}", v, hints[k])
    return dataclasses.replace(cfg, **upd).validate()


# --------------------------------------------------------------------------- #
# Data sources: iterate(batch_size, seed, epoch) -> batches (dicts of numpy arrays)
# --------------------------------------------------------------------------- #


class ArraySource:
    """Rows in memory ({key: [N, ...]}); each epoch a seeded permutation, full batches only."""

    def __init__(self, rows: dict[str, np.ndarray]):
        self.rows = {k: np.asarray(v) for k, v in rows.items()}
        self.n = len(self.rows["tokens"])

    @classmethod
    def from_batches(cls, batches: list[dict]) -> "ArraySource":
        t = max(b["tokens"].shape[1] for b in batches)
        fitted = [fit_batch(b, t) for b in batches]
        return cls({k: np.concatenate([b[k] for b in fitted]) for k in fitted[0]})

    def iterate(self, batch_size: int, seed: int, epoch: int, *, start: int = 0) -> Iterator[dict]:
        order = np.random.default_rng([seed, epoch]).permutation(self.n)
        for s in range(start * batch_size, self.n - batch_size + 1, batch_size):
            idx = order[s:s + batch_size]
            yield {k: v[idx] for k, v in self.rows.items()}

    def token_counts(self, vocab: int) -> np.ndarray:
        return token_counts([self.rows], vocab)


def npz_source(directory) -> ArraySource:
    """A directory of .npz batches in the data interface (tokens, lengths, loss_mask, aux?, final)."""
    files = sorted(Path(directory).glob("*.npz"))
    if not files:
        raise FileNotFoundError(f"no .npz batches in {directory}")
    batches = []
    for f in files:
        with np.load(f) as z:
            batches.append({k: z[k] for k in z.files})
    return ArraySource.from_batches(batches)


def open_source(data: str):
    """`--data`: a jaxspec.train.data cache directory (manifest.json: FeatureCache, read lazily,
    shard by shard), several cache directories joined by commas (CacheUnion: shuffled together),
    or any other directory of .npz batches in the data interface (read whole)."""
    if "," in data:
        from jaxspec.train.data import CacheUnion

        parts = [x for x in data.split(",") if x]
        missing = [x for x in parts if not (Path(x) / "manifest.json").is_file()]
        if missing:
            raise FileNotFoundError(f"--data {data}: {', '.join(missing)} is not a feature cache (no manifest.json)")
        return CacheUnion(parts)
    p = Path(data)
    if not p.is_dir():
        raise FileNotFoundError(f"--data {data}: not a directory (a feature cache or .npz batches)")
    if (p / "manifest.json").exists():
        from jaxspec.train.data import FeatureCache

        return FeatureCache(p)
    return npz_source(p)


def bucket_len(lengths, max_len: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket holding the longest row (max_len when none does, or no buckets)."""
    longest = int(np.max(lengths))
    return min([b for b in buckets if b >= longest] or [max_len])


def fit_batch(batch: dict, max_len: int, keys=None) -> dict:
    """Pad or cut every row to max_len tokens; tokens int32, lengths int32, loss_mask bool."""
    out = {}
    t = batch["tokens"].shape[1]
    for k, v in batch.items():
        if keys is not None and k not in keys and k not in ("tokens", "lengths", "loss_mask"):
            continue
        v = np.asarray(v)
        if k != "lengths":
            if t >= max_len:
                v = v[:, :max_len]
            else:
                v = np.pad(v, [(0, 0), (0, max_len - t)] + [(0, 0)] * (v.ndim - 2))
        out[k] = v
    out["tokens"] = out["tokens"].astype(np.int32)
    out["lengths"] = np.minimum(np.asarray(batch["lengths"]), max_len).astype(np.int32)
    out["loss_mask"] = out["loss_mask"].astype(bool)
    return out


def token_counts(batches, vocab: int) -> np.ndarray:
    counts = np.zeros(vocab, np.int64)
    for b in batches:
        t = b["tokens"].shape[1]
        live = (np.arange(t)[None] < np.asarray(b["lengths"])[:, None]) & np.asarray(b["loss_mask"], bool)
        counts += np.bincount(np.asarray(b["tokens"])[live].ravel(), minlength=vocab)[:vocab]
    return counts


def draft_vocab(counts: np.ndarray, size: int) -> np.ndarray:
    """The `size` most frequent (loss-masked) target tokens, ties to the lower id, ascending."""
    size = min(size, len(counts))
    order = np.lexsort((np.arange(len(counts)), -counts))
    return np.sort(order[:size]).astype(np.int32)


def _source_counts(source, vocab: int, batch_size: int, seed: int) -> np.ndarray:
    if hasattr(source, "token_counts"):
        return np.asarray(source.token_counts(vocab))
    return token_counts(source.iterate(batch_size, seed, 0), vocab)


# --------------------------------------------------------------------------- #
# Model pieces
# --------------------------------------------------------------------------- #


def shared_target(target, draft_ids=None, kv_layers: tuple[int, ...] = ()) -> dict:
    """The target runtime tensors the losses read (embed, head; EAGLE-3 adds draft_ids, t2d;
    FROZEN_KV_MTP the input norm and k/v projections of the layers whose K/V it reads)."""
    from jaxspec.models.llama import prepare_params

    rt = prepare_params(target.params, target.config, unstack=False)
    out = {"embed": rt["embed"], "head": rt["head"], "final_norm": rt["final_norm"]}
    if kv_layers:
        c = target.config
        if c.qkv_bias or c.qk_norm:
            raise ValueError("training a frozen_kv head recomputes the target's K/V from its captured layers, "
                             "which covers Llama-style attention only (this target has q/k/v bias or q/k norms)")
        ids = jnp.asarray(kv_layers, jnp.int32)
        out.update({"kv_norm": rt["layers"]["attn_norm"][ids], "kv_wk": rt["layers"]["wk"][ids],
                    "kv_wv": rt["layers"]["wv"][ids], "kv_eps": jnp.float32(c.rms_norm_eps)})
    if draft_ids is not None:
        ids = jnp.asarray(draft_ids, jnp.int32)
        out["draft_ids"] = ids
        out["t2d"] = jnp.zeros((target.config.vocab_size,), bool).at[ids].set(True)
    return out


def make_head_config(cfg: TrainConfig, target_cfg):
    """The fresh head the run trains, from its family (`jaxspec.models.heads.family`)."""
    return head_config(cfg.drafter, target_cfg, draft_vocab_size=cfg.draft_vocab_size, num_heads=cfg.num_medusa_heads,
                       medusa_head=cfg.medusa_head, feature_layers=tuple(cfg.feature_layers) or None,
                       num_layers=cfg.block_layers, block_size=cfg.block_size, mask_token_id=cfg.mask_token_id,
                       markov_rank=cfg.markov_rank, target_kv_layers=tuple(cfg.target_kv_layers) or None)


def init_train_params(hcfg, shared: dict, seed: int, draft_ids=None, head_init: str = "random") -> dict:
    """Fresh trainable weights: the family's random init, then its recipe's own (`train_init`: EAGLE-3's
    lm_head at the scale of a default nn.Linear, Medusa's heads copied from the target's LM head)."""
    family = family_of(hcfg.kind)
    p = trainable(init_head_params(hcfg, seed, token_ids=draft_ids))
    if family.train_init is not None:
        p = family.train_init(p, hcfg, shared, seed, draft_ids, head_init)
    return p


def make_optimizer(cfg: TrainConfig):
    import optax

    warm = max(1, int(round(cfg.warmup_ratio * cfg.total_steps)))
    sched = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, warm, max(cfg.total_steps, warm + 1), end_value=0.0)
    tx = optax.chain(optax.clip_by_global_norm(cfg.clip_norm),
                     optax.adamw(sched, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay))
    return tx, sched


@functools.lru_cache(maxsize=8)
def train_step_for(cfg: TrainConfig, hcfg):
    """The jitted step of a config (cached, so runs in one process share its compilations)."""
    cfg = dataclasses.replace(cfg, seed=0, log_every=1, eval_every=0, save_every=1, keep_checkpoints=1)
    tx, sched = make_optimizer(cfg)
    return make_train_step(family_of(cfg.drafter).loss_fn(), tx, sched, hcfg, cfg.loss_config())


def make_train_step(loss_fn, tx, sched, hcfg, lcfg: LossConfig):
    """step(state, batch, shared) -> (state, metrics), jitted, the state donated."""
    import optax

    def step(state, batch, shared):
        rng, sub = jax.random.split(state["rng"])

        def f(p):
            return loss_fn(p, batch, shared, sub, hcfg=hcfg, lcfg=lcfg)

        (_, metrics), grads = jax.value_and_grad(f, has_aux=True)(state["params"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = {**metrics, "grad_norm": optax.tree.norm(grads), "lr": sched(state["step"])}
        return {"params": params, "opt": opt, "step": state["step"] + 1, "rng": rng}, metrics

    return jax.jit(step, donate_argnums=(0,))


def data_mesh(n: int):
    """A 1-D ("data",) mesh over the first n devices, or None for n = 1. Rows of a batch are split
    over it and the head is replicated, so GSPMD turns the loss's means into all-reduces and the
    gradients come out summed over every shard's rows (the single-device step, reordered)."""
    if n == 1:
        return None
    devices = jax.devices()
    if n > len(devices):
        raise ConfigValueError(f"train config: data_parallel {n} exceeds the {len(devices)} visible devices "
                               f"({devices[0].platform}); on CPU set XLA_FLAGS=--xla_force_host_platform_device_count")
    return jax.sharding.Mesh(np.asarray(devices[:n]), ("data",))


def _place(tree, mesh, rows: bool):
    if mesh is None:
        return tree
    from jax.sharding import NamedSharding, PartitionSpec as P

    return jax.device_put(tree, NamedSharding(mesh, P("data") if rows else P()))


def heldout_eval(batches: list[dict], hcfg, shared: dict, cfg: TrainConfig) -> Callable[[dict], dict]:
    """Default eval_fn: mean loss and top-1 per step over held-out batches (no noise, no dropout)."""
    lcfg = dataclasses.replace(cfg.loss_config(), remat=False)
    fn = jax.jit(lambda p, b: family_of(hcfg.kind).loss_fn()(p, b, shared, None, hcfg=hcfg, lcfg=lcfg)[1])
    fitted = [fit_batch(b, cfg.max_len) for b in batches]

    def eval_fn(params):
        ms = [jax.device_get(fn(params, b)) for b in fitted]
        return {"heldout_loss": float(np.mean([m["loss"] for m in ms])),
                "heldout_acc": np.mean([m["acc"] for m in ms], axis=0).round(4).tolist()}

    return eval_fn


# --------------------------------------------------------------------------- #
# Training
# --------------------------------------------------------------------------- #


@dataclasses.dataclass
class TrainResult:
    params: dict  # HF layout (trainable tensors)
    hcfg: Any
    draft_ids: np.ndarray | None
    step: int
    run_dir: Path
    last: dict  # the last logged line


def _iterate(source, cfg: TrainConfig, epoch: int, start: int):
    """One epoch's batches from batch number `start` (FeatureCache / ArraySource skip without loading)."""
    params = inspect.signature(source.iterate).parameters
    kw = {"pad_to": cfg.max_len} if "pad_to" in params else {}
    if cfg.length_group and "group" in params:
        kw["group"] = cfg.length_group
    if "start" in params:
        return source.iterate(cfg.batch_size, cfg.seed, epoch, start=start, **kw)
    return itertools.islice(source.iterate(cfg.batch_size, cfg.seed, epoch, **kw), start, None)


def _batches(source, cfg: TrainConfig, epoch: int, index: int):
    """(epoch, index_after, batch) forever from the data position (epoch, index)."""
    while True:
        got = False
        for i, b in enumerate(_iterate(source, cfg, epoch, index), start=index):
            got = True
            yield epoch, i + 1, b
        if not got and index == 0:
            raise ValueError(f"the data source yields no batch of {cfg.batch_size} rows")
        epoch, index = epoch + 1, 0


def check_source(source, target, hcfg) -> None:
    """A jaxspec.train.data cache must come from this target and hold the head's features."""
    manifest = getattr(source, "manifest", None)
    if not isinstance(manifest, dict):
        return
    where = getattr(source, "dir", "the data cache")
    fp = manifest.get("target_fingerprint")
    if fp is not None:
        from jaxspec.train.data import target_fingerprint

        if fp != target_fingerprint(target.params, target.config):
            raise ValueError(f"{where} was built from other target weights (fingerprint {fp}) than --target")
    layers = manifest.get("feature_layers")
    if (hcfg.feature_layers and layers is not None
            and tuple(layers) != tuple(hcfg.feature_layers)):
        raise ValueError(f"{where} captured layers {tuple(layers)}, the {hcfg.kind} head reads {hcfg.feature_layers}: "
                         "set feature_layers or rebuild the cache")
    if hcfg.target_kv_layers and layers is not None and tuple(layers) != tuple(hcfg.target_kv_layers):
        raise ValueError(f"{where} captured layers {tuple(layers)}, the {hcfg.kind} head reads the K/V of target "
                         f"layers {hcfg.target_kv_layers} (recomputed from the state entering them): set "
                         "target_kv_layers or rebuild the cache with those layers")


def _fmt(x) -> Any:
    a = np.asarray(x)
    return round(float(a), 5) if a.ndim == 0 else [round(float(v), 4) for v in a.ravel()]


def train(cfg: TrainConfig, target, source, run_dir, *, resume: bool = False, stop_at: int | None = None,
          eval_fn: Callable[[dict], dict] | None = None, heldout: list[dict] | None = None,
          draft_ids=None, progress: bool = True, export: bool = True, init=None) -> TrainResult:
    """Train a `cfg.drafter` head for `target` (a LoadedModel: HF params + config) on `source`.

    `stop_at`: stop (and checkpoint) once this global step is reached, as an interrupted run would.
    `eval_fn(params) -> dict` (default: held-out loss/top-1 on `heldout` batches, if given) runs
    every eval_every steps and at the end; its values land in that step's log line.
    `init`: a head directory in its published format (a shipped head): the run starts from its
    weights (and, for EAGLE-3, its draft vocabulary) instead of a random start. A resumed run's
    checkpoint wins over it.
    """
    from tqdm.auto import tqdm

    cfg = cfg.validate()
    run_dir = Path(run_dir)
    if resume and not (run_dir / "train_config.json").is_file():
        raise FileNotFoundError(f"--resume {run_dir}: no training run there (no train_config.json); "
                                "drop --resume to start a new run")
    run_dir.mkdir(parents=True, exist_ok=True)
    tcfg = target.config
    hcfg = make_head_config(cfg, tcfg)
    check_source(source, target, hcfg)
    vocab_file = run_dir / "draft_vocab.npy"
    warm = load_init_head(init, hcfg, tcfg) if init is not None else None
    if warm is not None and warm[1] is not None and draft_ids is None:
        draft_ids = warm[1]
    if family_of(cfg.drafter).draft_vocab:
        if draft_ids is None and resume and vocab_file.exists():
            draft_ids = np.load(vocab_file)
        if draft_ids is None:
            counts = _source_counts(source, tcfg.vocab_size, cfg.batch_size, cfg.seed)
            draft_ids = draft_vocab(counts, hcfg.draft_vocab_size)
        draft_ids = np.asarray(draft_ids, np.int32)
        np.save(vocab_file, draft_ids)
    else:
        draft_ids = None
    shared = shared_target(target, draft_ids, hcfg.target_kv_layers)
    tx, sched = make_optimizer(cfg)
    params = init_train_params(hcfg, shared, cfg.seed, draft_ids, cfg.eagle3_head_init)
    if warm is not None:
        params = warm_params(params, warm[0], init)
    state = {"params": params, "opt": tx.init(params), "step": jnp.zeros((), jnp.int32),
             "rng": jax.random.PRNGKey(cfg.seed)}
    meta = {"step": 0, "epoch": 0, "index": 0, "tokens": 0}
    mngr = checkpoint.manager(run_dir, cfg.keep_checkpoints)
    log_path = run_dir / "log.jsonl"
    restored = None
    if resume:
        restored, rmeta = checkpoint.restore(mngr, state)
        if restored is not None:
            old = json.loads((run_dir / "train_config.json").read_text())
            hints = typing.get_type_hints(TrainConfig)
            # A key the run's config predates had its default then (the code had no other value).
            defaults = dataclasses.asdict(TrainConfig())
            diff = [k for k in _FIXED if _coerce(k, old.get(k, defaults[k]), hints[k]) != getattr(cfg, k)]
            if diff:
                raise ConfigValueError(f"--resume with changed {', '.join(diff)} (run {run_dir} has "
                                       + ", ".join(f"{k}={old.get(k)!r}" for k in diff) + ")")
            state, meta = restored, {k: int(rmeta[k]) for k in meta}
            if log_path.exists():  # drop lines past the checkpoint: the resumed run writes them again
                keep = [ln for ln in log_path.read_text().splitlines() if ln and json.loads(ln)["step"] <= meta["step"]]
                log_path.write_text("".join(ln + "\n" for ln in keep))
    if restored is None and log_path.exists():  # a fresh run (or nothing to resume from)
        log_path.unlink()
    (run_dir / "train_config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2) + "\n")
    if eval_fn is None and heldout:
        eval_fn = heldout_eval(heldout, hcfg, shared, cfg)

    keys = family_of(cfg.drafter).train_features
    mesh = data_mesh(cfg.data_parallel)
    state, shared = _place(state, mesh, False), _place(shared, mesh, False)
    step_fn = train_step_for(cfg, hcfg)
    end = cfg.total_steps if stop_at is None else min(stop_at, cfg.total_steps)
    step = meta["step"]
    bar = tqdm(total=cfg.total_steps, initial=step, disable=not progress, desc=f"train {cfg.drafter}",
               dynamic_ncols=True)
    data = _batches(source, cfg, meta["epoch"], meta["index"])
    last: dict = {}
    t_mark, tok_mark = None, meta["tokens"]
    with open(log_path, "a") as log:
        while step < end:
            epoch, index, batch = next(data)
            batch = fit_batch(batch, bucket_len(np.minimum(batch["lengths"], cfg.max_len), cfg.max_len,
                                                cfg.length_buckets), keys)
            n_tok = int(batch["lengths"].sum())
            state, metrics = step_fn(state, _place(batch, mesh, True), shared)
            step += 1
            tokens = meta["tokens"] + n_tok
            meta = {"step": step, "epoch": epoch, "index": index, "tokens": tokens}
            bar.update(1)
            if t_mark is None:  # the first step compiles: rates start after it
                jax.block_until_ready(metrics)
                t_mark, tok_mark = time.perf_counter(), meta["tokens"]
            do_eval = eval_fn is not None and (step == cfg.total_steps
                                               or bool(cfg.eval_every and step % cfg.eval_every == 0))
            if step % cfg.log_every == 0 or do_eval or step == end or step == 1:
                m = jax.device_get(metrics)
                now = time.perf_counter()
                done = meta["tokens"] - tok_mark
                rate = done / (now - t_mark) if now > t_mark and done > 0 else None
                t_mark, tok_mark = now, meta["tokens"]
                last = {"step": step, "epoch": epoch, **{k: _fmt(v) for k, v in m.items()},
                        "tokens": meta["tokens"], "tokens_per_s": None if rate is None else round(rate, 1)}
                if do_eval:
                    last["eval"] = {k: v for k, v in eval_fn(state["params"]).items()}
                log.write(json.dumps(last) + "\n")
                log.flush()
                acc = m["acc"]
                bar.set_postfix_str(f"loss={float(m['loss']):.3f} top1=" + "/".join(f"{a:.2f}" for a in np.ravel(acc))
                                    + (f" tok/s={rate:.0f}" if rate else ""))
            if step % cfg.save_every == 0 or step == end:
                checkpoint.save(mngr, state, meta)
    bar.close()
    params = jax.device_get(state["params"])
    if export and step == cfg.total_steps:
        from jaxspec.train.export import export_head

        export_head(params, hcfg, run_dir / "head", draft_ids=draft_ids, num_target_layers=tcfg.num_layers)
    mngr.close()
    return TrainResult(params=params, hcfg=hcfg, draft_ids=draft_ids, step=step, run_dir=run_dir, last=last)


# τ through the real engine and the plots live in evaluate.py; re-exported here.
from jaxspec.train.evaluate import HeadEngine, plain_generate, plot, read_log  # noqa: E402

__all__ = ["TrainConfig", "train", "train_config", "ArraySource", "open_source", "heldout_eval", "HeadEngine",
           "plain_generate", "plot", "read_log"]
