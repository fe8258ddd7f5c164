"""`python -m jaxspec.train campaign`: one round of the EAGLE-3 training campaign.

    python -m jaxspec.train campaign [--drafter eagle3|frozen_kv] [--raw N] [--regen N] [--work DIR]   # one round
    python -m jaxspec.train campaign plot [PNG [DRAFTER]]                  # τ, held-out top-1 against tokens

A round survives fresh machines: everything it needs is in the shipped head's directory
(`campaign.json`: the rounds so far, where the next round's conversations start, the command
line), and every step resumes from what a killed round left in `--work`:

1. data: the next `--raw` ShareGPT train-split conversations after the last round's, all turns,
   ShareGPT's own answers (features of the target over them: the soft labels are the target's own
   distribution at each position, so raw text costs one prefill per token, no decode), plus the
   next `--regen` first turns answered by the target (every second one at T = 0.7, so sampled
   acceptance trains too);
2. train one epoch of the round's data, from the previous round's candidate when it was not shipped
   and is still in `--work` (`--init latest`, the default: a held-out gain too small for ten MT-Bench
   prompts to show still accumulates), else from the shipped head;
3. evaluate the candidate and the shipped head side by side on MT-Bench first turns (batch 1,
   greedy, chain of 3, τ, acceptance per position and the median per-prompt ratio to plain);
4. ship (bf16, into the head directory, with the curve point appended) only if MT-Bench τ rose.

The caches stay in `--work` (never committed); the shipped head and campaign.json are what lasts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import time
from pathlib import Path

HEAD = Path(__file__).resolve().parents[2] / "checkpoints" / "eagle3-smollm2-135m"
FIRST_UNUSED = 2432  # conversations the first shipped head saw (regenerated 0..2432, raw 0..1000)


@dataclasses.dataclass(frozen=True)
class Campaign:
    """What differs between the drafters a campaign trains: the head's directory, its training
    recipe, the target states its data captures and the algorithm that evaluates it."""
    drafter: str
    head: Path
    config: str
    algorithm: str
    heldout: str  # the shared held-out cache's directory name under --work (its captured layers differ)

    def request(self, cfg):
        from jaxspec.speculative.types import FeatureRequest
        from jaxspec.train.data import eagle3_layers

        if self.drafter == "frozen_kv":
            return FeatureRequest((cfg.num_layers - 2, cfg.num_layers - 1), True)
        return FeatureRequest(eagle3_layers(cfg.num_layers), True)


CAMPAIGNS = {
    "eagle3": Campaign("eagle3", HEAD, "configs/train/eagle3_smollm2.toml", "eagle3", "heldout"),
    "frozen_kv": Campaign("frozen_kv", HEAD.parent / "frozen-kv-smollm2-135m", "configs/train/frozen_kv_smollm2.toml",
                          "frozen_kv_mtp", "heldout-frozen_kv"),
}


def _state(head: Path) -> dict:
    f = head / "campaign.json"
    if f.exists():
        return json.loads(f.read_text())
    return {"next_conversation": FIRST_UNUSED, "tokens_seen": 760_000, "rounds": []}


def plan_round(state: dict, raw: int, regen: int, train_size: int, repeat_raw: bool = False) -> dict:
    """Where the next round reads: {first, raw, regen, epoch}. The first epoch reads ShareGPT's own
    answers once (round 14 found the train split used up at conversation 17,047, 4.98M tokens);
    later epochs start again at FIRST_UNUSED and by default regenerate only, since raw text repeats
    tokens already trained on while the target's answers (every second one sampled, seeded per epoch)
    are new. `repeat_raw` reads raw text again in later epochs: a second pass over ShareGPT brings
    ~0.4M tokens an hour where regeneration brings ~0.1M, and rounds 15-17 showed the head's curve flat
    on new regenerated data, so what is left to learn is how far more passes move it."""
    epoch, first = state.get("epoch", 1), state["next_conversation"]
    if first >= train_size:
        epoch, first = epoch + 1, FIRST_UNUSED
    if epoch > 1 and not repeat_raw:
        raw = 0
    raw = min(raw, train_size - first)
    regen = min(regen, train_size - first - raw)
    return {"first": first, "raw": raw, "regen": regen, "epoch": epoch}


def train_split_size() -> int:
    from jaxspec.train.sharegpt import sharegpt_conversations

    return sum(1 for _ in sharegpt_conversations("train"))


def _done(marker: Path) -> bool:
    return marker.exists()


def _mark(marker: Path, data: dict | None = None) -> None:
    marker.write_text(json.dumps(data or {}, indent=1) + "\n")


def build_round_data(work: Path, first: int, raw: int, regen: int, heldout: int, model,
                     campaign: Campaign = CAMPAIGNS["eagle3"], seed: int = 0) -> dict:
    from jaxspec.train.data import prepare_data

    req = campaign.request(model.config)
    t0 = time.perf_counter()
    out = {}
    if raw:
        c = prepare_data("default", out_dir=work / "raw", num_conversations=raw, source="raw", max_len=512,
                         batch=8, feature_request=req, model=model, first_conversation=first)
        out["raw_tokens"] = sum(s["num_tokens"] for s in c.shards)
    if regen:
        c = prepare_data("default", out_dir=work / "regen", num_conversations=regen, source="regenerate",
                         temperature=0.0, sampled_every=2, sampled_temperature=0.7, max_len=384,
                         max_new_tokens=256, batch=32, feature_request=req, model=model,
                         first_conversation=first + raw, seed=seed)
        out["regen_tokens"] = sum(s["num_tokens"] for s in c.shards)
    prepare_data("default", out_dir=work.parent / campaign.heldout, num_conversations=heldout, source="regenerate",
                 temperature=0.0, max_len=384, max_new_tokens=256, batch=32, feature_request=req, model=model,
                 split="heldout")
    out["data_s"] = round(time.perf_counter() - t0, 1)
    return out


def evaluate(model, heads: dict[str, Path], num_prompts: int, max_new: int = 128, algorithm: str = "eagle3") -> dict:
    """MT-Bench first turns, batch 1, greedy, chain of 3: plain and each head in one run."""
    import jax.numpy as jnp

    from jaxspec.bench.common import chat_ids, median
    from jaxspec.bench.prompts import mtbench_questions
    from jaxspec.bench.spec import engine_for, run_engine
    from jaxspec.config import SpecSection
    from jaxspec.speculative.drafters.load import load_draft

    prompts = chat_ids(model.tokenizer, mtbench_questions(num_prompts))
    plain, _ = run_engine(engine_for(model, None), prompts, max_new)
    out = {"plain_tok_s": round(median(plain), 1)}
    for name, path in heads.items():
        kw = dict(algorithm=algorithm, draft_model=str(path), topk=1, num_steps=3, num_draft_tokens=4)
        draft = load_draft(SpecSection(**kw), model, jnp.float32, progress=False)
        rates, lens = run_engine(engine_for(model, kw, draft=draft), prompts, max_new)
        acc = [sum(1 for n in lens if n - 1 >= d) / max(len(lens), 1) for d in (1, 2, 3)]
        out[name] = {"tau": round(sum(lens) / max(len(lens), 1), 3), "tok_s": round(median(rates), 1),
                     "vs_plain": round(median([r / p for r, p in zip(rates, plain)]), 3),
                     "accept_by_position": [round(a, 3) for a in acc]}
    return out


def init_head(mode: str, state: dict, head: Path, work: Path) -> tuple[Path, int]:
    """(head directory, tokens it has seen) the next round trains from: the previous round's
    candidate if `mode` is "latest", it was not shipped and its export is still in `work`."""
    prev = state["rounds"][-1] if state["rounds"] else None
    cand = work / f"round{len(state['rounds'])}" / "head"
    if mode == "latest" and prev and not prev["shipped"] and (cand / "config.json").exists():
        return cand, prev["tokens_seen"]
    return head, state["tokens_seen"]


def run_round(args) -> int:
    import subprocess

    from jaxspec.models.loading import load_model

    def train_cli(*argv) -> int:  # `python -m jaxspec.train`, in its own process (and memory)
        return subprocess.run([sys.executable, "-m", "jaxspec.train", *argv]).returncode

    campaign = CAMPAIGNS[args.drafter]
    head = Path(args.head) if args.head else campaign.head
    state = _state(head)
    rnum = len(state["rounds"]) + 1
    work = Path(args.work) / f"round{rnum}"
    work.mkdir(parents=True, exist_ok=True)
    plan = plan_round(state, args.raw, args.regen, train_split_size(), args.repeat_raw)
    first = plan["first"]
    model = load_model("default", progress=False)
    log = lambda msg: print(f"[campaign round {rnum}] {msg}", file=sys.stderr, flush=True)  # noqa: E731

    # 1. Data (each cache resumes shard by shard).
    if not _done(work / "data.done"):
        if plan["raw"] < args.raw:
            log(f"epoch {plan['epoch']}: {plan['raw']} of the {args.raw} raw conversations asked for "
                "(ShareGPT's own answers are read once; later epochs regenerate unless --repeat-raw)")
        log(f"data: conversations {first}.. ({plan['raw']} raw, {plan['regen']} regenerated)")
        built = build_round_data(work, first, plan["raw"], plan["regen"], args.heldout, model, campaign,
                                 seed=plan["epoch"] - 1)
        if not built.get("raw_tokens") and not built.get("regen_tokens"):
            log(f"error: conversations {first}.. gave no training tokens (--raw {plan['raw']}, "
                f"--regen {plan['regen']}); nothing to train on")
            return 2
        _mark(work / "data.done", built)
    data = json.loads((work / "data.done").read_text())
    log(f"data: {data}")

    # 2. Train one epoch of the round's data, continuing the previous candidate where it is kept.
    from jaxspec.train.data import CacheUnion, FeatureCache

    init, init_tokens = init_head(args.init, state, head, Path(args.work))
    log(f"train: from {init} ({init_tokens} tokens seen)")

    dirs = [str(work / d) for d in ("raw", "regen") if (work / d / "manifest.json").exists()]
    n_ex = CacheUnion(dirs).num_examples if len(dirs) > 1 else FeatureCache(dirs[0]).num_examples
    steps = max(1, int(args.epochs * n_ex) // args.batch)
    run = work / "run"
    if not _done(work / "train.done"):
        argv = ["--config", campaign.config, "--target", "default", "--data", ",".join(dirs),
                "--out", str(run), "--init", str(init), "--eval-data", str(work.parent / campaign.heldout),
                "--eval-batches", "8", "--steps", str(steps), "--set", f"lr={args.lr}",
                "--set", f"batch_size={args.batch}", "--set", f"ttt_length={args.ttt}",
                "--set", f"eval_every={max(steps // 4, 1)}", "--set", "warmup_ratio=0.03"]
        if (run / "train_config.json").exists():
            argv.append("--resume")
        log("train: python -m jaxspec.train " + " ".join(argv))
        rc = train_cli(*argv)
        if rc:
            return rc
        _mark(work / "train.done", {"argv": argv, "steps": steps})
    cand = work / "head"
    if not (cand / "config.json").exists():
        rc = train_cli("export", str(run), "--out", str(cand), "--dtype", "bfloat16")
        if rc:
            return rc

    # 3. Evaluate side by side.
    if not _done(work / "eval.done"):
        _mark(work / "eval.done", evaluate(model, {"shipped": head, "candidate": cand}, args.eval_prompts,
                                           algorithm=campaign.algorithm))
    ev = json.loads((work / "eval.done").read_text())
    log(f"eval: {ev}")

    # 4. Ship only if MT-Bench τ rose.
    lines = [json.loads(ln) for ln in (run / "log.jsonl").read_text().splitlines() if ln]
    heldout = [ln["eval"] for ln in lines if "eval" in ln]
    round_tokens = lines[-1]["tokens"] if lines else 0
    end = first + plan["raw"] + plan["regen"]
    entry = {"round": rnum, "date": time.strftime("%Y-%m-%d"), "conversations": [first, end], "epoch": plan["epoch"],
             "data": data, "steps": steps, "round_tokens": round_tokens,
             "init": "shipped" if init == head else f"round {rnum - 1} candidate",
             "tokens_seen": init_tokens + round_tokens, "heldout_last": heldout[-1] if heldout else None,
             "mtbench": ev, "eval_set": eval_set(args.eval_prompts),
             "shipped": ev["candidate"]["tau"] > ev["shipped"]["tau"],
             "command": "python -m jaxspec.train campaign " + " ".join(sys.argv[2:] if len(sys.argv) > 2 else [])}
    if args.drafter != "eagle3":
        entry["drafter"] = args.drafter
    if entry["shipped"] and not args.dry_run:
        for f in cand.iterdir():
            if f.is_file():
                shutil.copy2(f, head / f.name)
        state["tokens_seen"] = entry["tokens_seen"]
        log(f"shipped: tau {ev['shipped']['tau']} -> {ev['candidate']['tau']}")
    else:
        log(f"not shipped: tau {ev['shipped']['tau']} -> {ev['candidate']['tau']}")
    state["next_conversation"] = end
    state["epoch"] = plan["epoch"]
    state["rounds"].append(entry)
    if not args.dry_run:
        (head / "campaign.json").write_text(json.dumps(state, indent=1) + "\n")
        if not args.keep_data:  # the cache is bounded by one round: its features go once it is recorded
            for d in ("raw", "regen"):
                shutil.rmtree(work / d, ignore_errors=True)
    print(json.dumps(entry))
    return 0


# Rounds 1-14 read MT-Bench's first ten questions, which are all writing (the file is sorted by
# category); their entries name no set.
OLD_EVAL_SET = "MT-Bench writing 10"


def eval_set(num_prompts: int) -> str:
    return f"MT-Bench {num_prompts}, round-robin over the categories"


def curve(state: dict) -> list[dict]:
    """(training tokens seen, MT-Bench τ, held-out top-1 at TTT step 0, prompt set) per evaluated
    head: the head each round started from, then every round's candidate (shipped or not). τ on
    different prompt sets is not comparable: where the set changes, the starting head appears again,
    measured on the new set."""
    points = []
    for r in state["rounds"]:
        start, where = r["tokens_seen"] - r["round_tokens"], r.get("eval_set", OLD_EVAL_SET)
        if all((p["tokens"], p["eval_set"]) != (start, where) for p in points):
            points.append({"tokens": start, "tau": r["mtbench"]["shipped"]["tau"], "heldout_top1": None,
                           "shipped": True, "round": r["round"] - 1, "eval_set": where})
        held = (r.get("heldout_last") or {}).get("heldout_acc") or [None]
        points.append({"tokens": r["tokens_seen"], "tau": r["mtbench"]["candidate"]["tau"],
                       "heldout_top1": held[0], "shipped": r["shipped"], "round": r["round"], "eval_set": where})
    return points


def log_trend(points: list[tuple[float, float]], target: float) -> dict:
    """Least-squares line of a metric against log2(training tokens) over (tokens, value) points: its
    gain per doubling of the tokens, and the tokens at which the line reaches `target` (None when it
    does not rise). An extrapolation of the measured curve, to size what a target would take."""
    import numpy as np

    if len({t for t, _ in points}) < 2:
        raise ValueError(f"a trend needs points at two token counts or more, got {len(points)}")
    x, y = np.log2([t for t, _ in points]), np.array([v for _, v in points], float)
    slope, intercept = np.polyfit(x, y, 1)
    reach = float(2.0 ** ((target - intercept) / slope)) if slope > 0 else None
    return {"per_doubling": float(slope), "tokens_at_target": reach, "points": len(points)}


def heldout_points(state: dict, step: int = 0) -> list[tuple[float, float]]:
    """(tokens seen, held-out top-1 at TTT `step`) of every round's candidate."""
    return [(r["tokens_seen"], r["heldout_last"]["heldout_acc"][step]) for r in state["rounds"]
            if len((r.get("heldout_last") or {}).get("heldout_acc") or []) > step]


def plot_curve(head: Path, out: Path) -> Path:
    """Left: τ (MT-Bench, chain of 3) against training tokens seen; right: held-out top-1 per TTT
    step, with the step-0 trend's extrapolation to the issue's 0.6. Log token axes: docs/img."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    state = _state(head)
    pts = curve(state)
    if not pts:
        raise RuntimeError(f"{head / 'campaign.json'}: no rounds yet")
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
    sets = list(dict.fromkeys(p["eval_set"] for p in pts))
    for i, where in enumerate(sets):  # one line per prompt set: τ across sets is not comparable
        shipped = [p for p in pts if p["shipped"] and p["eval_set"] == where]
        ax.plot([p["tokens"] for p in shipped], [p["tau"] for p in shipped], "-o", color=f"C{i}", label=where)
    dropped = [p for p in pts if not p["shipped"]]
    ax.plot([p["tokens"] for p in dropped], [p["tau"] for p in dropped], "x", color="C3", ls="none")
    if len(sets) > 1:
        ax.legend(fontsize=7, loc="lower right")
    ax.axhline(2.2, ls="--", color="C2", lw=1)
    ax.text(pts[0]["tokens"], 2.23, "issue target: τ 2.2", color="C2", fontsize=8)
    ax.set_ylim(1.0, max(2.4, max(p["tau"] for p in pts) + 0.1))
    ax.set_xscale("log")
    ax.set_xlabel("training tokens seen by the head")
    ax.set_ylabel("MT-Bench τ (chain of 3, greedy)")
    ax.set_title(f"{head.name} (CPU campaign)")
    ax.grid(alpha=0.3)
    # Every round's candidate (rounds from an unshipped candidate included), sorted by tokens.
    for step in range(max(len((r.get("heldout_last") or {}).get("heldout_acc") or []) for r in state["rounds"])):
        held = sorted(heldout_points(state, step))
        ax2.plot([t for t, _ in held], [a for _, a in held], "-o", ms=3, lw=1, color=f"C{step}",
                 label=f"TTT step {step}")
    ax2.axhline(0.6, ls="--", color="C2", lw=1)
    held = heldout_points(state)
    if len({t for t, _ in held}) > 1:
        trend = log_trend(held, 0.6)
        reach = trend["tokens_at_target"]
        ax2.text(min(t for t, _ in held), 0.607, "issue target: step 0 top-1 0.6" + (
            f"; the step-0 line reaches it at ~{reach / 1e6:,.0f}M tokens" if reach else ""), color="C2", fontsize=8)
        ax2.text(min(t for t, _ in held), 0.265, f"step 0: {trend['per_doubling']:+.3f} per doubling of the tokens",
                 fontsize=8)
    ax2.set_ylim(0.25, 0.65)
    ax2.set_xscale("log")
    ax2.set_xlabel("training tokens seen by the head")
    ax2.set_ylabel("held-out top-1 (2% ShareGPT split)")
    ax2.legend(fontsize=7, loc="lower right")
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out


def main(argv: list[str]) -> int:
    if argv and argv[0] == "plot":
        drafter = argv[2] if len(argv) > 2 else "eagle3"
        out = Path(argv[1] if len(argv) > 1 else f"docs/img/{drafter}_tau_vs_tokens.png")
        print(plot_curve(CAMPAIGNS[drafter].head, out))
        return 0
    p = argparse.ArgumentParser(prog="python -m jaxspec.train campaign", description=__doc__.split("\n\n")[0])
    p.add_argument("--drafter", choices=sorted(CAMPAIGNS), default="eagle3",
                   help="the head the round trains: its directory, recipe and captured layers")
    p.add_argument("--head", default="", help="the shipped head directory (read, and written on ship); "
                   "default: the drafter's under checkpoints/")
    p.add_argument("--work", default="cache/campaign", help="caches and runs (not committed)")
    p.add_argument("--raw", type=int, default=2000, help="raw ShareGPT conversations (all turns)")
    p.add_argument("--repeat-raw", action="store_true",
                   help="after the first epoch, read ShareGPT's own answers again (a second pass) besides regenerating")
    p.add_argument("--regen", type=int, default=256, help="first turns regenerated by the target")
    p.add_argument("--heldout", type=int, default=64, help="held-out conversations (regenerated, shared)")
    p.add_argument("--init", choices=["latest", "shipped"], default="latest",
                   help="latest: continue the previous round's candidate if it was not shipped and is in --work")
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--ttt", type=int, default=5, help="TTT steps (the chain of 3 and trees of depth 4 use 0..3)")
    p.add_argument("--eval-prompts", type=int, default=16,
                   help="MT-Bench first turns, round-robin over its 8 categories (rounds 1-15: the first 10, all writing)")
    p.add_argument("--dry-run", action="store_true", help="never write the head directory")
    p.add_argument("--keep-data", action="store_true", help="keep the round's feature caches after it ends")
    return run_round(p.parse_args(argv))
