"""`python -m jaxspec.bench train`: the training pipeline's three rates, beside these cores' ceilings.

One run on the embedded target, float32:

1. data generation: ShareGPT first turns answered by the target through the batched engine
   (greedy, `--gen-batch` rows, up to `--gen-tokens` new tokens), new tokens/s;
2. feature capture: the target's batched prefill over those sequences, capturing EAGLE-3's layers
   and the final-norm state (float16), tokens/s;
3. head training: optimizer steps of EAGLE-3 (TTT 7 and TTT 5) and DFLASH on rows of realistic
   shapes (`--train-batch` x `--train-len`, random features: the cost does not depend on values),
   tokens/s after the first (compiling) step.

Each rate is printed beside its FLOP ceiling: the stage's FLOPs per token over the dense
float32 GEMM rate these cores measure in the same run, so a stage far below its ceiling is
overhead, not arithmetic. The end-to-end rate of getting one new token into the head is the
harmonic combination of the stages a token passes (regenerated: all three; raw ShareGPT
text: capture and training).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np


def gemm_gflops(n: int = 1024, reps: int = 5) -> float:
    """Dense float32 matmul rate of this machine (all cores XLA uses), GFLOP/s."""
    import jax
    import jax.numpy as jnp

    from jaxspec.bench.common import timed

    a = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    return 2 * n ** 3 / min(timed(lambda: f(a).block_until_ready(), reps)) / 1e9


def target_flops_per_token(cfg) -> float:
    """2 x the target's matrix parameters (embedding lookups are free; the LM head counts)."""
    h, i, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    per_layer = h * cfg.q_size + 2 * h * cfg.kv_size + cfg.q_size * h + 3 * h * i
    return 2.0 * (L * per_layer + h * cfg.vocab_size)


def eagle3_train_flops_per_token(cfg, draft_vocab: int, ttt: int) -> float:
    """Forward + backward (3x) of TTT steps of one decoder layer over [embed, feature] (2H wide
    q/k/v), the fc over three features and the draft LM head, plus the target's soft labels."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    layer = 2 * h * cfg.q_size + 2 * 2 * h * cfg.kv_size + cfg.q_size * h + 3 * h * i
    step = 2.0 * (layer + h * draft_vocab)
    return 3.0 * (ttt * step + 2.0 * 3 * h * h) + 2.0 * h * cfg.vocab_size


def time_generation(model, n: int, batch: int, new: int) -> tuple[float, list[np.ndarray]]:
    from jaxspec.config import EngineSection
    from jaxspec.engine import Engine, Request
    from jaxspec.sampling_params import SamplingParams
    from jaxspec.train.data import _template
    from jaxspec.train.sharegpt import sharegpt_conversations

    convs = [c for _, c in zip(range(n), sharegpt_conversations("train"))]
    prompts = [_template(model.tokenizer, c.messages[:1], True)[:256] for c in convs]
    engine = Engine(model.params, model.config, EngineSection(max_batch_size=batch, max_context=512), progress=False)
    reqs = [Request(p, SamplingParams(max_tokens=new)) for p in prompts]
    engine.generate(reqs)  # compiles every bucket these prompts use: the timed run compiles nothing
    t = time.perf_counter()
    res = engine.generate(reqs)
    dt = time.perf_counter() - t
    seqs = [np.asarray(r.prompt_ids + r.output_ids, np.int32) for r in res]
    return sum(len(r.output_ids) for r in res) / dt, seqs


def time_capture(model, seqs: list[np.ndarray], batch: int = 8) -> float:
    from jaxspec.speculative.types import FeatureRequest
    from jaxspec.train.data import capture_features, eagle3_layers

    req = FeatureRequest(eagle3_layers(model.config.num_layers), True)
    capture_features(model.params, model.config, seqs, req, batch=batch, max_len=512)  # compile every length
    t = time.perf_counter()
    capture_features(model.params, model.config, seqs, req, batch=batch, max_len=512)
    return sum(len(s) for s in seqs) / (time.perf_counter() - t)


def time_training(model, drafter: str, batch: int, length: int, steps: int, **overrides) -> float:
    from jaxspec.train import trainer as tr

    cfg_t = model.config
    h, n = cfg_t.hidden_size, batch * (steps + 2)
    rng = np.random.default_rng(0)
    rows = {"tokens": rng.integers(0, cfg_t.vocab_size, (n, length)).astype(np.int32),
            "loss_mask": np.ones((n, length), bool), "lengths": np.full((n,), length, np.int32),
            "aux": (rng.standard_normal((n, length, 3 * h)) * 0.5).astype(np.float16),
            "final": (rng.standard_normal((n, length, h)) * 0.5).astype(np.float16)}
    cfg = tr.TrainConfig(drafter=drafter, total_steps=steps + 1, batch_size=batch, max_len=length,
                         length_buckets=(length,), log_every=steps + 1, save_every=10 ** 6, **overrides)
    with tempfile.TemporaryDirectory() as d:
        res = tr.train(cfg, model, tr.ArraySource(rows), Path(d), progress=False, export=False)
    return float(res.last.get("tokens_per_s") or float("nan"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxspec.bench train", description=__doc__.split("\n\n")[0])
    p.add_argument("--gen-conversations", type=int, default=32)
    p.add_argument("--gen-batch", type=int, default=32)
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--train-batch", type=int, default=8)
    p.add_argument("--train-len", type=int, default=384)
    p.add_argument("--train-steps", type=int, default=6)
    p.add_argument("--skip", default="", help="comma list of stages to skip: gen, capture, eagle3, dflash")
    args = p.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))

    from jaxspec.bench.common import print_table
    from jaxspec.models.loading import load_model

    model = load_model("default", progress=False)
    cfg = model.config
    gflops = gemm_gflops()
    nan = float("nan")
    gen = cap = nan
    seqs: list[np.ndarray] = []
    if "gen" not in skip:
        gen, seqs = time_generation(model, args.gen_conversations, args.gen_batch, args.gen_tokens)
    if "capture" not in skip:
        if not seqs:
            rng = np.random.default_rng(0)
            seqs = [rng.integers(0, cfg.vocab_size, 300).astype(np.int32) for _ in range(32)]
        cap = time_capture(model, seqs)
    rows = [["data generation (decode, batch %d)" % args.gen_batch, gen, gflops * 1e9 / target_flops_per_token(cfg)],
            ["feature capture (prefill, batch 8)", cap, gflops * 1e9 / target_flops_per_token(cfg)]]
    train_rates = {}
    if "eagle3" not in skip:
        for ttt in (7, 5):
            r = time_training(model, "eagle3", args.train_batch, args.train_len, args.train_steps, ttt_length=ttt,
                              draft_vocab_size=8192)
            train_rates[f"eagle3 TTT {ttt}"] = r
            rows.append([f"EAGLE-3 training, TTT {ttt}", r,
                         gflops * 1e9 / eagle3_train_flops_per_token(cfg, 8192, ttt)])
    if "dflash" not in skip:
        r = time_training(model, "dflash", args.train_batch, args.train_len, args.train_steps, block_layers=2,
                          block_size=8)
        train_rates["dflash"] = r
        # Its FLOPs per sequence token hang on the anchors sampled per row (block_anchors), not on
        # the row length alone: no single ceiling, so none is printed.
        rows.append(["DFLASH training (2 layers, block 8)", r, nan])
    print(f"\njaxspec training pipeline: {model.path.name}, float32; dense GEMM {gflops:.0f} GFLOP/s on this machine")
    print_table(["stage", "tokens/s", "FLOP ceiling tokens/s", "of ceiling"],
                [[a, b, c, f"{100 * b / c:.0f}%" if b == b and c == c else "n/a"] for a, b, c in rows])
    hm = lambda *xs: 1.0 / sum(1.0 / x for x in xs)  # noqa: E731
    e2e = []
    for name, r in train_rates.items():
        e2e.append([name, hm(gen, cap, r) if gen == gen else nan, hm(cap, r) if cap == cap else nan])
    if e2e:
        print("\none new token into the head, end to end (harmonic combination of the stages it passes):")
        print_table(["head", "regenerated tokens/s", "raw ShareGPT tokens/s"], e2e)
    return 0
