"""`python -m jaxspec.bench lmeval`: lm-evaluation-harness against `python -m jaxspec.serve` (issue 26).

A client no one here wrote: lm_eval's `local-completions` model scores a small multiple-choice task
(hand-written questions in a local JSON file; there is no dataset hub here) through the server's
`/v1/completions` with `echo` and `logprobs`, speculation on. Every loglikelihood lm_eval read is
recomputed with Hugging Face transformers (float32) on the token ids lm_eval built; the command
fails if any differs by more than `--tol`. A short generative task follows so the drafter verifies
(loglikelihood requests generate one token, which the prefill gives: no draft is verified there).

    python -m jaxspec.bench lmeval                       # n-gram speculation
    python -m jaxspec.bench lmeval --spec none --limit 5

Needs the `eval` extra: pip install -e '.[eval]' (lm_eval[api]==0.4.13).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from jaxspec.bench.common import print_table

INSTALL = "pip install -e '.[eval]' (lm_eval[api]==0.4.13)"
TASK = "jaxspec_mc"
GEN_TASK = "jaxspec_gen"

# (question, choices, index of the answer): easy enough that a 135M model gets some right.
QUESTIONS = [
    ("What is 2 + 2?", ["3", "4", "5", "22"], 1),
    ("What colour is the sky on a clear day?", ["green", "blue", "red", "black"], 1),
    ("How many days are in a week?", ["five", "six", "seven", "ten"], 2),
    ("What is the capital of France?", ["Paris", "London", "Berlin", "Madrid"], 0),
    ("Which animal says moo?", ["a cat", "a dog", "a cow", "a duck"], 2),
    ("What is 10 minus 3?", ["7", "6", "13", "3"], 0),
    ("Which of these is a fruit?", ["a carrot", "an apple", "a potato", "an onion"], 1),
    ("What do bees make?", ["milk", "silk", "honey", "wool"], 2),
    ("How many legs does a spider have?", ["six", "four", "ten", "eight"], 3),
    ("Water freezes at what temperature in Celsius?", ["0 degrees", "50 degrees", "100 degrees"], 0),
    ("Which planet do we live on?", ["Mars", "Earth", "Venus", "Jupiter"], 1),
    ("What is the opposite of hot?", ["warm", "cold", "big", "fast"], 1),
    ("How many hours are in a day?", ["12", "24", "48", "60"], 1),
    ("Which is the largest ocean?", ["the Atlantic", "the Indian", "the Pacific", "the Arctic"], 2),
    ("What is 3 times 3?", ["6", "9", "12", "33"], 1),
    ("What do you use to write on a blackboard?", ["chalk", "a spoon", "soap", "a brush"], 0),
]


def write_tasks(root: Path) -> None:
    """The dataset (JSONL) and two task YAMLs lm_eval's TaskManager finds under `root`."""
    data = root / "questions.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a, "answer_text": c[a]}) + "\n"
                            for q, c, a in QUESTIONS))
    common = (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {json.dumps(str(data))}\n"
              "test_split: test\ndoc_to_text: \"Question: {{question}}\\nAnswer:\"\n")
    (root / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n{common}output_type: multiple_choice\ndoc_to_choice: \"{{{{choices}}}}\"\n"
        "doc_to_target: answer\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    (root / f"{GEN_TASK}.yaml").write_text(
        f"task: {GEN_TASK}\n{common}output_type: generate_until\ndoc_to_target: \" {{{{answer_text}}}}\"\n"
        "generation_kwargs:\n  until: [\"\\n\", \"Question:\"]\n  max_gen_toks: 24\n  temperature: 0\n"
        "metric_list:\n  - metric: exact_match\n")


def hf_dir(model: str) -> Path:
    """The Hugging Face directory behind `--model` (the default GGUF converts once, cached)."""
    from jaxspec.models.loading import cached_gguf_dir, default_gguf_path

    path = default_gguf_path() if model == "default" else Path(model).expanduser()
    return cached_gguf_dir(path, progress=False) if path.suffix.lower() == ".gguf" else path


def server(args):
    """`python -m jaxspec.serve` on loopback, as `bench serve` starts it; adaptive off: the policy may
    measure plain decoding faster and stop drafting."""
    from jaxspec.bench.servers import launched
    from jaxspec.serve.launch import SERVE_DEFAULTS

    overrides = {**SERVE_DEFAULTS, "spec.algorithm": args.spec, "serve.adaptive": False,
                 "engine.max_batch_size": 1, "engine.max_context": args.max_context}
    return launched(args.model, overrides, f"lmeval-{args.spec}", port=args.port)


def evaluate(lm, task: str, task_manager, limit) -> tuple[dict, float]:
    import lm_eval

    t0 = time.perf_counter()
    out = lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=task_manager, limit=limit,
                                  log_samples=True, num_fewshot=0, bootstrap_iters=0)
    return out, time.perf_counter() - t0


def hf_loglikelihoods(hf, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
    """(sum of log-softmax over the continuation, whether every continuation token is the argmax)."""
    import torch

    out = []
    with torch.no_grad():
        for ctx, cont in pairs:
            ids = torch.tensor([ctx + cont])
            logp = torch.log_softmax(hf(ids).logits[0, len(ctx) - 1:-1].float(), dim=-1)
            target = torch.tensor(cont)
            out.append((float(logp[torch.arange(len(cont)), target].sum()), bool((logp.argmax(-1) == target).all())))
    return out


def tau_delta(url: str, before: tuple[float, float]) -> str:
    from jaxspec.bench.serve import accept_stats

    total, count = accept_stats(url)
    steps = count - before[1]
    return f"{(total - before[0]) / steps:.3f} over {steps:.0f} verify steps" if steps else "no verify steps"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxspec.bench lmeval")
    p.add_argument("--model", default="default")
    p.add_argument("--spec", default="ngram", help="the server's spec.algorithm (ngram, none, ...)")
    p.add_argument("--limit", type=int, help="documents per task (default: all %d)" % len(QUESTIONS))
    p.add_argument("--port", type=int, help="default: a free port")
    p.add_argument("--max-context", type=int, default=512)
    p.add_argument("--tol", type=float, default=2e-3, help="largest |lm_eval - HF| loglikelihood allowed")
    p.add_argument("--text-requests", action="store_true",
                   help="lm_eval sends prompts as text (tokenized_requests=False), not token ids")
    args = p.parse_args(argv)
    try:
        import lm_eval
        import tenacity  # noqa: F401 - lm_eval's API models need it (its `api` extra), found only when called
        from lm_eval.models.openai_completions import LocalCompletionsAPI
        from lm_eval.tasks import TaskManager
    except ImportError as e:
        print(f"error: lm-evaluation-harness is not installed ({e.name}); {INSTALL}", file=sys.stderr)
        return 2
    import tempfile

    import torch
    import transformers as tf

    from jaxspec.bench.serve import accept_stats

    path = hf_dir(args.model)
    with tempfile.TemporaryDirectory(prefix="jaxspec-lmeval-") as root, server(args) as (url, model):
        write_tasks(Path(root))
        tm = TaskManager(include_path=root)
        lm = LocalCompletionsAPI(model=model, base_url=url + "/v1/completions", tokenizer=str(path),
                                 tokenizer_backend="huggingface", tokenized_requests=not args.text_requests,
                                 num_concurrent=1, max_retries=3, max_length=args.max_context, timeout=600)
        s0 = accept_stats(url)
        mc, mc_wall = evaluate(lm, TASK, tm, args.limit)
        tau_mc, s1 = tau_delta(url, s0), accept_stats(url)
        gen, gen_wall = evaluate(lm, GEN_TASK, tm, args.limit)
        tau_gen = tau_delta(url, s1)

    # lm_eval's own split of each (context, continuation) into token ids: the ids it sent.
    reqs = [(args_, resp[0]) for s in mc["samples"][TASK] for args_, resp in zip(s["arguments"], s["resps"])]
    pairs = [lm._encode_pair(ctx, cont) for (ctx, cont), _ in reqs]
    hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ref = hf_loglikelihoods(hf, pairs)
    rows, worst, greedy_off = [], 0.0, 0
    for i, (((ctx, cont), (ll, greedy)), (want, want_greedy), (c_ids, k_ids)) in enumerate(zip(reqs, ref, pairs)):
        diff = abs(ll - want)
        worst, greedy_off = max(worst, diff), greedy_off + (greedy != want_greedy)
        question = ctx.split("\n")[0].removeprefix("Question: ")[:30]
        rows.append([i, json.dumps(question), json.dumps(cont), f"{len(c_ids)}+{len(k_ids)}",
                     f"{ll:.5f}", f"{want:.5f}", f"{diff:.1e}", f"{greedy}/{want_greedy}"])
    print(f"\nlm_eval {lm_eval.__version__} local-completions -> jaxspec.serve ({model}, spec.algorithm={args.spec}, "
          f"{'text' if args.text_requests else 'token-id'} prompts) vs Hugging Face float32 on lm_eval's token ids")
    print_table(["#", "question", "continuation", "tokens ctx+cont", "lm_eval ll", "HF ll", "|diff|",
                 "greedy lm_eval/HF"], rows)
    res, gres = mc["results"][TASK], gen["results"][GEN_TASK]
    print(f"\n{len(rows)} loglikelihoods over {len(mc['samples'][TASK])} docs: max |diff| {worst:.2e} "
          f"(tolerance {args.tol:g}), is_greedy disagreements {greedy_off}")
    print(f"{TASK}: acc {res['acc,none']:.3f}, acc_norm {res['acc_norm,none']:.3f}, {mc_wall:.1f}s; "
          f"spec tau {tau_mc}")
    print(f"{GEN_TASK}: exact_match {gres['exact_match,none']:.3f}, {gen_wall:.1f}s; spec tau {tau_gen}")
    ok = worst <= args.tol and greedy_off == 0
    print("PASS" if ok else "FAIL: lm_eval's loglikelihoods differ from Hugging Face's")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
