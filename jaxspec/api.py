"""`jaxspec.LLM`: the Python front door, in vLLM's offline-inference convention.

    import jaxspec
    llm = jaxspec.LLM("default", spec="ngram", num_draft_tokens=8)
    out = llm.generate(["Repeat: the cat sat on the mat."], jaxspec.SamplingParams(max_tokens=64))
    print(out[0].text, out[0].tau)
    print(llm.spec_stats()["tau"])

It assembles what the CLI and the server run, from the same pieces: every
option is a key of `jaxspec.config` (validated there, errors naming the key),
the weights come from `models.loading` and `speculative.drafters.load`, and
generation is one `engine.Engine`. `python -m jaxspec.generate` is built on
this class. Nothing here imports JAX until an LLM is made, so `import jaxspec`
stays cheap; JAX picks the backend (GPU/TPU when present, else CPU).
"""

from __future__ import annotations

import dataclasses
import numbers
import secrets
import threading
from pathlib import Path
from typing import Any, Sequence

from jaxspec.config import Config, ConfigValueError, EngineSection, SpecSection, apply_overrides, load_config
from jaxspec.prompts import PromptError, encode_entry
from jaxspec.sampling_params import SamplingError, SamplingParams, sampling_list

# Options an LLM(...) call may pass, by [section]: every engine and spec key, and the
# model's cache_dir. The spec algorithm, draft model, dtype and path have their own arguments.
_OWN_ARGS = {"algorithm": "spec", "draft_model": "draft_model", "dtype": "dtype", "path": "model"}
OPTION_SECTIONS = {
    **{f.name: "engine" for f in dataclasses.fields(EngineSection)},
    **{f.name: "spec" for f in dataclasses.fields(SpecSection) if f.name not in _OWN_ARGS},
    "cache_dir": "model",
}


@dataclasses.dataclass(frozen=True)
class Logprob:
    """vLLM's: a token's log-probability, its rank in the distribution (1 = likeliest) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclasses.dataclass(frozen=True)
class CompletionOutput:
    """One sample of one prompt.

    text: the decoded tokens (special tokens skipped), cut before a stop string.
    token_ids: the generated ids (through the token that completed a stop string).
    finish_reason: "stop" (EOS or a stop string) or "length" (max_tokens).
    seed: the noise key this sample ran with (SamplingParams.seed + index).
    With speculation on, the speculative record of the run: accept_lengths
    (tokens committed per verify step, bonus included), tau (their mean),
    acceptance_rate (accepted / proposed drafts) and position_acceptance
    (entry d-1: fraction of verify steps that accepted at least d drafts).
    These cover every token the engine generated, past a stop string too.
    Without speculation they are None. logprobs (when SamplingParams.logprobs asked): per
    generated token {token id: Logprob} for the token and the N likeliest at its position, under
    the target's raw distribution by default (vLLM's layout; engine.logprobs_mode): read from the
    logits the loop verified the token with, no extra forward (speculative/logprobs.py).
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    seed: int
    accept_lengths: list[int] | None = None
    tau: float | None = None
    acceptance_rate: float | None = None
    position_acceptance: tuple[float, ...] | None = None
    logprobs: list[dict[int, Logprob]] | None = None


def _first(name: str) -> property:
    return property(lambda self: getattr(self.outputs[0], name), doc=f"outputs[0].{name}")


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """What one prompt produced: its n samples in `outputs`.

    prompt is as given; prompt_token_ids what the model saw (the chat template
    applied). `text`, `token_ids`, `finish_reason`, `accept_lengths`, `tau`,
    `acceptance_rate` and `position_acceptance` are those of outputs[0], for the
    common n = 1. prompt_logprobs (when SamplingParams.prompt_logprobs asked): per prompt
    token, None for the first, else {token id: Logprob} for the token itself and the N
    likeliest at its position, under the target's raw distribution (vLLM's layout)."""

    prompt: Any
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (its first sample's)

    text = _first("text")
    token_ids = _first("token_ids")
    finish_reason = _first("finish_reason")
    accept_lengths = _first("accept_lengths")
    tau = _first("tau")
    acceptance_rate = _first("acceptance_rate")
    position_acceptance = _first("position_acceptance")


# ---- assembling the engine (shared with the CLI and the server) ------------------------------------


def resolve_mesh(mesh):
    """None, a jax Mesh, a MeshShape or "DPxTP" -> a ("data", "model") Mesh or None."""
    if mesh is None:
        return None
    from jaxspec import mesh as sharding

    if isinstance(mesh, (str, sharding.MeshShape)):
        return sharding.make_mesh(mesh)
    if hasattr(mesh, "shape") and set(getattr(mesh, "axis_names", ())) == set(sharding.AXES):
        return mesh
    raise sharding.MeshError(f"mesh must be None, 'DPxTP' (e.g. '4x2'), a MeshShape or a jax Mesh with axes "
                             f"{sharding.AXES}; got {mesh!r}"[:200])


def config_for(model: str, spec: Any, draft_model: str | None, dtype: str, options: dict[str, Any]) -> Config:
    """The Config an LLM(...) call describes; ConfigValueError naming a bad or unknown option."""
    overrides: dict[str, Any] = {"model.path": model, "model.dtype": dtype}
    base = None
    if isinstance(spec, (SpecSection, dict)):
        # Checked with the other arguments on top (draft_model= may complete it).
        base = apply_overrides(Config(), {"spec": dataclasses.asdict(spec) if isinstance(spec, SpecSection) else spec},
                               validate=False)
    elif spec is None or isinstance(spec, str):
        overrides["spec.algorithm"] = spec or "none"
    else:
        raise ConfigValueError(f"spec must be None, an algorithm name ('ngram', 'eagle3', ...), a dict of [spec] "
                               f"keys or a SpecSection; got {type(spec).__name__}")
    if draft_model is not None:
        overrides["spec.draft_model"] = str(draft_model)
    for key, value in options.items():
        if key in _OWN_ARGS:
            raise ConfigValueError(f"option {key!r}: pass it as LLM's {_OWN_ARGS[key]}= argument")
        if key not in OPTION_SECTIONS:
            raise ConfigValueError(f"unknown option {key!r}; valid options: {', '.join(sorted(OPTION_SECTIONS))}")
        overrides[f"{OPTION_SECTIONS[key]}.{key}"] = value
    from jaxspec.models.loading import sampling_overrides

    # The model's generation_config.json sits under everything the call says (vLLM's LLM does the same).
    gen = sampling_overrides(model, overrides.get("model.cache_dir") or None)
    if gen:
        base = apply_overrides(base or load_config(None), gen)
    return load_config(None, overrides, base=base)  # an option beats the spec dict, as a later --set would


# ---- prompts and samples ----------------------------------------------------------------------------


def as_prompt_list(prompts: Any) -> list:
    """One prompt (a string, token ids, a dict) or a sequence of them -> a list of prompts."""
    if hasattr(prompts, "tolist") and not isinstance(prompts, (str, dict)):  # numpy: [L] or [B, L] ids
        prompts = prompts.tolist()
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        if not prompts:
            raise PromptError("prompts: the list is empty")
        if all(_is_int(t) for t in prompts):
            return [list(prompts)]  # a single token-id prompt
        return list(prompts)
    raise PromptError(f"prompts must be a string, a list of token ids, a {{'messages': [...]}} dict or a list of "
                      f"these; got {type(prompts).__name__}")


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def encode_prompt(prompt: Any, tokenizer, where: str) -> list[int]:
    """Token ids of one prompt: raw text (no chat template), token ids, or a dict as the CLI's JSONL lines
    ({"messages"} gets the chat template, {"prompt"}, {"prompt_ids"}; a read_jsonl line names its file:line)."""
    if isinstance(prompt, str):
        return encode_entry({"prompt": prompt}, tokenizer, where)
    if isinstance(prompt, (list, tuple)) or hasattr(prompt, "tolist"):
        ids = prompt.tolist() if hasattr(prompt, "tolist") else list(prompt)
        return encode_entry({"prompt_ids": [int(t) if _is_int(t) else t for t in ids]}, tokenizer, where)
    if isinstance(prompt, dict):
        return encode_entry(prompt, tokenizer, prompt.get("_where", where))
    raise PromptError(f"{where} must be a string, a list of token ids or a dict with 'messages', 'prompt' or "
                      f"'prompt_ids'; got {type(prompt).__name__}")


def sample_seeds(sp: SamplingParams) -> list[int]:
    """The seed of each of the n samples: seed + j, as the server numbers its choices.

    Without a seed a base is drawn, so unseeded calls differ, as in vLLM."""
    base = sp.seed if sp.seed is not None else secrets.randbits(32)
    return [(base + j) % 2**32 for j in range(sp.n)]


def cut_at_stop(tokenizer, prompt_ids: Sequence[int], ids: list[int], stops: Sequence[str], min_tokens: int = 0):
    """(text before the first stop string, the ids through the token completing it), or None without a hit.

    Token by token, with the server's detokenizer and matcher, so the API cuts where a stream would;
    a stop string is looked for from the min_tokens-th token on."""
    from jaxspec.detok import IncrementalDetokenizer, StopStringMatcher

    detok, matcher, text = IncrementalDetokenizer(tokenizer, prompt_ids), StopStringMatcher(stops), ""
    for k, t in enumerate(ids):
        out, stopped = matcher.feed(detok.add([t], final=k == len(ids) - 1), armed=k + 1 >= min_tokens)
        text += out
        if stopped:
            return text, ids[: k + 1]
    return None


# ---- the LLM ----------------------------------------------------------------------------------------


class LLM:
    """A model loaded once, with its speculative drafter, ready to generate.

    model: "default" (the embedded SmolLM2-135M-Instruct), a Hugging Face
        directory, a .gguf file (converted once, then cached) or a LoadedModel
        (`jaxspec.models.loading.load_model`) to reuse.
    spec: None (plain decoding), an algorithm name (a built-in such as "ngram" or "eagle3", an
        alias, or a registered plugin: `jaxspec.speculative.algorithm.valid_names()`), or a dict
        of [spec] keys.
    draft_model: the draft model or head directory ("default", or None for
        eagle3 / medusa: the head shipped for the embedded model).
    dtype: "float32" (use it on CPU) or "bfloat16".
    mesh: None, "DPxTP" (e.g. "4x2"), a MeshShape or a ("data", "model") jax
        Mesh to shard over (docs/mesh.md). Multi-host: initialise
        jax.distributed first.
    progress: progress bars while loading and compiling.
    benchmark: allow spec simulate_accept_length (output NOT exact).
    profile_phases: also rerun every batch with draft / verify / other timed
        apart, for spec_stats()'s time split (the fused loop has no per-phase
        clock); costs a second run of each batch.
    **engine_options: any [engine] or [spec] key of jaxspec.config (page_size,
        num_pages, max_batch_size, max_context, batch_buckets, length_buckets,
        layer_loop, cpu_kernels, num_draft_tokens, num_steps, topk, verify,
        ngram_corpus, ...) and cache_dir; docs/cli.md has what each means.

    Compilation is lazy, per shape bucket, on first use; `compile` does it up
    front. Bad arguments raise a ValueError naming the field.

    Attributes: engine (the jaxspec.engine.Engine), tokenizer, config (the
    resolved Config), model_config (the target's ModelConfig as loaded),
    eos_token_ids, default_sampling (what generate uses without `sampling`).
    """

    def __init__(self, model: Any = "default", spec: Any = None, draft_model: str | None = None,
                 dtype: str = "float32", mesh: Any = None, *, progress: bool = True, benchmark: bool = False,
                 profile_phases: bool = False, **engine_options: Any):
        from jaxspec.models.loading import LoadedModel

        loaded = model if isinstance(model, LoadedModel) else None
        cfg = config_for(str(loaded.path if loaded else model), spec, draft_model, dtype, engine_options)
        self._setup(cfg, loaded, mesh, progress, benchmark, profile_phases, "ngram_corpus")

    @classmethod
    def from_config(cls, config: Config | str | Path, *, model: Any = None, mesh: Any = None, progress: bool = True,
                    benchmark: bool = False, profile_phases: bool = False,
                    corpus_label: str = "spec.ngram_corpus") -> "LLM":
        """An LLM from a whole Config or a configs/*.toml path (its [sampling] section is then
        `default_sampling`). `model`: a LoadedModel to use instead of loading config.model.path.
        `corpus_label`: what errors call the n-gram corpus (the CLI says --ngram-corpus)."""
        cfg = config if isinstance(config, Config) else load_config(config)
        self = cls.__new__(cls)
        self._setup(cfg, model, mesh, progress, benchmark, profile_phases, corpus_label)
        return self

    def _setup(self, cfg: Config, model, mesh, progress: bool, benchmark: bool, profile_phases: bool,
               corpus_label: str) -> None:
        from jaxspec.engine import Engine
        from jaxspec.engine.assemble import assemble, model_dtype, stop_token_ids
        from jaxspec.models.loading import load_model
        from jaxspec.paths import enable_compilation_cache
        from jaxspec.speculative.algorithm import check_benchmark_only
        from jaxspec.speculative.drafters import validate_config

        # One engine, donated caches: calls from several threads run one at a time (docs/api.md).
        self._lock = threading.Lock()
        enable_compilation_cache(cfg.serve.compilation_cache, cfg.model.cache_dir or None)

        # A config from `load_config` is validated already; one built by hand is validated here,
        # the same way, before minutes of loading.
        cfg = validate_config(cfg)
        check_benchmark_only(cfg.spec, benchmark)
        mesh = resolve_mesh(mesh)
        dtype = model_dtype(cfg)
        owned = model is None
        if owned:
            model = load_model(cfg.model.path, dtype=dtype, cache_dir=cfg.model.cache_dir or None, progress=progress,
                               gguf_blocks=cfg.engine.quantize == "gguf")
        self.engine = Engine.over(assemble(cfg, model, mesh=mesh, progress=progress, benchmark=benchmark,
                                           corpus_label=corpus_label))
        if owned:  # the engine holds its own runtime layout; free the loader's copy
            model.params = None
        self.config = cfg
        self.model_config = model.config
        self.tokenizer = model.tokenizer
        self.eos_token_ids = stop_token_ids(model)
        self._profile = profile_phases
        self._scorer = None
        self._grammars = None  # grammar.matcher.GrammarCompiler, built by the first constrained request
        self.default_sampling = SamplingParams(
            temperature=cfg.sampling.temperature, top_p=cfg.sampling.top_p, top_k=cfg.sampling.top_k,
            max_tokens=cfg.sampling.max_new_tokens, ignore_eos=cfg.sampling.ignore_eos)
        self._reset_stats()

    def __repr__(self) -> str:
        return (f"LLM(model={self.config.model.path!r}, spec={self.config.spec.algorithm!r}, "
                f"dtype={self.config.model.dtype!r}, mesh={self.engine.mesh is not None}, "
                f"compiled={len(self.engine.runner._compiled)} executables)")

    def get_tokenizer(self):
        """The Hugging Face tokenizer (None for a checkpoint without one), as vLLM's LLM.get_tokenizer."""
        return self.tokenizer

    @property
    def speculative(self) -> bool:
        """Whether speculative decoding is on."""
        return self.engine.spec_plan is not None

    # ---- prompts to engine requests ---------------------------------------------------------------

    def encode(self, prompts: Any, label: str = "prompts") -> list[list[int]]:
        """Token ids of each prompt, as generate would feed them (chat dicts templated)."""
        return [encode_prompt(p, self.tokenizer, f"{label}[{i}]") for i, p in enumerate(as_prompt_list(prompts))]

    def _requests(self, prompts: Any, sampling, label: str):
        """(prompts as given, their ids, their SamplingParams, engine Requests, and per request
        (prompt index, [(sample index, seed), ...]): the samples it answers).

        A greedy prompt runs once whatever its n: its samples are the same tokens."""
        from jaxspec.engine import Request, RequestError

        items = as_prompt_list(prompts)
        ids = self.encode(items, label)
        params = sampling_list(sampling, len(items), self.default_sampling)
        requests, owners = [], []
        for i, (p, sp) in enumerate(zip(ids, params)):
            where = items[i].get("_where", f"{label}[{i}]") if isinstance(items[i], dict) else f"{label}[{i}]"
            if sp.stop and self.tokenizer is None:
                raise SamplingError("stop", f"{where}: stop strings need a tokenizer, and this model has none")
            samples = list(enumerate(sample_seeds(sp)))
            for group in [samples] if sp.greedy else [[s] for s in samples]:
                req = Request(p, sp, seed=group[0][1], stop_token_ids=sp.stop_ids(self.eos_token_ids))
                try:  # here, so the error names the prompt
                    self.engine.validate(req)
                    if sp.structured_outputs is not None:  # one matcher per sequence
                        req.grammar = self._grammar(sp.structured_outputs)
                except RequestError as e:
                    raise RequestError(f"{where}: {e}") from None
                requests.append(req)
                owners.append((i, group))
        return items, ids, params, requests, owners

    def _grammar(self, spec):
        """A fresh matcher for `spec` over this model's tokenizer (grammar/matcher.py); RequestError
        naming the field when llguidance refuses it with this tokenizer."""
        from jaxspec.engine import RequestError
        from jaxspec.grammar.matcher import GrammarCompiler

        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        try:
            return self._grammars.matcher(spec)
        except ValueError as e:
            raise RequestError(str(e)) from None

    # ---- compiling ----------------------------------------------------------------------------------

    def compile(self, prompts: Any = None, sampling=None, *, buckets: Sequence[tuple[int, int, int]] | None = None
                ) -> list[tuple[int, int, int]]:
        """Compile ahead of time: the buckets these prompts would use, or `buckets` given as
        (batch, prompt length, context) from engine batch_buckets / length_buckets. Returns them."""
        if (prompts is None) == (buckets is None):
            raise ValueError("compile needs prompts (compiles the buckets they would use) or "
                             "buckets=[(batch, prompt_len, context), ...], not both")
        if buckets is None:
            todo = sorted({bk for _, bk in self.engine.plan(self._requests(prompts, sampling, "prompts")[3])})
        else:
            todo = [self._check_bucket(i, b) for i, b in enumerate(buckets)]
        self.engine.compile(todo)
        return todo

    def _check_bucket(self, i: int, bucket: Any) -> tuple[int, int, int]:
        e = self.engine.ecfg
        ok = (isinstance(bucket, (tuple, list)) and len(bucket) == 3 and all(_is_int(x) for x in bucket)
              and bucket[0] in e.batch_buckets and bucket[1] in e.length_buckets and bucket[2] in e.length_buckets
              and bucket[1] <= bucket[2])
        if not ok:
            raise ValueError(f"buckets[{i}] must be (batch, prompt_len, context) with batch in {list(e.batch_buckets)} "
                             f"and prompt_len <= context in {list(e.length_buckets)}; got {bucket!r}")
        return tuple(int(x) for x in bucket)  # type: ignore[return-value]

    # ---- generating ---------------------------------------------------------------------------------

    def generate(self, prompts: Any, sampling: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order.

        prompts: a string (raw text, no chat template), a list of token ids, a
        {"messages": [...]} dict (chat template applied), or a list of these.
        sampling: one SamplingParams for every prompt, or a list with one per
        prompt; default: the config's [sampling] section (greedy, 128 tokens)."""
        return self._generate(prompts, sampling, "prompts")

    def chat(self, messages: Any, sampling: SamplingParams | Sequence[SamplingParams] | None = None
             ) -> list[RequestOutput]:
        """Generate a reply to one conversation (a list of {"role", "content"} messages) or to each of
        a list of conversations, with the model's chat template applied (generation prompt added)."""
        if isinstance(messages, (list, tuple)) and messages and all(isinstance(m, dict) for m in messages):
            conversations = [messages]
        elif isinstance(messages, (list, tuple)) and messages:
            conversations = list(messages)
        else:
            raise PromptError("messages must be a conversation (a non-empty list of {'role', 'content'} dicts) "
                              "or a list of conversations")
        return self._generate([{"messages": c} for c in conversations], sampling, "messages")

    def _generate(self, prompts: Any, sampling, label: str) -> list[RequestOutput]:
        items, ids, params, requests, owners = self._requests(prompts, sampling, label)
        with self._lock:
            return self._run(items, ids, params, requests, owners)

    def _run(self, items, ids, params, requests, owners) -> list[RequestOutput]:
        results = self.engine.generate(requests)
        t = self.engine.last_timing
        for k in ("prefill_s", "decode_s", "new_tokens"):
            self._timing[k] += t[k]
        if self._profile and self.speculative:
            step = self.engine.ecfg.max_batch_size
            for start in range(0, len(requests), step):
                self._add_split(self.engine.profile_phases(requests[start: start + step]))
        samples: list[list[CompletionOutput]] = [[] for _ in items]
        cached: dict[int, int] = {}
        for (i, group), res in zip(owners, results):
            cached.setdefault(i, res.num_cached_tokens)
            out = self._completion(res, params[i].stop, params[i].min_tokens)
            samples[i] += [dataclasses.replace(out, index=j, seed=seed) for j, seed in group]
        scored = [self._prompt_logprobs(pid, sp) for pid, sp in zip(ids, params)]
        return [RequestOutput(p, pid, outs, lp, cached.get(i, 0))
                for i, (p, pid, outs, lp) in enumerate(zip(items, ids, samples, scored))]

    def _prompt_logprobs(self, prompt_ids, sp: SamplingParams):
        """The prompt's per-token {token id: Logprob}, led by None, from one scoring forward
        (engine/scoring.py; `sp` for engine.logprobs_mode = "processed"); None when not asked."""
        if sp.prompt_logprobs is None:
            return None
        if self._scorer is None:
            from jaxspec.engine.scoring import PromptScorer

            self._scorer = PromptScorer(self.engine.runner, self.eos_token_ids)
        sc = self._scorer.score(list(prompt_ids), sp.prompt_logprobs, sp, prompt_len=len(prompt_ids))
        return [None] + self._logprob_dicts(list(prompt_ids)[1:], sc[1:])

    def _logprob_dicts(self, tokens, sc) -> list[dict[int, Logprob]]:
        """vLLM's per-token {token id: Logprob}: the top entries, and the token's own (`sc`: TokenScores)."""
        text = (lambda t: self.tokenizer.decode([t])) if self.tokenizer is not None else (lambda t: None)
        out = []
        for i, tok in enumerate(tokens):
            entry = {int(t): Logprob(float(lp), r + 1, text(int(t)))
                     for r, (t, lp) in enumerate(zip(sc.top_ids[i], sc.top_logprobs[i]))}
            if int(tok) not in entry:
                entry[int(tok)] = Logprob(float(sc.token_logprobs[i]), int(sc.token_ranks[i]), text(int(tok)))
            out.append(entry)
        return out

    def _completion(self, res, stops: tuple[str, ...], min_tokens: int = 0) -> CompletionOutput:
        """The output of one engine Result (index and seed filled in by the caller)."""
        ids, reason = res.output_ids, res.finish_reason
        text = self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""
        hit = cut_at_stop(self.tokenizer, res.prompt_ids, ids, stops, min_tokens) if stops and self.tokenizer else None
        if hit is not None:
            (text, ids), reason = hit, "stop"
        record = {}
        if res.accept_lengths is not None:
            from jaxspec.speculative.metrics import request_metrics

            m = request_metrics(res.accept_lengths, self.engine.spec_plan.num_draft_tokens - 1)
            self._metrics = self._metrics.merge(m)
            record = dict(accept_lengths=res.accept_lengths, tau=m.tau, acceptance_rate=m.acceptance_rate,
                          position_acceptance=m.position_acceptance(self.engine.spec_plan.max_depth))
        if res.logprobs is not None:  # recorded in the loop; a stop string's cut drops the tail
            record["logprobs"] = self._logprob_dicts(ids, res.logprobs[: len(ids)])
        return CompletionOutput(index=0, text=text, token_ids=ids, finish_reason=reason, seed=0, **record)

    # ---- statistics ---------------------------------------------------------------------------------

    def profile_phases(self, prompts: Any, sampling=None) -> dict:
        """Rerun the first batch of these prompts with draft / verify / other jitted apart and timed
        (same tokens); returns {"seconds": {phase: s}, "counts", "total_s"} and adds it to spec_stats()."""
        split = self.engine.profile_phases(self._requests(prompts, sampling, "prompts")[3])
        self._add_split(split)
        return split

    def _add_split(self, split: dict) -> None:
        for k, v in split["seconds"].items():
            self._phase_s[k] = self._phase_s.get(k, 0.0) + v

    @property
    def metrics(self):
        """SpecMetrics (jaxspec.speculative.metrics) over every request generated so far."""
        return self._metrics

    def spec_stats(self) -> dict:
        """Totals over everything generated so far (reset_stats starts again).

        Keys: algorithm; num_requests, num_verify_steps, num_committed,
        num_accepted, num_proposed, tau, acceptance_rate, accept_length_counts,
        position_acceptance (per draft depth, depth 1 first): None/empty
        without speculation; new_tokens, prefill_s, decode_s, decode_tok_s;
        time_split: {"seconds": {"draft", "verify", "other"}, "fraction": ...}
        when phases were profiled (profile_phases), else None."""
        plan = self.engine.spec_plan
        out = {"algorithm": plan.algorithm if plan else "none",
               **self._metrics.to_dict(plan.max_depth if plan else 0), **self._timing}
        out["decode_tok_s"] = out["new_tokens"] / out["decode_s"] if out["decode_s"] > 0 else None
        total = sum(self._phase_s.values())
        out["time_split"] = None if not total else {
            "seconds": dict(self._phase_s), "fraction": {k: v / total for k, v in self._phase_s.items()}}
        return out

    def reset_stats(self) -> None:
        """Forget the statistics spec_stats() sums."""
        self._reset_stats()

    def _reset_stats(self) -> None:
        from jaxspec.speculative.metrics import SpecMetrics

        self._metrics = SpecMetrics()
        self._timing = {"new_tokens": 0, "prefill_s": 0.0, "decode_s": 0.0}
        self._phase_s: dict[str, float] = {}
