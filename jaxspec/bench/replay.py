"""`python -m jaxspec.bench replay`: n-gram drafter ablations over whole prompt sets, offline.

Greedy speculative output equals plain greedy output, so for a deterministic
drafter the whole acceptance history follows from the target's greedy tokens:
run plain decoding once per prompt, then replay each drafter configuration
step by step with the real on-device proposer (`ngram_propose`) and walk its
tree against those tokens. The replayed accept lengths equal the engine's own
(tested), at a small fraction of the cost, so a configuration can be judged
on all 164 HumanEval rewrites instead of a handful.

Speed comes from a cost model measured in the same run: the loop's step cost
at each verify width, relative to a plain decode step, with acceptance forced
to 1 (`simulate_accept_length`), interleaved with plain decoding. A replayed
step costs the narrowest verify width that holds its draft, as in the loop.
"""

from __future__ import annotations

import argparse
import dataclasses

import jax.numpy as jnp
import numpy as np

from jaxspec.bench.common import chat_ids, median, print_table


@dataclasses.dataclass(frozen=True)
class NgramShape:
    name: str
    num_draft_tokens: int = 8
    topk: int = 1
    min_match: int = 1
    max_match: int = 4
    draft_tokens_by_match: tuple[int, ...] = (3,)


def replay_accept_lengths(
    prompt: list[int],
    target_tokens: list[int],  # the target's greedy continuation, >= max_new + num_draft_tokens long
    shape: NgramShape,
    max_new: int,
) -> tuple[list[int], list[int]]:
    """(committed tokens per verify step, nodes per step incl. the root) of the n-gram loop.

    Mirrors `jaxspec.speculative.loop`: after prefill the first token is committed, the
    history ends at the root, and a step commits its accepted path plus the
    target's next token (see `jaxspec.speculative.verify`), until max_new tokens."""
    from jaxspec.speculative.drafters.ngram import ngram_propose

    full = np.asarray(list(prompt) + list(target_tokens), np.int32)
    width = 1 << int(np.ceil(np.log2(len(prompt) + max_new + 1)))  # one compiled shape per bucket
    history = np.zeros((1, width), np.int32)
    history[0, : len(full[:width])] = full[:width]
    hist_len, end = len(prompt) + 1, len(prompt) + max_new
    committed, nodes = [], []
    while hist_len < end:
        tokens, parents = ngram_propose(jnp.asarray(history), jnp.array([hist_len], jnp.int32),
                                        num_draft_tokens=shape.num_draft_tokens, topk=shape.topk,
                                        min_match=shape.min_match, max_match=shape.max_match,
                                        draft_tokens_by_match=shape.draft_tokens_by_match)
        tokens, parents = np.asarray(tokens)[0], np.asarray(parents)[0]
        # Walk from the root: a child is accepted iff it is the target's greedy token there.
        cur, accepted = 0, 0
        while True:
            want = full[hist_len + accepted]
            kids = [i for i in range(1, len(tokens)) if parents[i] == cur and tokens[i] == want]
            if not kids:
                break
            cur, accepted = kids[0], accepted + 1
        committed.append(accepted + 1)
        nodes.append(1 + int((tokens[1:] >= 0).sum()))
        hist_len += accepted + 1
    return committed, nodes


def step_costs(model, prompts, widths=(2, 4, 8), max_new: int = 128, reps: int = 5) -> dict[int, float]:
    """{verify width: loop step time / plain step time}, acceptance forced to 1.

    Engines take turns prompt by prompt (the machine drifts by several percent
    within a minute), and each width's ratio is the median over (prompt,
    repetition) of its time over plain's in the same turn."""
    from jaxspec.bench.spec import engine_for, run_engine

    engines = {1: engine_for(model, None)}
    for w in widths:
        engines[w] = engine_for(model, dict(algorithm="ngram", topk=1, num_steps=w - 1, num_draft_tokens=w,
                                            simulate_accept_length=1))
    for eng in engines.values():
        run_engine(eng, prompts[:1], max_new)  # compile + warm
    ratios = {w: [] for w in engines}
    for _ in range(reps):
        for p in prompts:
            secs = {w: 1 / run_engine(eng, [p], max_new, warm=False)[0][0] for w, eng in engines.items()}
            for w in engines:  # one token per step in both modes
                ratios[w].append(secs[w] / secs[1])
    return {w: median(v) for w, v in ratios.items()}


def loop_widths(shape: NgramShape) -> tuple[int, ...]:
    """The verify widths the loop compiles for this shape (`spec.loop.verify_widths`)."""
    from jaxspec.config import SpecSection
    from jaxspec.speculative.loop import SpecPlan, verify_widths

    return verify_widths(SpecPlan.from_config(SpecSection(
        algorithm="ngram", topk=shape.topk, num_draft_tokens=shape.num_draft_tokens,
        ngram_min_match=shape.min_match, ngram_max_match=shape.max_match,
        ngram_draft_tokens_by_match=shape.draft_tokens_by_match)))


def predicted_speedup(nodes: list[int], max_new: int, widths: tuple[int, ...], costs: dict[int, float]) -> float:
    """Plain steps over the replayed steps' cost, each at the narrowest loop width holding its nodes."""
    cost = sum(costs[next(w for w in widths if w >= n)] for n in nodes)
    return (max_new - 1) / cost


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxspec.bench replay")
    p.add_argument("--model", default="default")
    p.add_argument("--num-prompts", type=int, default=164, help="per set (MT-Bench has 80)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    args = p.parse_args(argv)

    from jaxspec.bench.prompts import humaneval_rewrite_prompts, mtbench_questions
    from jaxspec.bench.spec import engine_for
    from jaxspec.engine import Request
    from jaxspec.sampling_params import SamplingParams
    from jaxspec.models.loading import load_model

    model = load_model(args.model, dtype=jnp.float32)
    new = args.max_new_tokens
    sets = {"copy: HumanEval rewrite": chat_ids(model.tokenizer, humaneval_rewrite_prompts(args.num_prompts)),
            "MT-Bench": chat_ids(model.tokenizer, mtbench_questions(args.num_prompts))}
    shapes = [
        NgramShape("chain k=7, 1-gram cap 3 (default)"),
        NgramShape("chain k=7, min match 2, no cap", min_match=2, draft_tokens_by_match=()),
        NgramShape("chain k=7, min match 1, no cap", draft_tokens_by_match=()),
        NgramShape("chain k=7, 1-gram cap 1", draft_tokens_by_match=(1,)),
        NgramShape("chain k=7, 1-gram cap 2", draft_tokens_by_match=(2,)),
        NgramShape("chain k=7, 1-gram 2, 2-gram 3", draft_tokens_by_match=(2, 3)),
        NgramShape("tree 16 (topk 4)", num_draft_tokens=16, topk=4),
    ]
    all_widths = sorted({w for shape in shapes for w in loop_widths(shape)} - {1})
    costs = step_costs(model, sets["MT-Bench"][:3], widths=tuple(all_widths), max_new=new)
    plain = engine_for(model, None)
    rows = []
    for set_name, prompts in sets.items():
        # The target's greedy tokens, long enough to check drafts past the last committed one.
        targets = [plain.generate([Request(pr, SamplingParams(max_tokens=new + 16))])[0].output_ids for pr in prompts]
        for shape in shapes:
            widths = loop_widths(shape)
            speedups, all_steps = [], []
            for pr, tgt in zip(prompts, targets):
                committed, nodes = replay_accept_lengths(pr, tgt, shape, new)
                all_steps += committed
                speedups.append(predicted_speedup(nodes, new, widths, costs))
            rows.append([set_name, shape.name, float(np.mean(all_steps)), median(speedups),
                         len(speedups) / sum(1 / s for s in speedups)])
    print(f"\nreplayed n-gram ablation: {model.path.name}, float32, batch 1, {new} new tokens, EOS ignored, "
          f"{len(sets['copy: HumanEval rewrite'])} HumanEval and {len(sets['MT-Bench'])} MT-Bench prompts")
    print("step cost by verify width (loop step / plain step, measured in this run): "
          + ", ".join(f"{w}: {c:.3f}" for w, c in costs.items()))
    print_table(["prompts", "n-gram shape", "tau", "predicted vs plain (median)", "predicted vs plain (aggregate)"],
                rows)
    return 0
