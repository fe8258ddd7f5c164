"""`python -m jaxspec.bench heads`: what feature drafters cost, and the ceiling they can reach.

Embedded model, float32, batch 1, fresh (random-weight) heads: a head's cost
does not depend on its weights, so acceptance here is forced (the shipped heads'
measured acceptance is in `bench spec`). Prints Markdown tables:

1. draft-step cost: one chain draft step of each head (its layer and its LM
   head over the draft vocabulary), as a fraction of one target decode step
   (a T = 1 target forward at the same 256-token context), and the draft KV it
   keeps per token (FROZEN_KV_MTP reads the target's own: none). EAGLE-3's
   target is <= 8% on the embedded model;
2. the per-phase split of a forced-acceptance decode (draft = propose +
   the post-verify draft-extend, verify, other), from `Engine.profile_phases`;
3. the ceiling: tokens/s with acceptance forced to L (`simulate_accept_length`,
   output NOT exact) against plain decoding, measured in the same run. An
   EAGLE-3 chain of 5 at forced tau = 4 is the issue's >= 3x target.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.bench.common import chat_ids, median, print_table, timed


def _head(model, kind: str, **kw):
    from jaxspec.models.heads.family import head_config, init_head_params

    hcfg = head_config(kind, model.config, **kw)
    return init_head_params(hcfg), hcfg


def _engine(model, spec_kw, draft=None, max_batch: int = 1):
    from jaxspec.config import EngineSection, SpecSection
    from jaxspec.engine import Engine

    ecfg = EngineSection(max_batch_size=max_batch, max_context=1024, length_buckets=(128, 256, 512, 1024))
    spec = SpecSection(**spec_kw) if spec_kw else None
    return Engine(model.params, model.config, ecfg, progress=False, spec=spec, draft=draft, benchmark=True)


def propose_ms(engine, prefix: int = 256, reps: int = 20) -> float:
    """Median ms of one `propose` (the whole draft of a step) at a `prefix`-token context."""
    from jaxspec.engine.device_sampling import DeviceSampling
    from jaxspec.engine.core import spec_state

    from jaxspec.speculative.loop import target_kv

    drafter, b = engine.drafter, 1
    maxp = -(-1024 // engine.ecfg.page_size)
    table = jnp.arange(1, maxp + 1, dtype=jnp.int32)[None]
    state = drafter.init_state(engine.runner.draft_cache, b)
    # A drafter over the target's K/V (FROZEN_KV_MTP) reads the engine's own cache, as in the loop.
    s = spec_state(cache=target_kv(drafter, engine.runner.cache), draft=None, page_table=table, history=jnp.ones((b, 1024), jnp.int32),
                   hist_len=jnp.full((b,), prefix + 1, jnp.int32), prompt_lens=jnp.ones((b,), jnp.int32),
                   done=jnp.zeros((b,), bool), accept_width=1,
                   sampling=DeviceSampling.pack([None] * b, b))  # greedy: the chat default
    fn = jax.jit(lambda dp, st, s: drafter.propose(dp, st, s).tokens)
    call = lambda: fn(engine.runner.draft_params, state, s).block_until_ready()  # noqa: E731
    call()
    return 1000 * median(timed(call, reps))


def target_step_ms(model, reps: int = 20) -> float:
    from jaxspec.bench.spec import verify_cost

    return verify_cost(model, sizes=(1,), reps=reps)[1]


def decode_rates(engines: list, prompt, max_new: int, reps: int) -> list[tuple[float, float]]:
    """(median decode tok/s, tau) per engine on one prompt. The engines take turns within each
    repetition, so a noisy machine's drift hits them alike; the first run of each warms up."""
    from jaxspec.engine import Request
    from jaxspec.sampling_params import SamplingParams

    req = [Request(prompt, SamplingParams(max_tokens=max_new))]
    for e in engines:
        e.generate(req)
    rates, lens = [[] for _ in engines], [[] for _ in engines]
    for _ in range(reps):
        for i, e in enumerate(engines):
            res = e.generate(req)[0]
            rates[i].append(e.last_timing["new_tokens"] / e.last_timing["decode_s"])
            lens[i] += res.accept_lengths or []
    return [(median(r), float(np.mean(x)) if x else 1.0) for r, x in zip(rates, lens)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxspec.bench heads")
    p.add_argument("--model", default="default")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--draft-vocab", default="8192,16384,32000", help="EAGLE-3 draft vocabulary sizes to time")
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)

    from jaxspec.bench.prompts import mtbench_questions
    from jaxspec.models.loading import load_model

    model = load_model(args.model, dtype=jnp.float32)
    prompt = chat_ids(model.tokenizer, mtbench_questions(1))[0]
    vocab = model.config.vocab_size
    L_t = model.config.num_layers
    # name: (algorithm, head kind, head options)
    heads = {f"eagle3 (draft vocab {int(v)})": ("eagle3", "eagle3", dict(draft_vocab_size=int(v)))
             for v in args.draft_vocab.split(",") if v}
    heads[f"eagle3 (full vocab {vocab})"] = ("eagle3", "eagle3", dict(draft_vocab_size=vocab))
    heads["eagle (EAGLE-1, target LM head)"] = ("eagle", "eagle", {})
    heads["medusa (5 heads)"] = ("medusa", "medusa", dict(num_heads=5))
    heads["mlp_speculator (5 stages)"] = ("mlp_speculator", "mlp_speculator", dict(num_heads=5))
    fkv = f"frozen_kv_mtp (2 layers on target K/V {L_t - 2}, {L_t - 1}; draft vocab 8192)"
    heads[fkv] = ("frozen_kv_mtp", "frozen_kv", dict(draft_vocab_size=8192))

    # 1. Cost of one chain draft step: propose with 5 drafts minus propose with 1, over 4; and the
    # draft KV each drafter keeps per cached token (FROZEN_KV_MTP reads the target's: none).
    t_step = target_step_ms(model)
    cost_rows, drafts = [], {}
    for name, (alg, kind, kw) in heads.items():
        draft = _head(model, kind, **kw)
        drafts[name] = (alg, draft)
        ms = {}
        for k in (1, 5):
            spec = dict(algorithm=alg, topk=1, num_steps=k, num_draft_tokens=k + 1)
            eng = _engine(model, spec, draft)
            ms[k] = propose_ms(eng)
        c = eng.drafter.draft_cache_cfg
        kv_bytes = 0 if c is None else 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4
        step = (ms[5] - ms[1]) / 4
        cost_rows.append([name, ms[1], step, step / t_step, ms[5] / t_step, kv_bytes])
    print(f"\njaxspec feature-drafter cost: {model.path.name}, float32, batch 1, 256-token context; "
          f"target decode step (T=1 forward) {t_step:.2f} ms; target KV "
          f"{2 * L_t * model.config.num_kv_heads * model.config.head_dim * 4} bytes/token")
    print_table(["head", "propose, 1 draft (ms)", "one more draft step (ms)", "draft step / target step",
                 "5-draft propose / target step", "draft KV bytes/token"], cost_rows)

    # 2-3. Forced acceptance: phase split and the ceiling against plain decoding.
    plain = _engine(model, None)
    rows, phase_rows, bases = [], [], []
    for name in [n for n in heads if n.startswith("eagle3 (draft vocab")][:1] + [
            "eagle (EAGLE-1, target LM head)", "medusa (5 heads)", "mlp_speculator (5 stages)", fkv]:
        kind, draft = drafts[name]
        n = 5  # a chain of 5 drafts
        # The full sweep for EAGLE-3 (the target row), L = 4 for the rest.
        for L in ((1, 2, 3, 4, 5) if kind == "eagle3" else (4,)):
            spec = dict(algorithm=kind, topk=1, num_steps=n, num_draft_tokens=n + 1, simulate_accept_length=L)
            eng = _engine(model, spec, draft)
            (base, _), (rate, tau) = decode_rates([plain, eng], prompt, args.max_new_tokens, args.reps)
            bases.append(base)
            rows.append([name, n, L, tau, rate, base, rate / base])
            if L == 4:
                from jaxspec.engine import Request
                from jaxspec.sampling_params import SamplingParams

                ph = eng.profile_phases([Request(prompt, SamplingParams(max_tokens=args.max_new_tokens))])
                sec = ph["seconds"]
                tot = ph["total_s"] or float("nan")
                phase_rows.append([name, n, 1000 * sec.get("draft", 0) / max(ph["counts"].get("verify", 1), 1),
                                   1000 * sec.get("verify", 0) / max(ph["counts"].get("verify", 1), 1),
                                   sec.get("draft", 0) / tot, sec.get("verify", 0) / tot, sec.get("other", 0) / tot])
    print(f"\nplain decoding: {median(bases):.1f} tok/s (median over the rows' own plain runs)")
    print("\nforced acceptance (chain of n drafts, acceptance forced to L; output NOT exact; plain decoding "
          "runs in turn with each row):")
    print_table(["head", "n", "L", "tau", "tok/s", "plain tok/s", "vs jaxspec plain"], rows)
    print("\nphase split at L = 4 (draft = propose + draft-extend; per verify step):")
    print_table(["head", "n", "draft ms/step", "verify ms/step", "draft share", "verify share", "other share"],
                phase_rows)
    return 0
