"""`python -m jaxspec.train`: train a draft head for a target, and plot a run.

    python -m jaxspec.train --drafter eagle3 --target default --data DIR --out runs/NAME \\
        [--config configs/train/eagle3_smollm2.toml] [--set key=value ...] [--steps N] [--resume]
    python -m jaxspec.train plot runs/NAME
    python -m jaxspec.train export runs/NAME --out DIR [--dtype bfloat16]

`--data`: a feature cache built by jaxspec.train.data (manifest.json + shards), a directory of
.npz batches in the same interface, or `sharegpt` to build the cache first in <out>/data
(`--num-conversations`, `--source regenerate|raw`). Configuration: TrainConfig defaults < --config
< --set < flags. The head is exported in its published format to <out>/head at the end.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from jaxspec.models.heads.family import family_of, trainable_kinds


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jaxspec.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--drafter", choices=trainable_kinds(), default=None)
    p.add_argument("--target", default="default", help="target model: 'default', a HF dir or a .gguf")
    p.add_argument("--data", required=True, help="feature cache dir, .npz batches dir, or 'sharegpt'")
    p.add_argument("--out", required=True, help="run directory (checkpoints, log.jsonl, head/)")
    p.add_argument("--config", default=None, help="a configs/train/*.toml")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a TrainConfig key")
    p.add_argument("--steps", type=int, default=None, help="total_steps")
    p.add_argument("--stop-after", type=int, default=None, help="stop (and checkpoint) at this global step")
    p.add_argument("--resume", action="store_true", help="continue from the run's last checkpoint")
    p.add_argument("--init", default=None, metavar="HEAD_DIR",
                   help="warm-start from a published-format head (e.g. checkpoints/eagle3-smollm2-135m)")
    p.add_argument("--eval-data", default=None, help="held-out cache / .npz dir: loss and top-1 at each eval")
    p.add_argument("--eval-batches", type=int, default=4, help="held-out batches to evaluate")
    p.add_argument("--tau-prompts", default=None, help="JSONL prompts: engine τ (greedy) at each eval")
    p.add_argument("--tau-max-new", type=int, default=64)
    p.add_argument("--num-conversations", type=int, default=2000, help="--data sharegpt: conversations")
    p.add_argument("--source", choices=("regenerate", "raw"), default="regenerate", help="--data sharegpt")
    p.add_argument("--quantize", choices=("none", "int8", "gguf"), default="none",
                   help="--data sharegpt: regenerate and capture features on the quantized target "
                        "(engine.quantize), as the head will be served")
    p.add_argument("--quiet", action="store_true")
    return p


def config_from_args(args):
    from jaxspec.config import ConfigValueError
    from jaxspec.train.trainer import train_config

    overrides = {}
    for item in args.set:
        key, eq, value = item.partition("=")
        if not eq:
            raise ConfigValueError(f"--set {item!r}: expected KEY=VALUE")
        overrides[key.strip()] = value
    if args.drafter:
        overrides["drafter"] = args.drafter
    if args.steps is not None:
        overrides["total_steps"] = args.steps
    return train_config(args.config, overrides)


def _eval_inputs(args, cfg, model):
    """(heldout batches, tau prompts) from the flags."""
    from jaxspec.train.trainer import fit_batch, open_source

    heldout = None
    if args.eval_data:
        src = open_source(args.eval_data)
        heldout = []
        for b in src.iterate(cfg.batch_size, 0, 0):
            heldout.append(fit_batch(b, cfg.max_len))
            if len(heldout) >= args.eval_batches:
                break
    prompts = None
    if args.tau_prompts:
        from jaxspec.prompts import encode_entry, read_jsonl

        prompts = [encode_entry(e, model.tokenizer, f"{args.tau_prompts}:{i}")
                   for i, e in enumerate(read_jsonl(args.tau_prompts))]
    return heldout, prompts


def _tau_eval(cfg, model, prompts, heldout, out: Path, max_new: int):
    """eval_fn: engine τ on the prompts (+ held-out loss/top-1), built on first use (the draft
    vocabulary exists once training has started)."""
    import numpy as np

    from jaxspec.train import trainer as tr

    hcfg = tr.make_head_config(cfg, model.config)
    built: dict = {}

    def eval_fn(params):
        if not built:
            ids = np.load(out / "draft_vocab.npy") if family_of(cfg.drafter).draft_vocab else None
            built["engine"] = tr.HeadEngine(hcfg, model, prompts, draft_ids=ids, max_new_tokens=max_new)
            if heldout:
                built["held"] = tr.heldout_eval(heldout, hcfg, tr.shared_target(model, ids), cfg)
        res = {"tau": round(built["engine"].tau(params), 4)}
        if "held" in built:
            res.update(built["held"](params))
        return res

    return eval_fn


def run_train(args) -> int:
    from jaxspec.models.loading import load_model
    from jaxspec.train import trainer as tr

    cfg = config_from_args(args)
    progress = not args.quiet
    model = load_model(args.target, progress=progress, gguf_blocks=args.quantize == "gguf")
    out = Path(args.out)
    if args.data == "sharegpt":
        from jaxspec.speculative.types import FeatureRequest
        from jaxspec.train.data import FeatureCache, eagle3_layers, prepare_data

        # EAGLE-1 and Medusa read the final-norm state only: no aux features on disk for them.
        layers = ()
        if "aux" in family_of(cfg.drafter).train_features:
            layers = tuple(cfg.feature_layers) or eagle3_layers(model.config.num_layers)
        source = prepare_data(args.target, out_dir=out / "data", num_conversations=args.num_conversations,
                              source=args.source, max_len=cfg.max_len, model=model, progress=progress,
                              feature_request=FeatureRequest(layers, True), seed=cfg.seed, quantize=args.quantize)
        source = FeatureCache(source.dir)
    else:
        source = tr.open_source(args.data)
    heldout, prompts = _eval_inputs(args, cfg, model)
    eval_fn = _tau_eval(cfg, model, prompts, heldout, out, args.tau_max_new) if prompts else None
    res = tr.train(cfg, model, source, out, resume=args.resume, stop_at=args.stop_after, eval_fn=eval_fn,
                   heldout=heldout, progress=progress,
                   init=args.init)
    summary = {"step": res.step, "run_dir": str(out), **{k: res.last.get(k) for k in ("loss", "acc", "tokens_per_s")}}
    if res.step == cfg.total_steps:
        summary["head"] = str(out / "head")
    print(json.dumps(summary), file=sys.stderr)
    return 0


def export_run(run_dir, out, *, target: str = "default", dtype: str = "float32") -> Path:
    """Export a run's latest checkpoint (a stopped run too, not only a finished one) to `out` in
    its published format, cast to `dtype`."""
    import jax
    import numpy as np

    from jaxspec.models.loading import load_model
    from jaxspec.train import checkpoint
    from jaxspec.train import trainer as tr
    from jaxspec.train.export import cast_head, export_head

    run = Path(run_dir)
    if not (run / "train_config.json").is_file():
        raise FileNotFoundError(f"{run}: not a training run (no train_config.json)")
    cfg = tr.train_config(None, json.loads((run / "train_config.json").read_text()))
    model = load_model(target, progress=False)
    hcfg = tr.make_head_config(cfg, model.config)
    ids = np.load(run / "draft_vocab.npy") if family_of(cfg.drafter).draft_vocab else None
    shared = tr.shared_target(model, ids)
    params = tr.init_train_params(hcfg, shared, cfg.seed, ids, cfg.eagle3_head_init)
    like = {"params": params, "opt": tr.make_optimizer(cfg)[0].init(params), "step": np.zeros((), np.int32),
            "rng": np.zeros((2,), np.uint32)}
    mngr = checkpoint.manager(run, cfg.keep_checkpoints)
    try:
        state, meta = checkpoint.restore(mngr, like, set_aside=False)  # export only reads
    finally:
        mngr.close()
    if state is None:
        raise FileNotFoundError(f"{run}: no checkpoint to export")
    out = export_head(jax.device_get(state["params"]), hcfg, out, draft_ids=ids, num_target_layers=model.config.num_layers,
                      extra={"jaxspec_train": {"step": meta["step"], "tokens": meta["tokens"]}})
    return cast_head(out, dtype)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "export":
        p = argparse.ArgumentParser(prog="python -m jaxspec.train export")
        p.add_argument("run_dir")
        p.add_argument("--out", required=True, help="directory for the head (published format)")
        p.add_argument("--target", default="default")
        p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
        a = p.parse_args(argv[1:])
        try:
            print(export_run(a.run_dir, a.out, target=a.target, dtype=a.dtype))
        except (FileNotFoundError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0
    if argv and argv[0] == "campaign":
        from jaxspec.train.campaign import main as campaign_main

        return campaign_main(argv[1:])
    if argv and argv[0] == "plot":
        p = argparse.ArgumentParser(prog="python -m jaxspec.train plot")
        p.add_argument("run_dir")
        p.add_argument("--out", default=None, help="PNG path (default <run_dir>/curves.png)")
        a = p.parse_args(argv[1:])
        from jaxspec.train.trainer import plot

        try:
            print(plot(a.run_dir, a.out))
        except (RuntimeError, ValueError, FileNotFoundError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0
    args = build_parser().parse_args(argv)
    from jaxspec.config import ConfigValueError
    from jaxspec.models.config import ConfigError

    try:
        return run_train(args)
    except (ConfigValueError, ConfigError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
