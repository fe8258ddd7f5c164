"""`python -m jaxspec.bench spec`: speculative decoding vs plain decoding vs Hugging Face.

One run, embedded model, float32, batch 1, EOS ignored. Prints Markdown tables:

1. per prompt set and method: tau, decode tokens/s (median over prompts), the
   speedup over jaxspec plain decoding (median of per-prompt ratios, and the
   aggregate over the set), the ratio to Hugging Face `generate` and the
   fraction of the batch-1 bandwidth roofline; Hugging Face prompt-lookup
   decoding runs on the same prompts;
2. the cost of one verify forward over T tokens relative to a decode step;
3. a synthetic-acceptance sweep (L = 1..8, output NOT exact) showing the
   system's ceiling, and the same for a DFLASH block of 16 (one forward drafts 15);
4. the draft / verify split of the feature and block drafters (one MT-Bench prompt, phases
   jitted apart) and, at `--batch`, plain against the shipped drafters.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.bench.common import (chat_ids, hf_generate_rates, llama_cpp_decode_rates, measure_read_bandwidth, median,
                                  print_table, timed)


LLAMA_PLAIN = "llama.cpp plain"


def llama_cpp_methods(llama_cpp, gguf, prompts, new: int) -> dict:
    """llama.cpp on the same GGUF (as shipped) and prompts, batch 1, greedy: plain decoding and its own
    speculative mode, prompt lookup (10 tokens, n-gram 2); per-prompt tokens/s, no tau."""
    from jaxspec.native.bandwidth import default_threads

    threads = default_threads()
    return {f"{LLAMA_PLAIN}": Measured(llama_cpp_decode_rates(llama_cpp, gguf, prompts, new, 1, threads), float("nan")),
            "llama.cpp prompt lookup (10)": Measured(
                llama_cpp_decode_rates(llama_cpp, gguf, prompts, new, 1, threads, prompt_lookup=10), float("nan"))}


def engine_for(model, spec_kw: dict | None, draft=None, batch: int = 1, quantize: str = "none"):
    from jaxspec.config import EngineSection, SpecSection
    from jaxspec.engine import Engine

    ecfg = EngineSection(max_batch_size=batch, max_context=1024, length_buckets=(128, 256, 512, 1024),
                         batch_buckets=(batch,), quantize=quantize)
    spec = SpecSection(**spec_kw) if spec_kw else None
    # Fixed shapes unless a row asks for the policy ("adaptive": "on").
    policy = {"adaptive": True} if getattr(spec, "adaptive", "off") == "on" else {}
    return Engine(model.params, model.config, ecfg, progress=False, spec=spec, draft=draft, benchmark=True, **policy)


def run_engine(engine, prompts, max_new: int, warm: bool = True) -> tuple[list[float], list[int]]:
    """(decode tokens/s per prompt, accept lengths) at batch 1; `warm` first runs prompt 0 once."""
    from jaxspec.engine import Request
    from jaxspec.sampling_params import SamplingParams

    if warm:
        engine.generate([Request(prompts[0], SamplingParams(max_tokens=max_new))])
    rates, lens = [], []
    for p in prompts:
        res = engine.generate([Request(p, SamplingParams(max_tokens=max_new))])[0]
        t = engine.last_timing
        rates.append(t["new_tokens"] / t["decode_s"])
        lens += res.accept_lengths or []
    return rates, lens


def run_batched(engine, prompts, max_new: int, batch: int, reps: int = 1) -> list[float]:
    """Decode tokens/s of whole batches of `batch` prompts (all rows' new tokens over the decode
    time), one value per batch and repetition; the first batch runs once first to compile."""
    from jaxspec.engine import Request
    from jaxspec.sampling_params import SamplingParams

    groups = [prompts[i:i + batch] for i in range(0, len(prompts) - batch + 1, batch)]
    engine.generate([Request(p, SamplingParams(max_tokens=max_new)) for p in groups[0]])
    rates = []
    for _ in range(reps):
        for g in groups:
            engine.generate([Request(p, SamplingParams(max_tokens=max_new)) for p in g])
            t = engine.last_timing
            rates.append(t["new_tokens"] / t["decode_s"])
    return rates


class Processed:
    """An engine whose every request also carries the SamplingParams `fields` (the penalties'
    twin of a method: same engine, same compiled programs, side by side)."""

    def __init__(self, engine, **fields):
        self.engine, self.fields = engine, fields

    def generate(self, reqs):
        return self.engine.generate([dataclasses.replace(r, params=r.params.replace(**self.fields)) for r in reqs])

    @property
    def last_timing(self):
        return self.engine.last_timing


# --penalties: a no-op-sized penalty (every processor runs, the argmax moves only on exact ties, so
# the tokens and tau match the method's: the pure cost), and a real one (the text and tau change).
PENALTY_TWINS = {"+ penalties (cost only)": dict(frequency_penalty=1e-6),
                 "+ penalties (rep 1.1, presence 0.3)": dict(repetition_penalty=1.1, presence_penalty=0.3)}


# --logprobs: every token's log-probability and top 5, read from the verify logits (issue 26): same tokens.
LOGPROB_TWINS = {"+ logprobs (top 5)": dict(logprobs=5)}


def logprob_cost(vocab: int, sizes=((1, 4), (8, 4)), reps: int = 30) -> list[list]:
    """[B, D+1, ms without, ms with] of a verify step's logprob entries alone (`path_entries` over
    [B, D+1, V] logits): what `--logprobs` adds per step, free of the end-to-end runs' noise."""
    from jaxspec.engine.device_sampling import DeviceSampling
    from jaxspec.engine.types import RowInput
    from jaxspec.sampling_params import SamplingParams
    from jaxspec.speculative.logprobs import path_entries

    rng = np.random.default_rng(0)
    rows = []
    for b, n in sizes:
        logits = jnp.asarray(rng.normal(size=(b, n, vocab)), jnp.float32)
        index = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
        emitted = jnp.asarray(rng.integers(0, vocab, (b, n)), jnp.int32)
        fn = jax.jit(lambda x, sp: path_entries(x, x, index, emitted, sp, "raw"))  # noqa: B023
        ms = []
        for fields in ({}, LOGPROB_TWINS["+ logprobs (top 5)"]):
            row = RowInput(tokens=[0], prompt_len=1, page_row=np.zeros(1, np.int32), slot=0,
                           params=SamplingParams(**fields), stop_ids=(0,))
            sp = DeviceSampling.pack([row] * b, b)
            jax.block_until_ready(fn(logits, sp))  # compile
            ms.append(1e3 * median(timed(lambda: jax.block_until_ready(fn(logits, sp)), reps)))  # noqa: B023
        rows.append([b, n, *ms])
    return rows


def penalty_cost(vocab: int, sizes=((1, 4), (8, 4)), ctx: int = 1024, reps: int = 30) -> list[list]:
    """[B, N, ms without, ms with] of the verify step's processors alone (`penalize_tree` over [B, N, V]
    logits after a `ctx`-token history): their cost, free of the end-to-end runs' noise."""
    from jaxspec.engine.device_sampling import DeviceSampling
    from jaxspec.engine.types import RowInput
    from jaxspec.sampling_params import SamplingParams
    from jaxspec.speculative.penalties import penalize_tree

    rng = np.random.default_rng(0)
    rows = []
    for b, n in sizes:
        hist = jnp.asarray(rng.integers(0, vocab, (b, ctx)), jnp.int32)
        tok = jnp.asarray(rng.integers(0, vocab, (b, n)), jnp.int32)
        tree = SimpleNamespace(mask=jnp.broadcast_to(jnp.tril(jnp.ones((n, n), bool)), (b, n, n)),
                               depth=jnp.broadcast_to(jnp.arange(n), (b, n)))
        logits = jnp.asarray(rng.normal(size=(b, n, vocab)), jnp.float32)
        fn = jax.jit(lambda x, sp: penalize_tree(x, sp, hist, jnp.full((b,), ctx // 2), jnp.full((b,), ctx // 4),
                                                 tok, tree))  # noqa: B023
        ms = []
        for fields in ({}, PENALTY_TWINS["+ penalties (cost only)"]):
            row = RowInput(tokens=[0], prompt_len=1, page_row=np.zeros(1, np.int32), slot=0,
                           params=SamplingParams(**fields), stop_ids=(0,))
            sp = DeviceSampling.pack([row] * b, b)
            fn(logits, sp).block_until_ready()  # compile
            ms.append(1e3 * median(timed(lambda: fn(logits, sp).block_until_ready(), reps)))  # noqa: B023
        rows.append([b, n, *ms])
    return rows


def acceptance_by_position(lens: list[int], k: int) -> list[float]:
    """P(draft position i is accepted), i = 1..k, over verify steps: a step committing L tokens
    accepted its first L - 1 drafts (the last token is the bonus)."""
    from jaxspec.speculative.metrics import accept_length_counts, position_acceptance

    return list(position_acceptance(accept_length_counts(lens), k))


@dataclasses.dataclass
class Measured:
    rates: list[float]  # [prompt] decode tok/s, median over the repetitions
    tau: float  # committed tokens per verify step, pooled over every step (1 for plain decoding)
    lens: list[int] = dataclasses.field(default_factory=list)  # every verify step's accept length


def run_interleaved(engines: dict, prompts, max_new: int, reps: int) -> dict[str, Measured]:
    """Methods take turns within each repetition, so the slow drift of a noisy
    machine hits all of them alike instead of whichever ran last."""
    rates = {name: [] for name in engines}
    lens = {name: [] for name in engines}
    for rep in range(reps):
        for name, eng in engines.items():
            r, acc = run_engine(eng, prompts, max_new, warm=rep == 0)
            rates[name].append(r)
            lens[name] += acc
    return {name: Measured([median(col) for col in zip(*rates[name])],
                           float(np.mean(lens[name])) if lens[name] else 1.0, lens[name]) for name in engines}


def speedups(rates: list[float], base: list[float]) -> tuple[float, float]:
    """(median over prompts of the per-prompt ratio, aggregate ratio) of `rates` to `base`.

    Every prompt yields the same number of tokens (EOS ignored), so the
    aggregate ratio is base's total time over this method's: what a batch-1
    queue of these prompts gains. The per-prompt median is the typical prompt.
    They differ when a few prompts copy well and most do not."""
    paired = median([r / b for r, b in zip(rates, base)])
    return paired, sum(1 / b for b in base) / sum(1 / r for r in rates)


def run_hf(hf, prompts, max_new: int, lookup: int = 0) -> list[float]:
    """Hugging Face tokens/s per prompt at batch 1 (plain `generate`, or prompt lookup)."""
    return hf_generate_rates(hf, prompts, max_new, batch=1, lookup=lookup)


def verify_cost(model, sizes=(1, 2, 4, 8, 16), reps: int = 15, cpu_kernels: str = "auto") -> dict[int, float]:
    """Median ms of one target forward over T query tokens at a 256-token prefix."""
    from jaxspec.cache.paged import KVCache
    from jaxspec.models.llama import forward, prepare_params
    from jaxspec.native.build import use_native_kernels

    c = model.config
    params = prepare_params(model.params, c, native=use_native_kernels(cpu_kernels, model.params["embed"].dtype, None))
    cache = KVCache.zeros(c.num_layers, 1 + 32, 16, c.num_kv_heads, c.head_dim)
    pt = jnp.arange(1, 33, dtype=jnp.int32)[None]
    calls = {}
    for t in sizes:
        f = jax.jit(lambda p, ca, tok, pos, t=t: forward(p, c, tok, pos, ca, pt, q_start=jnp.array([256]),
                                                         kv_len=jnp.array([256 + t])).logits)
        tok = jnp.ones((1, t), jnp.int32)
        pos = 256 + jnp.arange(t)[None]
        f(params, cache, tok, pos).block_until_ready()
        calls[t] = lambda f=f, tok=tok, pos=pos: f(params, cache, tok, pos).block_until_ready()
    # Round-robin over T, so machine drift during the run hits every width alike.
    times = {t: [] for t in sizes}
    for _ in range(reps):
        for t in sizes:
            times[t] += timed(calls[t], 1)
    out = {t: 1000 * median(ts) for t, ts in times.items()}
    return out


SHAPES = {"eagle3": [("chain k=5", dict(topk=1, num_steps=5, num_draft_tokens=6)),
                     ("chain k=3", dict(topk=1, num_steps=3, num_draft_tokens=4)),
                     # The engine's policy: plain decoding or the chain of 3, per batch bucket.
                     ("chain k=3, adaptive", dict(topk=1, num_steps=3, num_draft_tokens=4, adaptive="on")),
                     ("tree 8", dict(topk=2, num_steps=4, num_draft_tokens=8)),
                     ("tree 16", dict(topk=4, num_steps=4, num_draft_tokens=16))],
          "frozen_kv_mtp": [("chain k=3", dict(topk=1, num_steps=3, num_draft_tokens=4)),
                            ("tree 8", dict(topk=2, num_steps=4, num_draft_tokens=8))],
          "medusa": [("chain k=4", dict(topk=1, num_steps=4, num_draft_tokens=5)),
                     ("tree 16", dict(topk=4, num_steps=4, num_draft_tokens=16))],
          # Block drafters: the chain is the block; DSPARK's planner cuts it by the SPS table.
          "dflash": [("block 8", dict(num_draft_tokens=8)), ("block 4", dict(num_draft_tokens=4))],
          "dspark": [("gamma 7", dict(num_draft_tokens=8)), ("gamma 3", dict(num_draft_tokens=4))]}


def parse_heads(texts: list) -> tuple:
    """--head ALG=DIR ... -> ((ALG, DIR), ...), refused before any model loads."""
    out = tuple(t.partition("=")[::2] for t in texts)
    for (alg, d), t in zip(out, texts):
        if alg not in SHAPES or not Path(d, "config.json").is_file():
            raise SystemExit(f"--head {t}: expected ALG=DIR with ALG one of {', '.join(SHAPES)} and DIR a head "
                             "directory holding config.json")
    return out


def shipped_head_methods(model, heads: tuple = ()) -> dict:
    """Rows for the heads shipped in checkpoints/ (`--draft-model default`), when present, and for
    each `--head ALG=DIR` under the same shapes (a campaign candidate beside the shipped head)."""
    from jaxspec.config import SpecSection
    from jaxspec.speculative.drafters import registrations, shipped_head
    from jaxspec.speculative.drafters.load import load_draft

    def present(alg):
        try:
            return shipped_head(alg) is not None
        except FileNotFoundError:
            return False

    rows = [(r.name, "default", "shipped head") for r in registrations() if r.shipped_head and present(r.name)]
    out = {}
    for alg, d, tag in rows + [(alg, d, Path(d).name) for alg, d in heads]:
        for label, shape in SHAPES.get(alg, []):
            kw = dict(algorithm=alg, draft_model=d, **shape)
            out[f"jaxspec {alg} {label} ({tag})"] = (kw, load_draft(SpecSection(**kw), model, jnp.float32,
                                                                   progress=False))
    return out


def parse_sampled(text: str) -> dict:
    """--sampled T[,TOP_P] -> the SamplingParams fields of the sampled rows."""
    try:
        t, top_p = ([float(x) for x in text.split(",")] + [1.0])[:2] if text.count(",") <= 1 else (0.0, 0.0)
    except ValueError:
        t = top_p = 0.0
    if t <= 0 or not 0 < top_p <= 1:
        raise SystemExit(f"--sampled: expected T or T,TOP_P with T > 0 and 0 < TOP_P <= 1; got {text!r}")
    return dict(temperature=t, top_p=top_p)


def release(engines: dict, keep: set = frozenset()) -> None:
    """Drop every engine in `engines` not named in `keep`, with the programs only they held.

    Each engine holds its compiled XLA programs, and their code pages count against the kernel's
    vm.max_map_count (65,530 here): a full run kept nine engines alive and the sampled section died
    with MapLimitError. Sections after the main table therefore start from a released process.
    `jax.clear_caches` drops the jit caches too (helpers traced for a released engine); an engine
    kept retraces what it needs of them (every timed section warms up first)."""
    for name in [n for n in engines if n not in keep]:
        del engines[name]
    gc.collect()
    jax.clear_caches()


def sampled_methods(model, methods: dict, fields: dict) -> dict:
    """--sampled: plain and each shipped EAGLE-3 / FROZEN_KV_MTP / Medusa chain and tree on sampled rows under rejection
    verify, every tree twice (issue 30): the sampled multi-draft tree and the one-hot top-k tree."""
    tag = ", ".join(f"{k} {v:g}" for k, v in fields.items())
    out = {f"jaxspec plain ({tag})": Processed(engine_for(model, None), **fields)}
    for name, (kw, draft) in methods.items():
        if not kw or kw["algorithm"] not in ("eagle3", "frozen_kv_mtp", "medusa") or kw.get("adaptive"):
            continue
        tree = kw.get("topk", 1) > 1
        for label, ts in ((("sampled tree", "sampled"), ("one-hot tree", "topk")) if tree else (("", "sampled"),)):
            spec = dict(kw, verify="rejection", tree_sampling=ts)
            out[f"{name.replace(' (shipped head)', '')}{', ' + label if label else ''} ({tag}, rejection)"] = \
                Processed(engine_for(model, spec, draft), **fields)
    return out


def block_ceiling(model, prompts, new: int, base: float, roofline: float) -> list[list]:
    """A DFLASH block of 16 with acceptance forced (tau 2..8; output NOT exact): what one draft
    forward per block buys when the drafter is right. The head is fresh (its cost does not depend on
    its weights), one layer, the target's geometry."""
    import tempfile

    from jaxspec.config import SpecSection
    from jaxspec.speculative.drafters.load import load_draft
    from jaxspec.models.heads.family import head_config, init_head_params
    from jaxspec.train.export import export_head

    L = model.config.num_layers
    hcfg = head_config("dflash", model.config, num_layers=1, block_size=16, mask_token_id=3,
                       feature_layers=(2, L // 2, L - 3))
    rows = []
    with tempfile.TemporaryDirectory() as d:
        export_head(init_head_params(hcfg, 0), hcfg, d, num_target_layers=L)
        for forced in (2, 4, 8):
            kw = dict(algorithm="dflash", draft_model=d, num_draft_tokens=16, simulate_accept_length=forced)
            draft = load_draft(SpecSection(**kw), model, jnp.float32, progress=False)
            rates, lens = run_engine(engine_for(model, kw, draft), prompts, new)
            tps = median(rates)
            rows.append([forced, float(np.mean(lens)), tps, tps / base, tps / roofline])
    return rows


def phase_split(engine, prompt, new: int) -> list[float]:
    """[draft, verify, other] fractions of one request, the phases jitted apart."""
    from jaxspec.bench.common import time_split
    from jaxspec.engine import Request
    from jaxspec.sampling_params import SamplingParams

    s = time_split(engine, [Request(prompt, SamplingParams(max_tokens=new))]) or {}
    return [s.get("draft", float("nan")), s.get("verify", float("nan")), s.get("other", float("nan"))]


EAGLE3_REF = "jaxspec eagle3 chain k=3 (shipped head)"
SETS = ("copy-humaneval", "copy-repeat", "mtbench", "humaneval", "sharegpt-heldout")


def prompt_sets(tokenizer, names, n: int) -> dict[str, list[list[int]]]:
    from jaxspec.bench import prompts as ps
    from jaxspec.train.sharegpt import sharegpt_heldout_prompts

    makers = {"copy-humaneval": ("copy: HumanEval rewrite", ps.humaneval_rewrite_prompts),
              "copy-repeat": ("copy: repeat text", lambda n: ps.repeat_prompts(min(n, ps.NUM_PASSAGES))),
              "mtbench": ("MT-Bench", ps.mtbench_questions), "humaneval": ("HumanEval", ps.humaneval_prompts),
              "sharegpt-heldout": ("ShareGPT held-out", sharegpt_heldout_prompts)}
    bad = [x for x in names if x not in makers]
    if bad:
        raise SystemExit(f"--sets: unknown {', '.join(bad)}; sets: {', '.join(SETS)}")
    return {makers[x][0]: chat_ids(tokenizer, makers[x][1](n)) for x in names}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxspec.bench spec")
    p.add_argument("--model", default="default")
    p.add_argument("--num-prompts", type=int, default=10,
                   help="prompts per set (the repeat-text set has 3 passages)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--draft-layers", type=int, default=20)
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--no-sweep", action="store_true")
    p.add_argument("--no-verify-cost", action="store_true")
    p.add_argument("--reps", type=int, default=2, help="interleaved repetitions of every jaxspec method")
    p.add_argument("--sets", default=",".join(SETS), help=f"comma list of prompt sets: {', '.join(SETS)}")
    p.add_argument("--methods", default="", help="comma list of substrings: keep only the methods whose name "
                   "contains one (plain always runs)")
    p.add_argument("--batch", type=int, default=8, help="also time plain and the shipped heads at this batch "
                   "size on MT-Bench (0: skip)")
    p.add_argument("--penalties", action="store_true", help="time every method also with penalties on (twins "
                   "sharing its engine: a cost-only penalty and a real one, issue 26)")
    p.add_argument("--logprobs", action="store_true", help="time every method also with logprobs (top 5) on (a "
                   "twin sharing its engine, issue 26)")
    p.add_argument("--sampled", default="", metavar="T[,TOP_P]", help="also time plain and the shipped EAGLE-3 / "
                   "Medusa chains and trees on sampled rows (rejection verify) on MT-Bench: sampled multi-draft "
                   "trees against one-hot top-k trees (issue 30)")
    p.add_argument("--quantize", choices=["none", "int8", "gguf"], default="none",
                   help="target weights of the main and batch tables (engine.quantize; gguf: the GGUF's own blocks)")
    p.add_argument("--head", action="append", default=[], metavar="ALG=DIR",
                   help="also time this head directory under ALG's shapes, beside the shipped head (repeatable)")
    p.add_argument("--no-llama-cpp", action="store_true",
                   help="skip llama.cpp on the same GGUF and prompts (plain, and its prompt lookup)")
    args = p.parse_args(argv)
    sampled = parse_sampled(args.sampled) if args.sampled else None  # refused before any model loads
    heads = parse_heads(args.head)

    from jaxspec.bench.decode import param_bytes
    from jaxspec.models.loading import load_model
    from jaxspec.speculative.drafters.standalone import truncate_layers

    model = load_model(args.model, dtype=jnp.float32, gguf_blocks=args.quantize == "gguf")
    n, new = args.num_prompts, args.max_new_tokens
    sets = prompt_sets(model.tokenizer, [x for x in args.sets.split(",") if x], n)
    # n-gram defaults: min match 1, a 1-gram match drafts at most 3 tokens. The
    # "min match 2" row is the previous default, kept as the ablation.
    ngram = dict(algorithm="ngram", topk=1, num_steps=7, num_draft_tokens=8, ngram_max_match=4)
    ngram_min2 = dict(ngram, ngram_min_match=2, ngram_draft_tokens_by_match=())
    ngram_tree = dict(algorithm="ngram", topk=4, num_steps=3, num_draft_tokens=16, ngram_max_match=4)
    trunc = dict(algorithm="standalone", topk=1, num_steps=3, num_draft_tokens=4, draft_layers=args.draft_layers)
    chain_name = "jaxspec n-gram chain k=7"
    methods = {
        "jaxspec plain": (None, None),
        chain_name: (ngram, None),
        "jaxspec n-gram chain k=7, min match 2, no cap": (ngram_min2, None),
        "jaxspec n-gram tree 16": (ngram_tree, None),
        f"jaxspec truncated-{args.draft_layers} chain k=3": (trunc, "truncated"),
    }
    methods.update(shipped_head_methods(model, heads))
    keep = [x for x in args.methods.split(",") if x]
    if keep:
        methods = {k: v for k, v in methods.items() if k == "jaxspec plain" or any(x in k for x in keep)}
    if any(d == "truncated" for _, d in methods.values()):
        draft = truncate_layers(model.params, model.config, args.draft_layers)
        methods = {k: (kw, draft if d == "truncated" else d) for k, (kw, d) in methods.items()}
    engines = {name: engine_for(model, kw, d, quantize=args.quantize) for name, (kw, d) in methods.items()}
    twins = {**(PENALTY_TWINS if args.penalties else {}), **(LOGPROB_TWINS if args.logprobs else {})}
    engines.update({f"{name} {twin}": Processed(eng, **fields) for name, eng in list(engines.items())
                    for twin, fields in twins.items()})
    hf = None
    if not args.no_hf:
        import torch
        import transformers as tf

        hf = tf.AutoModelForCausalLM.from_pretrained(model.path, dtype=torch.float32).eval()
    bandwidth = measure_read_bandwidth()
    roofline = bandwidth / param_bytes(model.params)  # batch-1 plain decode ceiling, tok/s (float32)
    main_roofline = roofline  # of the main table's weights: the quantized bytes a step reads
    if args.quantize != "none":
        from jaxspec.bench.decode import streamed_bytes

        main_roofline = bandwidth / streamed_bytes(engines["jaxspec plain"].runner.params)
    llama_cpp, gguf = None, None
    if not args.no_llama_cpp:
        from jaxspec.bench.common import import_llama_cpp
        from jaxspec.bench.decode import gguf_source

        gguf = gguf_source(args.model)
        llama_cpp, missing = import_llama_cpp() if gguf is not None else (None, "--model is not a GGUF")
        if llama_cpp is None:
            print(f"llama.cpp peer skipped: {missing}")

    rows, accept_rows, copy_rates = [], [], {"plain": [], "ngram": []}
    for set_name, prompts in sets.items():
        # No engine is held past this call but through `engines`, so `release` below frees them all.
        measured = run_interleaved({name: eng for name, eng in engines.items()
                                    if set_name == "MT-Bench" or not name.startswith("jaxspec truncated")},
                                   prompts, new, args.reps)
        for name, m in measured.items():
            if m.lens:
                accept_rows.append([set_name, name, m.tau, *acceptance_by_position(m.lens, 7)])
        if hf:
            measured["HF generate"] = Measured(run_hf(hf, prompts, new), 1.0)
            measured["HF prompt lookup (10)"] = Measured(run_hf(hf, prompts, new, lookup=10), float("nan"))
        if llama_cpp is not None:
            measured.update(llama_cpp_methods(llama_cpp, gguf, prompts, new))
        base = measured["jaxspec plain"].rates
        hf_rates = measured["HF generate"].rates if hf else [float("nan")] * len(prompts)
        lc_rates = measured[LLAMA_PLAIN].rates if LLAMA_PLAIN in measured else [float("nan")] * len(prompts)
        nan = [float("nan")] * len(prompts)
        ng = measured[chain_name].rates if chain_name in measured else nan
        e3 = measured[EAGLE3_REF].rates if EAGLE3_REF in measured else nan
        for name, m in measured.items():
            paired, aggregate = speedups(m.rates, base)
            rows.append([set_name, name, m.tau, median(m.rates), paired, aggregate, speedups(m.rates, ng)[0],
                         speedups(m.rates, e3)[0], speedups(m.rates, hf_rates)[0],
                         speedups(m.rates, lc_rates)[0], median(m.rates) / main_roofline])
        if set_name.startswith("copy") and chain_name in measured:
            copy_rates["plain"] += base
            copy_rates["ngram"] += measured[chain_name].rates

    weights = {"none": "float32", "int8": "weight-only int8", "gguf": "the GGUF's own blocks"}[args.quantize]
    print(f"\njaxspec spec benchmark: {model.path.name}, {weights}, batch 1, {new} new tokens, EOS ignored, "
          f"up to {n} prompts per set; batch-1 roofline {main_roofline:.1f} tok/s")
    print("tok/s: median over prompts. vs plain: median over prompts of the per-prompt ratio, and the "
          "aggregate (total time of plain / total time of the method). of roofline: tok/s over the "
          "bandwidth roofline of plain decoding (> 1 = past what plain decoding can ever reach).")
    print_table(["prompts", "method", "tau", "tok/s", "vs jaxspec plain (median)", "vs jaxspec plain (aggregate)",
                 "vs n-gram k=7", "vs EAGLE-3 k=3", "vs HF generate", f"vs {LLAMA_PLAIN}", "of roofline"], rows)
    if copy_rates["plain"]:
        paired, aggregate = speedups(copy_rates["ngram"], copy_rates["plain"])
        print(f"\n{chain_name} over both copy-heavy sets ({len(copy_rates['plain'])} prompts): "
              f"{paired:.2f}x jaxspec plain (median), {aggregate:.2f}x (aggregate)")
    if accept_rows:
        print("\nacceptance per draft position (P(position i accepted) over verify steps; a tree counts depth):")
        print_table(["prompts", "method", "tau", *[f"pos {i}" for i in range(1, 8)]], accept_rows)

    heads = [k for k in methods if "shipped head" in k]
    if heads and "MT-Bench" in sets:
        prompt = sets["MT-Bench"][0]
        print("\ndraft / verify split (one MT-Bench prompt, the phases jitted apart; fractions of the step):")
        print_table(["method", "draft", "verify", "other"], [[k, *phase_split(engines[k], prompt, new)] for k in heads])
    sweep = not args.no_sweep and "MT-Bench" in sets
    release(engines, keep={"jaxspec plain"} if sweep else set())

    if args.batch > 1 and heads and "MT-Bench" in sets:
        prompts = sets["MT-Bench"]
        if len(prompts) < args.batch:
            prompts = (prompts * args.batch)[: args.batch]
        batched = {name: run_batched(engine_for(model, *methods[name], batch=args.batch, quantize=args.quantize),
                                     prompts, new, args.batch,
                                     args.reps) for name in ["jaxspec plain", *heads]}
        base = median(batched["jaxspec plain"])
        print(f"\nbatch {args.batch}, MT-Bench ({len(prompts)} prompts, {new} new tokens each): decode tok/s of "
              "whole batches, median")
        print_table(["method", "tok/s", "vs jaxspec plain"], [[k, median(v), median(v) / base]
                                                              for k, v in batched.items()])
        release({})

    if sampled and heads and "MT-Bench" in sets:
        measured = run_interleaved(sampled_methods(model, {k: methods[k] for k in heads}, sampled), sets["MT-Bench"],
                                   new, args.reps)
        base = next(iter(measured.values())).rates  # plain at the same sampling parameters
        print(f"\nsampled rows ({args.sampled}), MT-Bench, batch 1, seeded; vs plain at the same parameters:")
        print_table(["method", "tau", "tok/s", "vs plain (median)", "vs plain (aggregate)"],
                    [[k, m.tau, median(m.rates), *speedups(m.rates, base)] for k, m in measured.items()])
        release({})

    if args.penalties:
        print("\nthe verify step's processors alone (penalize_tree, 1,024-token history, median ms):")
        print_table(["B", "N", "ms, no row asks", "ms, every row penalized"], penalty_cost(model.config.vocab_size))
    if args.logprobs:
        print("\na verify step's logprob entries alone (path_entries, top 20 kept, median ms):")
        print_table(["B", "D+1", "ms, no row asks", "ms, every row asks"], logprob_cost(model.config.vocab_size))

    if not args.no_verify_cost:
        # The engine's native CPU kernels beside XLA's own ops, to show what the kernels buy.
        cost = verify_cost(model)
        xla = verify_cost(model, cpu_kernels="xla")
        print("\nverify forward cost (one target forward over T tokens, 256-token prefix, median ms):")
        print_table(["T", "ms", "vs T=1", "ms (XLA ops)", "vs T=1 (XLA ops)"],
                    [[t, ms, ms / cost[1], xla[t], xla[t] / xla[1]] for t, ms in cost.items()])

    if sweep:
        prompts = sets["MT-Bench"][:1]
        base = median(run_engine(engines["jaxspec plain"], prompts, new)[0])
        sweep_rows = []
        for L in range(1, 9):
            kw = dict(algorithm="ngram", topk=1, num_steps=8, num_draft_tokens=9, simulate_accept_length=L)
            rates, lens = run_engine(engine_for(model, kw), prompts, new)
            tps, tau = median(rates), float(np.mean(lens))
            sweep_rows.append([L, tau, tps, tps / base, tps / roofline])
        print("\nsynthetic acceptance sweep (n-gram chain of 8, acceptance forced to L; output NOT exact):")
        print_table(["L", "tau", "tok/s", "vs jaxspec plain", "of roofline"], sweep_rows)
        print("\nDFLASH block of 16, acceptance forced (one draft forward per block; output NOT exact):")
        print_table(["forced", "tau", "tok/s", "vs jaxspec plain", "of roofline"],
                    block_ceiling(model, prompts, new, base, roofline))
    return 0
