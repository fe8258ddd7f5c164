"""Benchmark arithmetic: the speedup statistics of the spec benchmark, and the offline
n-gram replay against the on-device loop it stands in for."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxspec.bench.replay import NgramShape, replay_accept_lengths
from jaxspec.bench.spec import acceptance_by_position, speedups

rates = st.lists(st.floats(1.0, 500.0), min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(base=rates, factor=st.lists(st.floats(0.3, 8.0), min_size=12, max_size=12))
def test_speedups_equal_per_prompt_median_and_total_time_ratio(base, factor):
    method = [b * f for b, f in zip(base, factor)]
    paired, aggregate = speedups(method, base)
    # Per prompt: the method's rate over plain's on the same prompt, then the median.
    assert np.isclose(paired, np.median(factor[: len(base)]))
    # Aggregate: every prompt yields the same token count, so it is plain's total
    # seconds over the method's (simulated with 128 tokens per prompt).
    plain_s = sum(128 / b for b in base)
    method_s = sum(128 / m for m in method)
    assert np.isclose(aggregate, plain_s / method_s)


def test_one_fast_prompt_moves_the_aggregate_not_the_median():
    paired, aggregate = speedups([10.0, 10.0, 100.0], [10.0, 10.0, 10.0])
    assert paired == 1.0 and 1.4 < aggregate < 1.5  # 3 / (1 + 1 + 0.1)


def test_acceptance_by_position_counts_accepted_drafts_not_the_bonus():
    # Steps committing 1 (bonus only), 3 and 4 tokens: position 1 accepted in 2 of 3 steps,
    # position 2 in 2, position 3 in 1, position 4 never.
    got = acceptance_by_position([1, 3, 4], 4)
    assert np.allclose(got, [2 / 3, 2 / 3, 1 / 3, 0.0])
    # Its mean sum plus the bonus is tau: sum_i P(accepted at i) = E[L - 1].
    lens = np.random.default_rng(0).integers(1, 7, 500)
    assert np.isclose(sum(acceptance_by_position(lens.tolist(), 6)) + 1, lens.mean())


def test_prompt_sets_name_an_unknown_set():
    from jaxspec.bench.spec import prompt_sets

    with pytest.raises(SystemExit, match="unknown nope"):
        prompt_sets(None, ["mtbench", "nope"], 2)


@pytest.mark.parametrize("text, want", [("1", (1.0, 1.0)), ("0.7,0.9", (0.7, 0.9)), ("1.5", (1.5, 1.0)),
                                        ("0", None), ("x", None), ("1,2", None), ("0.7,0.9,1", None), (",", None)])
def test_sampled_rows_flag_is_checked(text, want):
    """bench spec --sampled T[,TOP_P]: the sampled rows' parameters, or a one-line refusal."""
    from jaxspec.bench.spec import main, parse_sampled

    if want is None:
        with pytest.raises(SystemExit, match="--sampled: expected T or T,TOP_P"):
            main(["--sampled", text])  # refused before the model loads
    else:
        assert parse_sampled(text) == dict(temperature=want[0], top_p=want[1])


@pytest.mark.parametrize("text", ["eagle3=/nonexistent", "nope=checkpoints/eagle3-smollm2-135m",
                                  "checkpoints/eagle3-smollm2-135m", "eagle3="])
def test_head_rows_flag_is_checked(text):
    """bench spec --head ALG=DIR: a head directory timed beside the shipped head, or a one-line refusal."""
    from jaxspec.bench.spec import main, parse_heads
    from jaxspec.paths import checkpoints_dir

    with pytest.raises(SystemExit, match=f"--head {text}: expected ALG=DIR"):
        main(["--head", text])  # refused before the model loads
    d = str(checkpoints_dir() / "frozen-kv-smollm2-135m")
    assert parse_heads([f"frozen_kv_mtp={d}"]) == (("frozen_kv_mtp", d),)


@pytest.mark.parametrize("argv, match", [(["--sampling", "greedy,0.8:0.9,1:1.5"], "--sampling: expected"),
                                         (["--sampling", ""], "--sampling: empty"),
                                         (["--batches", "1,0"], "--batches: expected"),
                                         (["--batches", "8,x"], "--batches: expected"),
                                         (["--drafters", "medusa"], "--drafters: unknown medusa"),
                                         (["--fixed-lengths", "1,0"], "--fixed-lengths: expected"),
                                         (["--fixed-lengths", "x"], "--fixed-lengths: expected")])
def test_adaptive_bench_flags_are_checked_before_the_model_loads(argv, match):
    from jaxspec.bench.adaptive import main, parse_sampling

    with pytest.raises(SystemExit, match=match):
        main(argv)
    assert parse_sampling("greedy, 0.8:0.9,1") == [
        ("greedy", {}), ("T 0.8, top-p 0.9", dict(temperature=0.8, top_p=0.9)), ("T 1", dict(temperature=1.0, top_p=1.0))]


@pytest.mark.parametrize("argv, match", [(["--shapes", "2x64"], "--shapes: expected ROWSxCHUNK@START"),
                                         (["--shapes", "0x64@10"], "--shapes: rows and chunk must be >= 1"),
                                         (["--shapes", " , "], "--shapes: no shapes"),
                                         (["--paths", "flash"], "--paths: unknown flash"),
                                         (["--reps", "0"], "--reps must be >= 1"),
                                         (["--set", "serve.prefill_chunk"], "expected SECTION.KEY=VALUE")])
def test_prefill_bench_flags_are_checked_before_the_model_loads(argv, match):
    from jaxspec.bench.prefill import main, parse_shapes

    with pytest.raises(SystemExit, match=match):
        main(argv)
    assert parse_shapes("1x32@0, 2x256@1200") == [(1, 32, 0), (2, 256, 1200)]


@pytest.mark.parametrize("argv", [["--batch", "1"], ["--reps", "0"], ["--max-tokens", "0"]])
def test_shared_prefix_bench_flags_are_checked_before_the_model_loads(argv):
    from jaxspec.bench.shared_prefix import main

    with pytest.raises(SystemExit, match="--batch must be >= 2"):
        main(argv)


def test_heldout_prompts_come_from_the_split_training_never_sees():
    from jaxspec.train.sharegpt import sharegpt_conversations, sharegpt_heldout_prompts

    got = sharegpt_heldout_prompts(5)
    assert len(got) == 5
    train_firsts = {c.messages[0]["content"] for _, c in zip(range(3000), sharegpt_conversations("train"))}
    assert not set(got) & train_firsts
    held_firsts = [c.messages[0]["content"] for _, c in zip(range(50), sharegpt_conversations("heldout"))]
    assert set(got) <= set(held_firsts)  # positive control: they are held-out first turns


@pytest.mark.parametrize("shape", [
    NgramShape("default chain"),
    NgramShape("min 2 chain", num_draft_tokens=5, min_match=2, draft_tokens_by_match=()),
    NgramShape("tree", num_draft_tokens=12, topk=3, draft_tokens_by_match=(2,)),
], ids=lambda s: s.name)
def test_replay_equals_the_engines_accept_lengths(tiny_dirs, shape):
    """The offline replay predicts exactly what the on-device loop commits per step."""
    from jaxspec.config import EngineSection, SpecSection
    from jaxspec.engine import Engine, Request
    from jaxspec.sampling_params import SamplingParams
    from jaxspec.models.loading import load_model

    model = load_model(str(tiny_dirs["llama"][0]), progress=False)
    ecfg = EngineSection(max_batch_size=1, max_context=128, length_buckets=(16, 32, 64, 128))
    plain = Engine(model.params, model.config, ecfg, progress=False)
    spec = Engine(model.params, model.config, ecfg, progress=False, spec=SpecSection(
        algorithm="ngram", topk=shape.topk, num_steps=3, num_draft_tokens=shape.num_draft_tokens,
        ngram_min_match=shape.min_match, ngram_max_match=shape.max_match,
        ngram_draft_tokens_by_match=shape.draft_tokens_by_match))
    new, drafted = 40, 0
    for prompt in ([5, 17, 33, 9, 100, 42, 7, 5, 17], [11, 12, 13, 11, 12], [99]):
        target = plain.generate([Request(prompt, SamplingParams(max_tokens=new + 16))])[0].output_ids
        res = spec.generate([Request(prompt, SamplingParams(max_tokens=new))])[0]
        committed, nodes = replay_accept_lengths(prompt, target, shape, new)
        assert res.output_ids == target[:new]
        assert committed == res.accept_lengths
        drafted += sum(n > 1 for n in nodes)
    assert drafted > 0  # the prompts do exercise drafts, not only empty steps


def test_release_frees_the_engines_a_bench_section_no_longer_needs(tiny_dirs):
    """bench spec releases its engines between sections (nine live engines ran out of
    vm.max_map_count): every engine not kept is garbage afterwards, and the kept one still decodes
    the same tokens after its compiled programs were dropped."""
    import gc
    import weakref

    from jaxspec.bench.spec import Processed, engine_for, release
    from jaxspec.engine import Request
    from jaxspec.models.loading import load_model
    from jaxspec.sampling_params import SamplingParams

    model = load_model(str(tiny_dirs["llama"][0]), progress=False)
    engines = {"jaxspec plain": engine_for(model, None),
               "ngram": engine_for(model, dict(algorithm="ngram", topk=1, num_steps=3, num_draft_tokens=4))}
    engines["ngram twin"] = Processed(engines["ngram"], temperature=0.0)
    req = [Request([5, 17, 33, 9, 5, 17], SamplingParams(max_tokens=12))]
    before = engines["jaxspec plain"].generate(req)[0].output_ids
    engines["ngram"].generate(req)
    gone = weakref.ref(engines["ngram"])
    gc.collect()
    assert gone() is not None  # positive control: compiled and in use, it is alive before the release
    release(engines, keep={"jaxspec plain"})
    assert list(engines) == ["jaxspec plain"] and gone() is None
    assert engines["jaxspec plain"].generate(req)[0].output_ids == before


def test_mtbench_questions_spread_over_the_categories():
    """The file is sorted by category (its first ten are all writing); any n takes them round-robin,
    and n = 80 is the whole set, each question once."""
    from jaxspec.bench import prompts as ps

    def mtbench_categories(n):  # the category of each of mtbench_questions(n)
        return [r["category"] for r in ps.round_robin(ps._mtbench_rows(), "category")[:n]]

    assert mtbench_categories(8) == ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem",
                                        "humanities"]
    assert mtbench_categories(10)[8:] == ["writing", "roleplay"]
    rows = ps._mtbench_rows()  # the file's own order
    every = ps.mtbench_questions(80)
    assert sorted(every) == sorted(r["turns"][0] for r in rows) and len(set(every)) == 80
    # Control: the file's own order is what the old first-n took, all writing.
    assert {r["category"] for r in rows[:10]} == {"writing"}
    # Within a category the file's order is kept.
    math = [q for q, c in zip(every, mtbench_categories(80)) if c == "math"]
    assert math == [r["turns"][0] for r in rows if r["category"] == "math"]


def test_bench_server_launcher_stops_on_a_failed_start_up():
    """`bench serve` waited forever (17 min, 2026-12-05) on a server whose start-up had failed: its
    /health answers 500 with the reason and the process stays up. Now the reason is raised; 503
    (compiling) keeps waiting and 200 is ready, its "warmup" read apart. Served by a stub HTTP server
    with the real bodies."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from jaxspec.bench.servers import is_ready, warmup_state

    answers = {"/ready/health": (200, {"status": "ok"}), "/starting/health": (503, {"status": "starting"}),
               "/warming/health": (200, {"status": "ok", "warmup": "running"}),
               "/failed/health": (500, {"status": "error", "error": "MapLimitError: 69 programs x ~894"})}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            code, body = answers[self.path]
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    httpd = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        assert is_ready(base + "/ready") is True
        assert is_ready(base + "/starting") is False
        # Ready, but the structured-output builds still compile on a core: the launcher waits them out.
        assert is_ready(base + "/warming") is True and warmup_state(base + "/warming") == "running"
        assert warmup_state(base + "/ready") == "off"  # a server that reports none
        with pytest.raises(RuntimeError, match="failed to start: MapLimitError: 69 programs"):
            is_ready(base + "/failed", "[off] server")
    finally:
        httpd.shutdown()


def test_bench_serve_rounds_take_turns_and_report_per_round_ratios(monkeypatch, capsys):
    """--rounds: both servers stay up, their waves alternate ABBA and the ratio is taken round by round,
    so the machine's speed swings (one round's pair of waves runs at its own speed here: 1.0, 0.5,
    0.8, 0.6) fall on both modes. Servers and waves are stubbed; adaptive is truly 1.1x off."""
    import contextlib

    from jaxspec.bench import serve as bs

    order, machine = [], [1.0, 0.5, 0.8, 0.6]

    @contextlib.contextmanager
    def fake_launched(model, overrides, label, config=None):
        yield f"http://{label}", "m"

    def fake_wave(url, model, prompts, levels, args):
        mode = url.removeprefix("http://")
        speed = (1.1 if mode == "adaptive" else 1.0) * machine[len(order) // 2]
        order.append(mode)
        return [{"concurrency": c, "tok_s": 100.0 * speed, "ttft_p50": 1.0, "tau": 1.0} for c in levels]

    monkeypatch.setattr(bs, "launched", fake_launched)
    monkeypatch.setattr(bs, "bench_url", fake_wave)
    monkeypatch.setattr(bs, "metric_samples", lambda url: [])
    monkeypatch.setattr(bs.asyncio, "run", lambda coro: coro.close())  # the priming request
    assert bs.main(["--concurrency", "32", "--modes", "off,adaptive", "--rounds", "4", "--hf-prompts", "0",
                    "--prompts", "humaneval", "--num-prompts", "2"]) == 0
    assert order == ["off", "adaptive", "adaptive", "off", "off", "adaptive", "adaptive", "off"]
    rows = {line.split("|")[2].strip(): [c.strip() for c in line.strip("|").split("|")]
            for line in capsys.readouterr().out.splitlines() if line.startswith("| 32 |")}
    assert rows["off"][2] == "70.00" and rows["adaptive"][2] == "77.00"  # medians of the waves
    assert rows["adaptive"][3:7] == ["1.10", "1.10", "1.10", "4"]  # median, min, max, rounds >= 0.97
    with pytest.raises(SystemExit, match="must include off"):
        bs.main(["--modes", "on,adaptive", "--rounds", "2", "--hf-prompts", "0", "--prompts", "humaneval"])
