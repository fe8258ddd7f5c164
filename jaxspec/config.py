"""One frozen configuration tree, loaded from `configs/*.toml`, overridable on the CLI.

    [model]     where the weights come from, dtype
    [engine]    paged cache and static shape buckets
    [sampling]  per-request defaults
    [spec]      speculative decoding
    [serve]     the OpenAI-compatible server (`python -m jaxspec.serve`)

`load_config("configs/x.toml", {"engine.page_size": 1})` reads the file and then
applies dotted overrides; unknown sections or keys and ill-typed values raise
`ConfigValueError` naming the key.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
import typing
from pathlib import Path
from typing import Any

from jaxspec.sampling_params import BOUNDS, ENGINE_FIELDS


class ConfigValueError(ValueError):
    """An invalid configuration value; the message names the key."""


@dataclasses.dataclass(frozen=True)
class ModelSection:
    path: str = "default"
    dtype: str = "float32"
    cache_dir: str = ""  # "" = $JAXSPEC_CACHE or ~/.cache/jaxspec


@dataclasses.dataclass(frozen=True)
class EngineSection:
    page_size: int = 16
    num_pages: int = 0  # 0 = enough for max_batch_size sequences of max_context tokens
    max_batch_size: int = 8
    max_context: int = 2048
    batch_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    length_buckets: tuple[int, ...] = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
    # "scan" (compile time independent of depth), "unrolled" (per-layer weight
    # buffers; ~1.6x faster forwards on XLA:CPU) or "auto" (unrolled on CPU only).
    layer_loop: str = "auto"
    # Float32 forwards on XLA:CPU: "native" (jaxspec.native C++ FFI kernels: matmul
    # over column-tiled weights, so a verify block or batch of ~8 rows costs about
    # one row's weight traffic, and paged attention read in place), "xla" (XLA's
    # own ops) or "auto" (native on a single CPU device when the kernels build).
    cpu_kernels: str = "auto"
    # Which distribution log-probabilities report (vLLM's logprobs_mode): "raw", the target's
    # log-softmax, or "processed", the one the request samples from (temperature, top-k, top-p).
    logprobs_mode: str = "raw"
    # Target weights: "none" (as loaded) or "int8": weight-only int8 with a float32 scale per output
    # column, quantized at load, every matrix and the LM head (the embedding lookup stays float32);
    # the native CPU kernels widen them in registers (jaxspec/native/packed_matmul.py); or "gguf":
    # a GGUF model's own Q4_0 / Q4_1 / Q8_0 blocks, native CPU kernels only (native/block_matmul.py).
    quantize: str = "none"
    # Full KV pages (the target's and the drafter's) shared between requests by the hash of their
    # tokens, kept after a request ends and evicted LRU when the pool runs dry (jaxspec/cache/prefix.py).
    prefix_cache: bool = True


@dataclasses.dataclass(frozen=True)
class SamplingSection:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int = 0
    ignore_eos: bool = False


def opt(default: Any, help: str, *, flag: str = "", metavar: str | None = None,
        choices: tuple[str, ...] | None = None, owned: bool = False) -> Any:
    """A config field with its command-line flag: the CLI and the server generate their flags from
    this metadata (`jaxspec.generate.section_flags`), so a new option is one field here.

    flag: the flag's name without dashes ("" = the field's name, with dashes); "-" = no flag.
    owned: only the drafters that list the field in their registration (`reads`) use it, so any
    other algorithm refuses a non-default value instead of ignoring it."""
    meta = {"help": help, "flag": flag, "metavar": metavar, "choices": choices, "owned": owned}
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass(frozen=True)
class SpecSection:
    algorithm: str = opt("none", "speculative algorithm (a built-in, an alias or a registered plugin)",
                         flag="spec")
    num_steps: int = opt(3, "draft steps per iteration (tree depth)")
    topk: int = opt(1, "branching per draft step (1 = chain)")
    num_draft_tokens: int = opt(4, "tree nodes verified per step, root included")
    # Greedy rule for greedy rows, the coupled rule (= plain sampling's tokens) for sampled ones.
    verify: str = opt("auto", "auto (default) = coupled: sampled output is plain sampling's with the same seed; "
                      "rejection: recursive rejection sampling (exact in distribution)",
                      choices=("auto", "greedy", "target-only", "rejection", "coupled"))
    threshold_single: float = opt(1.0, "target-only verify; < 1 is NOT lossless")
    threshold_acc: float = opt(1.0, "target-only verify; < 1 is NOT lossless")
    draft_model: str = opt("", "standalone: 'default', a HF dir or a .gguf (same tokenizer); a head drafter: a "
                           "head directory in its published format ('default' or nothing: the head shipped for "
                           "the embedded model; eagle/nextn without one: the target's own MTP layers)")
    draft_layers: int = opt(0, "standalone draft = first N layers of the draft (or target)", owned=True)
    ngram_min_match: int = opt(1, "shortest suffix match that drafts")
    ngram_max_match: int = opt(4, "longest suffix match tried")
    # Entry n-1 caps the drafts of a length-n match (past the tuple: num_draft_tokens - 1).
    # 1-gram matches are mostly rejected; 3 drafts keep their verify at the width
    # that costs a plain step (see jaxspec.speculative.drafters.ngram).
    ngram_draft_tokens_by_match: tuple[int, ...] = opt(
        (3,), "most drafts from a match of length 1, 2, ... ('' = no cap; default 3)", metavar="N1,N2,...")
    ngram_corpus: str = opt("", "extra n-gram corpus (host-side index)", metavar="FILE.jsonl", owned=True)
    simulate_accept_length: int = opt(0, "benchmark only: force acceptance length L; output is NOT exact",
                                      metavar="L")
    # Fixed trees: a JSON list of top-k rank paths ("medusa choices"), e.g. [[0], [1], [0, 0]];
    # "" = the num_draft_tokens - 1 paths of smallest rank sum within topk x num_steps.
    tree_choices: str = opt("", "tree as rank paths, e.g. '[[0],[1],[0,0]]': Medusa's tree, and the sampled "
                            "tree of eagle/eagle3/standalone", metavar="JSON", owned=True)
    # Trees on sampled rows under rejection verify: "sampled" draws each node's children from the
    # drafter's q without replacement on a fixed rank tree (drafters/sampled_tree.py); "topk" keeps
    # the deterministic top-k tree, verified as one-hot proposals (lossless, accepts less).
    tree_sampling: str = opt("sampled", "trees on sampled rows: 'sampled' (children drawn from the drafter's q, "
                             "multi-draft rejection verify) or 'topk' (deterministic, one-hot verified)",
                             choices=("sampled", "topk"), owned=True)
    # How an EAGLE-3 config's eagle_aux_hidden_state_layer_ids count: "output" (SpecForge /
    # SGLang: id i = the output of layer i) or "input" (vLLM: the state entering layer i).
    eagle3_layer_ids: str = opt("output", "EAGLE-3 eagle_aux_hidden_state_layer_ids count layer outputs "
                                "(SpecForge/SGLang, default) or layer inputs (vLLM)", choices=("output", "input"))
    # DSPARK's planner table (steps/s against tokens in the batch; `python -m jaxspec.bench sps`):
    # "default" = the one measured for this platform under configs/sps/ (none: verify every
    # draft), "flat" = verify every draft, or a JSON file.
    sps_table: str = opt("default", "the planner table of a head with a confidence head (dspark): 'default' "
                         "(configs/sps/ for this platform), 'flat' (verify every draft) or a JSON file from "
                         "`python -m jaxspec.bench sps`", owned=True)
    # The CLI's and the API's engine (the server's policy is serve.adaptive): per batch bucket, plain
    # decoding or this draft shape, whichever is measured to commit more tokens per second
    # (jaxspec.engine.adaptive). "auto": on unless the shape (num_draft_tokens, num_steps, topk,
    # tree_choices) differs from these defaults, i.e. the user fixed one; "on" / "off" force it.
    adaptive: str = opt("auto", "per batch bucket, plain decoding or the draft shape, whichever measures "
                        "faster; auto (default): on unless a shape flag (--num-draft-tokens, --num-steps, "
                        "--topk, --tree-choices) changes the default shape", flag="-", choices=("auto", "on", "off"))

    # Shorter chains the engine's policy may run instead, beside plain decoding and the shape itself:
    # at a batch where the configured width costs too much, a chain of 1 often still pays.
    adaptive_lengths: tuple[int, ...] = opt((1,), "shorter draft chains the adaptive policy may also choose, "
                                            "beside plain decoding and the configured shape ('' = none)",
                                            flag="-", metavar="K1,K2,...")

    def adaptive_on(self) -> bool:
        if self.adaptive != "auto":
            return self.adaptive == "on"
        default = SpecSection()
        shape = ("num_draft_tokens", "num_steps", "topk", "tree_choices")
        return (all(getattr(self, f) == getattr(default, f) for f in shape) and not self.simulate_accept_length)


@dataclasses.dataclass(frozen=True)
class ServeSection:
    host: str = "127.0.0.1"  # loopback only unless asked
    port: int = 8000
    api_key: str = ""  # "" = no auth
    served_model_name: str = ""  # "" = the model path's name
    # Speculative iterations per device call: larger amortises the host round
    # trip, smaller lets new requests in sooner (they wait at most one call).
    steps_per_call: int = 4
    prefill_chunk: int = 256  # prompt tokens per prefill call and row (one row per sequence, not packed)
    max_prefill_batch: int = 8
    prefill_tokens: int = 512  # padded tokens (rows x chunk bucket) per prefill call
    # Packed prefill: rows of this many prompt tokens, a sequence taking as many as it needs, when the
    # drafter keeps no per-sequence state (plain decoding, n-gram); 0 = one row per sequence, padded
    # to the call's chunk bucket (serve/prefill_plan.py).
    prefill_piece: int = 16
    # Prefill calls one scheduler step may run back to back (admitting arrivals between them)
    # before the running batch's decode call: 1 alternates, more favours time to first token over
    # the running requests' inter-token latency (SGLang's scheduler runs every ready prefill first).
    prefill_calls_per_step: int = 1
    # Iterations of a decode call while a prefill waits (a request arrived, or a prompt has chunks
    # left): the running batch still advances, and the waiting prompt's next call comes a decode
    # iteration later instead of steps_per_call iterations later. A runtime input of the same
    # programs (no compile). 0 = always steps_per_call.
    yield_steps: int = 1
    # Seconds after a request ends (not aborted) during which decode calls also run only `yield_steps`
    # iterations, until as many new requests have arrived: a client at a fixed concurrency (a chat
    # agent's next turn, a benchmark's next request) sends its next request as soon as an answer ends,
    # a few ms into the next call, and would wait out all `steps_per_call`. 0 = off.
    follow_up_window: float = 0.25
    # Seconds the scheduler holds its next call after a request ends, for that request's follow-up to
    # arrive (within follow_up_window): it then joins the next prefill call instead of waiting that
    # call out in the queue. 0 = off.
    follow_up_grace: float = 0.02
    # A directory: the scheduler writes its call-by-call timeline there (trace-<pid>.jsonl,
    # serve/trace.py; `python -m jaxspec.bench trace` reads it). "" = off.
    trace: str = ""
    context_buckets: tuple[int, ...] = (512,)  # decode buckets below engine.max_context
    adaptive: bool = True
    # Under a mesh with data > 1: a page pool per data shard, each sequence pinned to one shard
    # (jaxspec/serve/scheduler.py); false keeps one pool replicated over "data".
    split_pages: bool = True
    # Draft lengths adaptive speculation picks from (chains; 0 = no speculation).
    # Each is a compiled bucket set, so keep the table short.
    adaptive_steps: tuple[int, ...] = (0, 1, 3)
    adaptive_hysteresis: float = 0.1
    # A draft length's score must beat plain decoding's by this much (jaxspec/engine/adaptive.py):
    # the score misses the batch tail that speculation's uneven rows leave.
    adaptive_margin: float = 0.05
    kv_memory_fraction: float = 0.0  # > 0 sizes the page pool from free device memory
    max_body_bytes: int = 1 << 20
    # XLA's persistent compilation cache: a restart loads the buckets instead of
    # compiling them again. "" = <model cache dir>/xla, "off" = disabled.
    compilation_cache: str = ""
    # SIGTERM drains: no new requests (503), running ones get this many seconds to finish,
    # the rest end with an error event and [DONE]; then the process exits 0.
    shutdown_grace: float = 30.0
    # "auto": temperature / top_p / top_k a request leaves out default to the model's
    # generation_config.json (vLLM's --generation-config auto); "none": the OpenAI defaults.
    generation_config: str = "auto"
    # Structured output runs "+grammar" builds of the programs, which cannot be stored on disk (a host
    # callback lives in them): true compiles them in a background thread once the server is ready,
    # so the first constrained request of a bucket does not stall on its compile; false compiles each
    # on first use.
    grammar_warmup: bool = True


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelSection = ModelSection()
    engine: EngineSection = EngineSection()
    sampling: SamplingSection = SamplingSection()
    spec: SpecSection = SpecSection()
    serve: ServeSection = ServeSection()

    def validate(self) -> "Config":
        e, s = self.engine, self.sampling
        checks = [
            (self.model.dtype in ("float32", "bfloat16"), "model.dtype must be float32 or bfloat16"),
            (e.page_size >= 1, "engine.page_size must be >= 1"),
            (e.layer_loop in ("auto", "scan", "unrolled"), "engine.layer_loop must be auto, scan or unrolled"),
            (e.cpu_kernels in ("auto", "native", "xla"), "engine.cpu_kernels must be auto, native or xla"),
            (e.logprobs_mode in ("raw", "processed"), "engine.logprobs_mode must be raw or processed"),
            (e.quantize in ("none", "int8", "gguf"), "engine.quantize must be none, int8 or gguf"),
            # Page 0 is the null page: one page leaves nothing to allocate.
            (e.num_pages == 0 or e.num_pages >= 2, "engine.num_pages must be 0 (automatic) or >= 2"),
            (e.max_batch_size >= 1, "engine.max_batch_size must be >= 1"),
            (e.max_context >= 2, "engine.max_context must be >= 2"),
            (e.batch_buckets and all(b >= 1 for b in e.batch_buckets),
             "engine.batch_buckets must be a non-empty list of sizes >= 1"),
            (e.length_buckets and all(b >= 1 for b in e.length_buckets),
             "engine.length_buckets must be a non-empty list of lengths >= 1"),
            # The rules every front end shares (jaxspec.sampling_params), under the config's key names.
            *((BOUNDS[field].ok(getattr(s, key)), f"sampling.{key} must be {BOUNDS[field].bound}")
              for key, field in ENGINE_FIELDS.items()),
            (self.spec.adaptive in ("auto", "on", "off"), "spec.adaptive must be auto, on or off"),
            (all(k >= 1 for k in self.spec.adaptive_lengths), "spec.adaptive_lengths must be draft lengths >= 1"),
            (0 <= self.serve.port < 65536, "serve.port must be in [0, 65535]"),
            (self.serve.steps_per_call >= 1, "serve.steps_per_call must be >= 1"),
            (self.serve.prefill_chunk >= 1, "serve.prefill_chunk must be >= 1"),
            (self.serve.max_prefill_batch >= 1, "serve.max_prefill_batch must be >= 1"),
            (self.serve.prefill_tokens >= 1, "serve.prefill_tokens must be >= 1"),
            (0 <= self.serve.prefill_piece <= self.serve.prefill_tokens,
             "serve.prefill_piece must be 0 (off) or between 1 and serve.prefill_tokens"),
            (self.serve.prefill_calls_per_step >= 1, "serve.prefill_calls_per_step must be >= 1"),
            (self.serve.follow_up_window >= 0, "serve.follow_up_window must be >= 0 seconds (0 = off)"),
            (self.serve.follow_up_grace >= 0, "serve.follow_up_grace must be >= 0 seconds (0 = off)"),
            (0 <= self.serve.yield_steps <= self.serve.steps_per_call,
             "serve.yield_steps must be between 0 (off) and serve.steps_per_call"),
            (all(k >= 0 for k in self.serve.adaptive_steps) and self.serve.adaptive_steps,
             "serve.adaptive_steps must be non-empty draft lengths >= 0"),
            (self.serve.adaptive_hysteresis >= 0, "serve.adaptive_hysteresis must be >= 0"),
            (self.serve.adaptive_margin >= 0, "serve.adaptive_margin must be >= 0 (0 = off)"),
            (0 <= self.serve.kv_memory_fraction < 1, "serve.kv_memory_fraction must be in [0, 1)"),
            (self.serve.max_body_bytes >= 1024, "serve.max_body_bytes must be >= 1024"),
            (self.serve.generation_config in ("auto", "none"), "serve.generation_config must be auto or none"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ConfigValueError(msg)
        # [spec] is checked by the drafter registry, which knows each algorithm's needs, where the
        # config becomes an engine (jaxspec.speculative.drafters.validate_config).
        return self


def _coerce(key: str, value: Any, annotation: Any) -> Any:
    origin = typing.get_origin(annotation)
    if origin is tuple:
        if isinstance(value, str):
            value = [v for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigValueError(f"{key}: expected a list, got {value!r}")
        return tuple(_coerce(key, v, typing.get_args(annotation)[0]) for v in value)
    try:
        if annotation is bool:
            if isinstance(value, str):
                if value.lower() in ("1", "true", "yes", "on"):
                    return True
                if value.lower() in ("0", "false", "no", "off"):
                    return False
                raise ValueError(value)
            if not isinstance(value, bool):  # TOML `ignore_eos = 5` is a mistake, not True
                raise TypeError(value)
            return value
        # A TOML/--set `true` is not the number 1, and nan/inf pass every `>=` check downstream.
        if isinstance(value, bool):
            raise TypeError(value)
        if annotation is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            return int(value)
        if annotation is float:
            value = float(value)
            if not math.isfinite(value):
                raise ValueError(value)
            return value
        return str(value)
    except (TypeError, ValueError):
        what = "a finite float" if annotation is float else annotation.__name__
        raise ConfigValueError(f"{key}: expected {what}, got {value!r}") from None


def _section_with(section: Any, name: str, values: dict[str, Any]) -> Any:
    hints = typing.get_type_hints(type(section))
    updates = {}
    for key, value in values.items():
        if key not in hints:
            valid = ", ".join(sorted(hints))
            raise ConfigValueError(f"unknown key {name}.{key}; valid keys: {valid}")
        updates[key] = _coerce(f"{name}.{key}", value, hints[key])
    return dataclasses.replace(section, **updates)


def apply_overrides(cfg: Config, overrides: dict[str, Any], *, validate: bool = True) -> Config:
    """Apply {"section.key": value} (or {"section": {key: value}}) on top of `cfg`. validate=False
    leaves the checks to a later layer (a file whose flags complete it: `load_config`)."""
    grouped: dict[str, dict[str, Any]] = {}
    for dotted, value in overrides.items():
        if isinstance(value, dict) and "." not in dotted:
            grouped.setdefault(dotted, {}).update(value)
            continue
        section, _, key = dotted.partition(".")
        if not key:
            raise ConfigValueError(f"override {dotted!r} must look like section.key")
        grouped.setdefault(section, {})[key] = value
    sections = {f.name for f in dataclasses.fields(Config)}
    for section, values in grouped.items():
        if section not in sections:
            raise ConfigValueError(f"unknown config section [{section}]; valid: {sorted(sections)}")
        cfg = dataclasses.replace(cfg, **{section: _section_with(getattr(cfg, section), section, values)})
    return cfg.validate() if validate else cfg


def read_toml(path: str | Path) -> dict[str, Any]:
    """A TOML file as a dict; ConfigValueError naming the file when it is missing or invalid."""
    try:
        return tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigValueError(f"config file not found: {path}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigValueError(f"{path}: invalid TOML: {e}") from None


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None, *,
                base: Config | None = None) -> Config:
    """`base` (default: Config()) < the TOML file < `overrides`."""
    cfg = base or Config()
    if path:  # checked with the overrides on top: a file may leave a field to the flags
        cfg = apply_overrides(cfg, read_toml(path), validate=False)
    return apply_overrides(cfg, overrides or {})
