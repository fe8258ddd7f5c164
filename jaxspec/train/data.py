"""Drafter training data: ShareGPT prompts -> token sequences -> target features -> an on-disk cache.

    conversations (sharegpt)  ->  build_examples (raw | regenerate)  ->  capture_features  ->  FeatureCache

* `sharegpt_conversations` (`jaxspec/train/sharegpt.py`): ShareGPT's train or held-out split, with no
  benchmark prompt in either.
* `Example`: token ids (chat template) and `loss_mask`, True where the token is one the assistant
  produced (its content and end-of-turn token). Predicting token t from position t - 1 is the trainer's
  shift.
* Shard files `shard_{k:05d}.npz`: `tokens` [N, T] int32 right-padded with 0, `lengths` [N] int32,
  `loss_mask` [N, T] bool, `aux` [N, T, len(layers) * H] float16 (residual stream entering each
  `feature_layers`), `final` [N, T, H] float16 (final-norm state, the LM head's input); T = the
  longest sequence of the shard. Shard k holds the examples of train conversations
  [k * shard_conversations, (k + 1) * shard_conversations). `manifest.json` records the target, the
  settings, each shard's count and bytes, and `position` (conversations consumed), written after
  every shard (tmp + rename), so a killed build resumes from the last complete shard.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import zipfile
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np

from jaxspec.models.heads.config import eagle3_layers
from jaxspec.speculative.types import FeatureRequest
from jaxspec.train.sharegpt import Conversation, DataError, sharegpt_conversations

FORMAT_VERSION = 1


# --------------------------------------------------------------------------- #


@dataclasses.dataclass
class Example:
    conv_id: str
    tokens: np.ndarray  # [T] int32
    loss_mask: np.ndarray  # [T] bool: tokens the assistant produced


def _template(tokenizer, messages, gen: bool) -> list[int]:
    ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=gen, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _stop_ids(tokenizer, stop_ids) -> tuple[int, ...]:
    if stop_ids is not None:
        return tuple(stop_ids)
    return () if tokenizer.eos_token_id is None else (int(tokenizer.eos_token_id),)


def raw_example(conv: Conversation, tokenizer, max_len: int, stop_ids: Sequence[int]) -> Example | None:
    """The conversation as is, truncated to max_len; None when no assistant token fits or the
    template does not tokenise by prefixes."""
    full: list[int] = []
    spans = []
    for i, m in enumerate(conv.messages):
        if m["role"] != "assistant":
            continue
        gen = _template(tokenizer, conv.messages[:i], True)
        if len(gen) >= max_len:
            break
        upto = _template(tokenizer, conv.messages[: i + 1], False)
        if upto[: len(gen)] != gen or upto[: len(full)] != full:
            return None
        span = upto[len(gen):]
        last = max((j for j, t in enumerate(span) if t in stop_ids), default=len(span) - 1)
        spans.append((len(gen), len(gen) + last + 1))
        full = upto
    if not spans:
        return None
    tokens = np.asarray(full[:max_len], np.int32)
    mask = np.zeros(len(tokens), bool)
    for a, b in spans:
        mask[a:b] = True
    return Example(conv.id, tokens, mask) if mask.any() else None


def build_examples(conversations: Sequence[Conversation], tokenizer, *, source: str = "raw", engine=None,
                   max_len: int = 1024, temperature: float = 0.8, seed: int = 0, first_index: int = 0,
                   max_new_tokens: int | None = None, stop_ids: Sequence[int] | None = None,
                   min_new_tokens: int = 16, sampled_every: int = 0,
                   sampled_temperature: float = 0.7) -> list[Example]:
    """Token sequences with assistant loss masks; conversations that cannot fit are skipped.

    source "raw": ShareGPT's own responses. "regenerate": the first user turn with the chat template,
    answered by the target through `engine` (a `jaxspec.engine.Engine`; batches of its
    max_batch_size), `Request(temperature, seed=seed + first_index + i)` for conversation i, stopping at
    `stop_ids` (default: the tokenizer's EOS; pass `jaxspec.engine.assemble.stop_token_ids(model)`).
    `sampled_every = n > 0`: every n-th conversation (by its global index) is answered at
    `sampled_temperature` instead, so that a greedy-regenerated shard also trains sampled acceptance."""
    stops = _stop_ids(tokenizer, stop_ids)
    if source == "raw":
        out = [raw_example(c, tokenizer, max_len, stops) for c in conversations]
        return [e for e in out if e is not None]
    if source != "regenerate":
        raise DataError(f"source must be raw or regenerate, got {source!r}")
    if engine is None:
        raise DataError("source = regenerate needs an engine (jaxspec.engine.Engine over the target)")
    from jaxspec.engine import Request
    from jaxspec.sampling_params import SamplingParams

    limit = min(max_len, engine.max_context - engine.reserve_tokens)
    reqs, keep = [], []
    for i, c in enumerate(conversations):
        ids = _template(tokenizer, c.messages[:1], True)
        budget = limit - len(ids)
        if max_new_tokens is not None:
            budget = min(budget, max_new_tokens)
        if budget < min(min_new_tokens, max_new_tokens or min_new_tokens):
            continue
        g = first_index + i
        temp = sampled_temperature if sampled_every and g % sampled_every == sampled_every - 1 else temperature
        reqs.append(Request(ids, SamplingParams(max_tokens=budget, temperature=float(temp)),
                            seed=(seed + first_index + i) % 2**32, stop_token_ids=stops))
        keep.append(c)
    order = sorted(range(len(reqs)), key=lambda j: len(reqs[j].prompt_ids))  # less padding per batch
    results = [None] * len(reqs)
    for j, res in zip(order, engine.generate([reqs[j] for j in order])):
        results[j] = res
    out = []
    for c, r in zip(keep, results):
        tokens = np.asarray(r.prompt_ids + r.output_ids, np.int32)
        mask = np.arange(len(tokens)) >= len(r.prompt_ids)
        out.append(Example(c.id, tokens, mask))
    return out


# --------------------------------------------------------------------------- #
# Features
# --------------------------------------------------------------------------- #

_CAPTURE_FNS: dict = {}


def _capture_fn(cfg, layers: tuple[int, ...]):
    import jax
    import jax.numpy as jnp

    from jaxspec.cache.paged import KVCache
    from jaxspec.models.llama import forward

    key = (cfg, layers)
    if key not in _CAPTURE_FNS:
        def fn(params, tokens, lens):
            b, t = tokens.shape
            cache = KVCache.zeros(cfg.num_layers, 1, 16, cfg.num_kv_heads, cfg.head_dim, params["embed"].dtype)
            zeros = jnp.zeros((b,), jnp.int32)
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
            out = forward(params, cfg, tokens, positions, cache, jnp.zeros((b, 1), jnp.int32), q_start=zeros,
                          kv_len=lens, logits_index=zeros[:, None], capture_layers=layers, capture_final=True,
                          write_cache=False)
            return out.features.astype(jnp.float16)

        _CAPTURE_FNS[key] = jax.jit(fn)
    return _CAPTURE_FNS[key]


def capture_features(model_params: dict, cfg, sequences: Sequence[np.ndarray], request: FeatureRequest, *,
                     batch: int = 8, max_len: int | None = None, native: bool = False,
                     length_multiple: int = 64, quantize: str = "none") -> list[dict[str, np.ndarray]]:
    """Per sequence {"aux": [T, len(layers) * H] f16, "final": [T, H] f16} by batched prefill.

    `model_params`: loaded (HF layout) or runtime params. Sequences are sorted by length and padded
    to a multiple of `length_multiple` (few compiled shapes); `final` is always captured (the trainer
    projects it with the target's LM head). `quantize` (engine.quantize: int8, or gguf on the native
    kernels, params["gguf"] loaded): the features of the quantized target a head will serve beside."""
    from jaxspec.models.llama import prepare_params

    params = prepare_params(model_params, cfg, native=native or quantize == "gguf", quantize=quantize)
    layers = tuple(int(k) for k in request.layers)
    fn = _capture_fn(cfg, layers)
    h = cfg.hidden_size
    seqs = [np.asarray(s, np.int32)[: max_len or None] for s in sequences]
    out: list[dict | None] = [None] * len(seqs)
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    for start in range(0, len(order), batch):
        idx = order[start:start + batch]
        t = -(-max(len(seqs[i]) for i in idx) // length_multiple) * length_multiple
        tokens = np.zeros((batch, t), np.int32)
        lens = np.zeros((batch,), np.int32)
        for r, i in enumerate(idx):
            tokens[r, : len(seqs[i])], lens[r] = seqs[i], len(seqs[i])
        feats = np.asarray(fn(params, tokens, lens))
        for r, i in enumerate(idx):
            f = feats[r, : lens[r]]
            out[i] = {"aux": f[:, : len(layers) * h], "final": f[:, len(layers) * h:]}
    return out  # type: ignore[return-value]


# --------------------------------------------------------------------------- #
# The on-disk cache
# --------------------------------------------------------------------------- #


def target_fingerprint(params: dict, cfg) -> str:
    """The target's config plus a few of its weights, hashed: a cache built on other weights fails."""
    h = hashlib.sha256(json.dumps(dataclasses.asdict(cfg), sort_keys=True, default=str).encode())
    for leaf in (params["embed"][:2], params["final_norm"]):
        h.update(np.asarray(leaf, np.float32).tobytes())
    return h.hexdigest()[:16]


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_shard(path: Path, examples: Sequence[Example], feats: Sequence[dict]) -> int:
    n = len(examples)
    t = max([len(e.tokens) for e in examples], default=1)
    fa = feats[0]["aux"].shape[1] if n else 0
    h = feats[0]["final"].shape[1] if n else 0
    arrs = {"tokens": np.zeros((n, t), np.int32), "lengths": np.zeros((n,), np.int32),
            "loss_mask": np.zeros((n, t), bool), "aux": np.zeros((n, t, fa), np.float16),
            "final": np.zeros((n, t, h), np.float16)}
    for i, (e, f) in enumerate(zip(examples, feats)):
        k = len(e.tokens)
        arrs["tokens"][i, :k], arrs["lengths"][i], arrs["loss_mask"][i, :k] = e.tokens, k, e.loss_mask
        arrs["aux"][i, :k], arrs["final"][i, :k] = f["aux"], f["final"]
    buf = io.BytesIO()
    np.savez(buf, **arrs)
    _atomic_write(path, buf.getvalue())
    return len(buf.getvalue())


class FeatureCache:
    """A directory of feature shards and their manifest (module docstring)."""

    KEYS = ("tokens", "lengths", "loss_mask", "aux", "final")

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        self.manifest_path = self.dir / "manifest.json"
        try:
            self.manifest = json.loads(self.manifest_path.read_text())
        except FileNotFoundError:
            raise DataError(f"{self.manifest_path}: no feature cache here (no manifest.json)") from None
        except json.JSONDecodeError as e:
            raise DataError(f"{self.manifest_path}: corrupt manifest ({e.msg})") from None
        self._loaded: dict[int, dict] = {}
        self._lengths: dict[int, np.ndarray] = {}

    @property
    def shards(self) -> list[dict]:
        return self.manifest["shards"]

    @property
    def num_examples(self) -> int:
        return sum(s["num_examples"] for s in self.shards)

    def check(self, **expected) -> "FeatureCache":
        """DataError naming the first manifest field that differs from `expected`."""
        for key, want in expected.items():
            have = self.manifest.get(key)
            if isinstance(want, (tuple, list)):
                want = list(want)
            if have != want:
                raise DataError(f"{self.manifest_path}: field {key!r} is {have!r} but {want!r} was requested; "
                                "use another directory or rebuild")
        return self

    def shard(self, k: int) -> dict[str, np.ndarray]:
        """The arrays of shard k, checked against the manifest (DataError names the file)."""
        if k in self._loaded:
            return self._loaded[k]
        info = self.shards[k]
        path = Path(info.get("dir", self.dir)) / info["file"]
        try:
            size = path.stat().st_size
            if size != info["bytes"]:
                raise DataError(f"{path}: corrupt shard ({size} bytes, the manifest says {info['bytes']})")
            with np.load(path) as z:
                arrs = {key: z[key] for key in self.KEYS}
        except (OSError, zipfile.BadZipFile, KeyError, ValueError, EOFError) as e:
            if isinstance(e, DataError):
                raise
            raise DataError(f"{path}: corrupt or unreadable shard ({type(e).__name__}: {e})") from None
        if len(arrs["lengths"]) != info["num_examples"]:
            raise DataError(f"{path}: {len(arrs['lengths'])} examples, the manifest says {info['num_examples']}")
        self._loaded = {**dict(list(self._loaded.items())[-1:]), k: arrs}  # keep the two newest shards
        return arrs

    def verify(self) -> None:
        for k in range(len(self.shards)):
            self.shard(k)
        self._loaded = {}

    def token_counts(self, vocab_size: int) -> np.ndarray:
        """[V] int64: how often each token id is a loss-masked (assistant) token."""
        counts = np.zeros(vocab_size, np.int64)
        for k in range(len(self.shards)):
            s = self.shard(k)
            np.add.at(counts, s["tokens"][s["loss_mask"]], 1)
        return counts

    def order(self, seed: int, epoch: int, *, group: int = 0, batch: int = 1) -> list[tuple[int, int]]:
        """(shard, row) of every example in epoch order: shards shuffled, rows shuffled in each shard.

        `group` > 0: within each run of `group` examples, rows sorted by length and the resulting
        batches of `batch` shuffled, so a batch holds similar lengths (less padding when batches
        are padded to length buckets) while what comes next stays random."""
        rng = np.random.default_rng([seed, epoch])
        out = []
        for k in rng.permutation(len(self.shards)):
            out += [(int(k), int(r)) for r in rng.permutation(self.shards[k]["num_examples"])]
        if group <= 0:
            return out
        lengths = {k: self.lengths(k) for k in range(len(self.shards))}
        grouped = []
        for g in range(0, len(out), group):
            chunk = sorted(out[g:g + group], key=lambda kr: int(lengths[kr[0]][kr[1]]))
            batches = [chunk[i:i + batch] for i in range(0, len(chunk), batch)]
            for i in rng.permutation(len(batches)):
                grouped += batches[i]
        return grouped

    def lengths(self, k: int) -> np.ndarray:
        """[N] int: the token counts of shard k's rows (read without loading its features)."""
        if k not in self._lengths:
            path = Path(self.shards[k].get("dir", self.dir)) / self.shards[k]["file"]
            try:
                with np.load(path) as z:
                    self._lengths[k] = np.asarray(z["lengths"])
            except (OSError, zipfile.BadZipFile, KeyError, ValueError, EOFError) as e:
                raise DataError(f"{path}: corrupt or unreadable shard ({type(e).__name__}: {e})") from None
        return self._lengths[k]

    def batches_per_epoch(self, batch: int, drop_last: bool = True) -> int:
        n = self.num_examples
        return n // batch if drop_last else -(-n // batch)

    def iterate(self, batch: int, seed: int, epoch: int, *, start: int = 0, pad_to: int | None = None,
                drop_last: bool = True, group: int = 0) -> Iterator[dict[str, np.ndarray]]:
        """Deterministic shuffled batches of one epoch as numpy dicts (the shard keys plus `index`,
        the (shard, row) pairs), from batch number `start`, padded to `pad_to` (default max_len);
        `group`: see `order`."""
        t = pad_to or self.manifest["max_len"]
        order = self.order(seed, epoch, group=group, batch=batch)
        for b in range(start, self.batches_per_epoch(batch, drop_last)):
            rows = order[b * batch:(b + 1) * batch]
            out = {"tokens": np.zeros((batch, t), np.int32), "lengths": np.zeros((batch,), np.int32),
                   "loss_mask": np.zeros((batch, t), bool), "index": np.full((batch, 2), -1, np.int64)}
            for key, w in (("aux", self.manifest["aux_width"]), ("final", self.manifest["hidden_size"])):
                out[key] = np.zeros((batch, t, w), np.float16)
            for i, (k, r) in enumerate(rows):
                s = self.shard(k)
                n = min(int(s["lengths"][r]), t)
                out["lengths"][i], out["index"][i] = n, (k, r)
                for key in ("tokens", "loss_mask", "aux", "final"):
                    out[key][i, :n] = s[key][r, :n]
            yield out

    def loader(self, batch: int, seed: int, **kw) -> "BatchLoader":
        return BatchLoader(self, batch, seed, **kw)


class CacheUnion(FeatureCache):
    """Several caches of one target and feature layout read as one (e.g. regenerated responses
    plus raw ShareGPT ones): their shards side by side, shuffled together."""

    SAME = ("target_fingerprint", "feature_layers", "hidden_size", "aux_width", "vocab_size")

    def __init__(self, directories: Sequence[str | Path]):
        caches = [FeatureCache(d) for d in directories]
        if not caches:
            raise DataError("a cache union needs at least one directory")
        first = caches[0]
        for c in caches[1:]:
            c.check(**{k: first.manifest.get(k) for k in self.SAME})
        self.dir = first.dir
        self.manifest_path = first.manifest_path
        self.manifest = {**first.manifest, "max_len": max(c.manifest["max_len"] for c in caches),
                         "source": "+".join(str(c.manifest.get("source")) for c in caches),
                         "shards": [{**s, "dir": str(c.dir)} for c in caches for s in c.shards],
                         "union": [str(c.dir) for c in caches]}
        self._loaded, self._lengths = {}, {}


class BatchLoader:
    """Endless batches over epochs with a resumable position: `state_dict()` -> `load_state_dict()`
    continues with exactly the batch that would have come next."""

    def __init__(self, cache: FeatureCache, batch: int, seed: int, **iterate_kw):
        if cache.batches_per_epoch(batch, iterate_kw.get("drop_last", True)) < 1:
            raise DataError(f"{cache.dir}: {cache.num_examples} examples make no batch of {batch}")
        self.cache, self.batch, self.seed, self.kw = cache, batch, seed, iterate_kw
        self.epoch, self.step, self._it = 0, 0, None

    def state_dict(self) -> dict:
        return {"seed": self.seed, "epoch": self.epoch, "batch_in_epoch": self.step}

    def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self.seed:
            raise DataError(f"loader state has seed {state['seed']}, this loader {self.seed}")
        self.epoch, self.step, self._it = int(state["epoch"]), int(state["batch_in_epoch"]), None

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        while True:
            if self._it is None:
                self._it = self.cache.iterate(self.batch, self.seed, self.epoch, start=self.step, **self.kw)
            try:
                out = next(self._it)
                self.step += 1
                return out
            except StopIteration:
                self.epoch, self.step, self._it = self.epoch + 1, 0, None


def build_cache(out_dir: str | Path, conversations: Iterable[Conversation], model_params: dict, cfg, tokenizer, *,
                target: str, request: FeatureRequest, num_conversations: int, max_len: int = 1024,
                source: str = "raw", temperature: float = 0.8, seed: int = 0, engine=None,
                shard_conversations: int = 64, batch: int = 8, resume: bool = True, max_shards: int | None = None,
                progress: bool = False, first_conversation: int = 0, quantize: str = "none",
                **example_kw) -> FeatureCache:
    """Build (or resume) the cache of `num_conversations` conversations, from the
    `first_conversation`-th on (a campaign round takes the conversations after the last round's).

    `max_shards` stops after that many new shards (what a killed job leaves). A resumed build checks
    that every setting matches the manifest and skips the conversations already consumed."""
    from tqdm.auto import tqdm

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    settings = {"format": FORMAT_VERSION, "target": target, "target_fingerprint": target_fingerprint(model_params, cfg),
                "feature_layers": [int(k) for k in request.layers], "hidden_size": cfg.hidden_size,
                "aux_width": cfg.hidden_size * len(request.layers), "vocab_size": cfg.vocab_size,
                "max_len": max_len, "source": source, "temperature": float(temperature) if source != "raw" else None,
                "seed": seed, "shard_conversations": shard_conversations, "num_conversations": num_conversations,
                **({"quantize": quantize} if quantize != "none" else {}),
                **({"first_conversation": first_conversation} if first_conversation else {}),
                **({"sampled_every": example_kw["sampled_every"],
                    "sampled_temperature": example_kw.get("sampled_temperature", 0.7)}
                   if example_kw.get("sampled_every") else {})}
    manifest_path = out / "manifest.json"
    if manifest_path.exists() and resume:
        manifest = FeatureCache(out).check(**{k: v for k, v in settings.items() if k != "num_conversations"}).manifest
    else:
        manifest = {**settings, "position": 0, "num_examples": 0, "shards": []}
    manifest["num_conversations"] = num_conversations
    it = iter(conversations)
    for _ in range(first_conversation + manifest["position"]):
        next(it, None)
    bar = tqdm(total=num_conversations, initial=manifest["position"], desc="data", unit="conv", disable=not progress)
    new = 0
    while manifest["position"] < num_conversations and (max_shards is None or new < max_shards):
        take = min(shard_conversations, num_conversations - manifest["position"])
        convs = [c for _, c in zip(range(take), it)]
        if not convs:
            break
        exs = build_examples(convs, tokenizer, source=source, engine=engine, max_len=max_len,
                             temperature=temperature, seed=seed,
                             first_index=first_conversation + manifest["position"], **example_kw)
        feats = capture_features(model_params, cfg, [e.tokens for e in exs], request, batch=batch, max_len=max_len,
                                 quantize=quantize)
        name = f"shard_{len(manifest['shards']):05d}.npz"
        nbytes = write_shard(out / name, exs, feats)
        manifest["position"] += len(convs)
        manifest["num_examples"] += len(exs)
        manifest["shards"].append({"file": name, "num_examples": len(exs), "bytes": nbytes,
                                   "num_tokens": int(sum(len(e.tokens) for e in exs)),
                                   "loss_tokens": int(sum(e.loss_mask.sum() for e in exs)),
                                   "conversations": [first_conversation + manifest["position"] - len(convs),
                                                     first_conversation + manifest["position"]]})
        _atomic_write(manifest_path, json.dumps(manifest, indent=1).encode())
        bar.update(len(convs))
        bar.set_postfix(examples=manifest["num_examples"])
        new += 1
        if len(convs) < take:
            break  # the source ran out
    bar.close()
    if not manifest_path.exists():
        _atomic_write(manifest_path, json.dumps(manifest, indent=1).encode())
    return FeatureCache(out)


def prepare_data(target: str = "default", *, out_dir: str | Path, num_conversations: int, source: str = "regenerate",
                 temperature: float = 0.8, max_len: int = 1024, feature_request: FeatureRequest | None = None,
                 batch: int = 16, progress: bool = True, resume: bool = True, seed: int = 0,
                 heldout_fraction: float = 0.02, sharegpt: str | Path | None = None, model=None,
                 shard_conversations: int = 64, max_new_tokens: int | None = None,
                 split: str = "train", first_conversation: int = 0, sampled_every: int = 0,
                 sampled_temperature: float = 0.7, quantize: str = "none") -> FeatureCache:
    """The CLI's entry: load the target, build (or resume) the cache of one ShareGPT split
    ('train', or 'heldout' for evaluation sets training never sees) in `out_dir`.
    `feature_request` default: EAGLE-3's layers plus the final-norm state. `quantize`: regenerate
    and capture on the quantized target (engine.quantize), as it will be served."""
    from jaxspec.models.loading import load_model

    model = model or load_model(target, progress=progress, gguf_blocks=quantize == "gguf")
    cfg = model.config
    request = feature_request or FeatureRequest(eagle3_layers(cfg.num_layers), True)
    engine = None
    if source == "regenerate":
        from jaxspec.config import EngineSection
        from jaxspec.engine import Engine
        from jaxspec.engine.assemble import stop_token_ids

        engine = Engine(model.params, cfg, EngineSection(max_batch_size=batch, max_context=max_len, quantize=quantize),
                        progress=progress)
        stops = stop_token_ids(model)
    else:
        stops = None
    convs = sharegpt_conversations(split, path=sharegpt, heldout_fraction=heldout_fraction)
    return build_cache(out_dir, convs, model.params, cfg, model.tokenizer, target=target, request=request,
                       num_conversations=num_conversations, max_len=max_len, source=source,
                       temperature=temperature, seed=seed, engine=engine, batch=min(batch, 8), resume=resume,
                       progress=progress, shard_conversations=shard_conversations, stop_ids=stops,
                       max_new_tokens=max_new_tokens, first_conversation=first_conversation, quantize=quantize,
                       **({"sampled_every": sampled_every, "sampled_temperature": sampled_temperature}
                          if sampled_every else {}))


# --------------------------------------------------------------------------- #
# EAGLE-3 draft vocabulary
# --------------------------------------------------------------------------- #


def draft_vocab(cache_or_counts: FeatureCache | np.ndarray, draft_vocab_size: int,
                target_vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """(d2t int64 [Vd], t2d bool [V]) as EAGLE-3 / SpecForge publish them: the `draft_vocab_size` most
    frequent loss-masked target tokens (ties to the lower id; too few distinct tokens are filled with
    the lowest unused ids), sorted by id; target id = i + d2t[i]; t2d[target id] = True."""
    if not 0 < draft_vocab_size <= target_vocab:
        raise DataError(f"draft_vocab_size {draft_vocab_size} is not in [1, target vocab {target_vocab}]")
    counts = (cache_or_counts.token_counts(target_vocab) if isinstance(cache_or_counts, FeatureCache)
              else np.asarray(cache_or_counts, np.int64))
    if counts.shape != (target_vocab,):
        raise DataError(f"token counts have shape {counts.shape}, expected ({target_vocab},)")
    ranked = np.lexsort((np.arange(target_vocab), -counts))  # by count desc, then id asc
    seen = ranked[counts[ranked] > 0][:draft_vocab_size]
    fill = np.setdiff1d(np.arange(target_vocab), seen)[: draft_vocab_size - len(seen)]
    used = np.sort(np.concatenate([seen, fill])).astype(np.int64)
    t2d = np.zeros(target_vocab, bool)
    t2d[used] = True
    return used - np.arange(draft_vocab_size, dtype=np.int64), t2d
