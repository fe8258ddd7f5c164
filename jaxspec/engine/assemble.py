"""From a whole Config and a loaded model to the one executor: shared by `jaxspec.LLM` (and so the
CLI) and the server, so a drafter, a corpus or a page budget is set up in one place.

    runner = assemble(cfg, model)                 # offline: calls run to completion
    runner = assemble(cfg, model, serving=True)   # the server: bounded calls per draft length
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from jaxspec.config import Config
from jaxspec.engine.runner import ModelRunner


def stop_token_ids(model) -> tuple[int, ...]:
    """The ids generation stops at: the config's EOS ids and the tokenizer's."""
    ids = set(model.config.eos_token_ids)
    tok = model.tokenizer
    if tok is not None and tok.eos_token_id is not None:
        ids.add(int(tok.eos_token_id))
    return tuple(sorted(ids))


def model_dtype(cfg: Config):
    """The jnp dtype of `model.dtype` (the config validated it: float32 or bfloat16)."""
    import jax.numpy as jnp

    return jnp.float32 if cfg.model.dtype == "float32" else jnp.bfloat16


def build_draft(cfg: Config, model, dtype, progress: bool):
    """(params, config) of the draft model or head the spec needs, or None (`drafters.load`)."""
    from jaxspec.speculative.drafters.load import load_draft

    return load_draft(cfg.spec, model, dtype, cache_dir=cfg.model.cache_dir or None, progress=progress)


def load_corpus(path: str, model, label: str = "ngram_corpus"):
    """The n-gram corpus file as device-ready token ids [K]; PromptError naming `label` and the line."""
    from jaxspec.prompts import PromptError
    from jaxspec.speculative.drafters.ngram import corpus_token_array

    try:
        return corpus_token_array(path, model.tokenizer, vocab_size=model.config.vocab_size)
    except (ValueError, KeyError) as e:  # json errors are ValueErrors
        raise PromptError(f"{label} {path}: {e}") from None


def assemble(cfg: Config, model, *, mesh=None, progress: bool = True, benchmark: bool = False,
             serving: bool = False, split_pages: bool | None = None,
             corpus_label: str = "spec.ngram_corpus") -> ModelRunner:
    """The runner `cfg` describes over `model` (a LoadedModel).

    Offline: each decode call runs until its rows are done, at the configured shape, with plain
    decoding (k = 0) and the shorter chains of `spec.adaptive_lengths` beside it when the adaptive
    policy is on (`spec.adaptive`).
    Serving: calls of `serve.steps_per_call` iterations at each candidate draft length
    (`serve.adaptive_steps` under `serve.adaptive`, else the configured one), chunked prefill
    (`serve.prefill_chunk`), and pages sized from free memory under `serve.kv_memory_fraction`.
    `split_pages` (a mesh with data > 1): a page pool per data shard; None = `serve.split_pages`."""
    from jaxspec.speculative.drafters import algorithm_info

    spec, s, ecfg = cfg.spec, cfg.serve, cfg.engine
    spec_on = algorithm_info(spec.algorithm).speculative
    dtype = model_dtype(cfg)
    draft = build_draft(cfg, model, dtype, progress) if spec_on else None
    corpus = load_corpus(spec.ngram_corpus, model, corpus_label) if spec_on and spec.ngram_corpus else None
    split_pages = bool(getattr(s, "split_pages", True)) if split_pages is None else split_pages
    kw = dict(draft=draft, ngram_corpus=corpus, mesh=mesh, progress=progress, benchmark=benchmark,
              split_pages=split_pages)
    if not serving:
        return ModelRunner(model.params, model.config, ecfg, spec=spec if spec_on else None,
                           adaptive_lengths=spec.adaptive_lengths if spec_on and spec.adaptive_on() else None,
                           **kw)
    candidates = None  # the configured shape (a chain or a tree) at its own depth
    if not spec_on:
        candidates = (0,)
    elif s.adaptive:
        candidates = tuple(s.adaptive_steps)
        # The base plan is the deepest candidate (page reserve and buffers size to it).
        spec = dataclasses.replace(spec, topk=1, num_draft_tokens=max(candidates) + 1,
                                   num_steps=max(max(candidates), 1))
    if s.kv_memory_fraction > 0:
        data_shards = mesh.shape["data"] if split_pages and mesh is not None else 1
        ecfg = dataclasses.replace(ecfg, num_pages=num_pages_from_memory(cfg, run_config(model.config, mesh),
                                                                         data_shards))
    return ModelRunner(model.params, model.config, ecfg, spec=spec if spec_on else None,
                       steps_candidates=candidates, steps_per_call=s.steps_per_call,
                       context_buckets=s.context_buckets, prefill_chunk=s.prefill_chunk,
                       max_prefill_batch=s.max_prefill_batch, prefill_tokens=s.prefill_tokens,
                       prefill_piece=s.prefill_piece, **kw)


def num_pages_from_memory(cfg: Config, model_cfg, data_shards: int = 1) -> int:
    """Pages that fit in `kv_memory_fraction` of free device memory (host RAM on CPU). With pages
    split over `data_shards` each accelerator holds 1/data_shards of them (CPU devices share one RAM)."""
    import jax

    dev = jax.devices()[0]
    stats = dev.memory_stats() or {}
    if "bytes_limit" in stats:
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    itemsize = 4 if cfg.model.dtype == "float32" else 2
    per_page = 2 * model_cfg.num_layers * cfg.engine.page_size * model_cfg.num_kv_heads * model_cfg.head_dim * itemsize
    pages = max(2, int(free * cfg.serve.kv_memory_fraction // per_page))
    if dev.platform != "cpu":
        pages *= data_shards
    if jax.process_count() > 1:  # every process must build the same cache shape: process 0's count
        from jax.experimental import multihost_utils

        pages = int(multihost_utils.broadcast_one_to_all(np.int32(pages)))
    return pages


def run_config(model_cfg, mesh):
    """The config the runner runs: heads padded for the mesh's TP size (`models.padding`), so pages are
    sized right."""
    if mesh is None:
        return model_cfg
    from jaxspec.models.padding import padded_config

    return padded_config(model_cfg, mesh.shape["model"])[0]
