"""`python -m jaxspec.generate`: output format, spec fields, one-line errors."""

from __future__ import annotations

import json
import re

import pytest

from jaxspec.generate import main
from tests.heads_fixtures import (
    add_mtp_layers, write_eagle3_head, write_eagle_head, write_medusa_head, write_mlp_speculator,
)
from tests.reference import hf_greedy

# Fixed draft shapes: these tests check speculation itself, not the adaptive policy's choice.
ENGINE = ["--set", "engine.length_buckets=16,32,64,128", "--max-context", "128", "--quiet", "--adaptive-spec", "off"]


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_jsonl_in_out_matches_hf(tiny_dirs, tmp_path, capsys):
    path, hf = tiny_dirs["llama"]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_ids": [5, 17, 33, 9]}\n\n{"prompt_ids": [200, 3], "max_new_tokens": 5}\n')
    out = tmp_path / "o.jsonl"
    code, _, err = run(capsys, "--model", str(path), "--prompts", str(prompts), "--output", str(out),
                       "--max-new-tokens", "12", "--ignore-eos", *ENGINE)
    assert code == 0, err
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["prompt_ids"] for x in lines] == [[5, 17, 33, 9], [200, 3]]
    assert lines[0]["output_ids"] == hf_greedy(hf, [5, 17, 33, 9], 12)
    assert len(lines[1]["output_ids"]) == 5
    assert set(lines[0]) >= {"prompt_ids", "output_ids", "text", "finish_reason"}
    assert "prompts=2" in err and "decode_tok/s=" in err


def test_spec_cli_adds_accept_lengths_and_tau(tiny_dirs, tmp_path, capsys):
    path, hf = tiny_dirs["llama"]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_ids": [5, 17, 33, 9]}\n')
    out = tmp_path / "o.jsonl"
    code, _, err = run(capsys, "--model", str(path), "--prompts", str(prompts), "--output", str(out),
                       "--max-new-tokens", "16", "--ignore-eos", "--spec", "ngram", "--num-draft-tokens", "6",
                       "--profile-phases", *ENGINE)
    assert code == 0, err
    line = json.loads(out.read_text())
    assert line["output_ids"] == hf_greedy(hf, [5, 17, 33, 9], 16)
    assert sum(line["accept_lengths"]) >= 15 and "exact" not in line
    assert "spec[ngram]: tau=" in err
    assert "time split" in err and "draft=" in err and "verify=" in err


@pytest.mark.parametrize(
    "argv_tail, message",
    [
        (["--model", "/nonexistent/model"], "error: "),
        (["--prompts", "MISSING.jsonl"], "prompts file not found"),
        (["--prompts", "BAD"], ":2: malformed JSON"),
        (["--prompts", "LONG"], "exceeds the context"),
        (["--prompts", "NOKEY"], "expected one of 'messages', 'prompt' or 'prompt_ids'"),
        (["--prompts", "ROLE"], "unknown role"),
        (["--spec", "dflash"], "the shipped dflash head (dflash-smollm2-135m) is for the embedded"),
        (["--spec", "bogus"], "unknown speculative algorithm"),
        (["--spec", "standalone"], "needs a draft model"),
        (["--spec", "standalone", "--draft-layers", "3", "--topk", "2", "--num-steps", "1",
          "--num-draft-tokens", "9"], "num_draft_tokens=9 exceeds"),
        (["--spec", "ngram", "--ngram-min-match", "5", "--ngram-max-match", "2"], "ngram_min_match"),
        (["--page-size", "0"], "page_size must be >= 1"),
    ],
)
def test_bad_input_is_one_line_error(tiny_dirs, tmp_path, capsys, argv_tail, message):
    path, _ = tiny_dirs["llama"]
    files = {
        "BAD": '{"prompt_ids": [1, 2]}\n{"prompt_ids": [1,\n',
        "LONG": json.dumps({"prompt_ids": list(range(1, 120))}) + "\n",
        "NOKEY": '{"text": "hi"}\n',
        "ROLE": '{"messages": [{"role": "wizard", "content": "hi"}]}\n',
    }
    argv = ["--model", str(path), "--prompts", str(tmp_path / "ok.jsonl"), *ENGINE]
    (tmp_path / "ok.jsonl").write_text('{"prompt_ids": [1, 2, 3]}\n')
    for i, a in enumerate(argv_tail):
        if a in files:
            (tmp_path / a).write_text(files[a])
            argv_tail = [*argv_tail[:i], str(tmp_path / a), *argv_tail[i + 1:]]
        elif a == "MISSING.jsonl":
            argv_tail = [*argv_tail[:i], str(tmp_path / a), *argv_tail[i + 1:]]
    code, out, err = run(capsys, *argv, *argv_tail)
    assert code == 2
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert message in lines[0]
    assert "Traceback" not in err


def test_unknown_architecture_is_one_line_error(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    (tmp_path / "p.jsonl").write_text('{"prompt_ids": [1]}\n')
    code, _, err = run(capsys, "--model", str(tmp_path), "--prompts", str(tmp_path / "p.jsonl"), "--quiet")
    assert code == 2 and "unknown architecture" in err and "Traceback" not in err


def test_gpu_check_script_dry_run(capsys):
    """The prepared GPU script runs end to end on CPU (interpret-mode kernels, tiny model)."""
    from jaxspec.bench.gpu import main as gpu_main

    assert gpu_main(["--dry-run", "--skip", "sweep"]) == 0
    out = capsys.readouterr().out
    assert "BAD" not in out and "rejection verify" in out and "plain decode" in out and "| int8 | 1 |" in out


def test_ngram_corpus_flag_is_used_and_output_stays_exact(tiny_dirs, tmp_path, capsys):
    path, hf = tiny_dirs["llama"]
    prompt = [5, 17, 33, 9]
    ref = hf_greedy(hf, prompt, 16)
    corpus = tmp_path / "corpus.jsonl"
    # A corpus that contains the continuation: drafts from it are accepted.
    corpus.write_text(json.dumps({"prompt_ids": prompt, "output_ids": ref}) + "\n")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt_ids": prompt}) + "\n")
    out = tmp_path / "o.jsonl"
    code, _, err = run(capsys, "--model", str(path), "--prompts", str(prompts), "--output", str(out),
                       "--max-new-tokens", "16", "--ignore-eos", "--spec", "ngram", "--num-draft-tokens", "6",
                       "--ngram-corpus", str(corpus), *ENGINE)
    assert code == 0, err
    line = json.loads(out.read_text())
    assert line["output_ids"] == ref
    assert max(line["accept_lengths"]) == 6, "the corpus continuation should be accepted whole"


@pytest.fixture(scope="module")
def head_dirs(tiny_dirs, tmp_path_factory):
    import shutil

    path, hf = tiny_dirs["llama"]
    tmp = tmp_path_factory.mktemp("cli_heads")
    mtp = tmp / "target_mtp"
    shutil.copytree(path, mtp)
    add_mtp_layers(mtp, kind="deepseek")
    return {"eagle": write_eagle_head(tmp / "eagle", hf), "mtp_target": mtp,
            "eagle3": write_eagle3_head(tmp / "eagle3", hf, layer_ids=[0, 1, 2], convention="input"),
            "medusa": write_medusa_head(tmp / "medusa", hf, num_heads=3),
            "mlp_speculator": write_mlp_speculator(tmp / "mlp", hf, n_predict=3)}


@pytest.mark.parametrize("alg, flags", [
    ("eagle3", ["--eagle3-layer-ids", "input"]),
    ("medusa", ["--topk", "2", "--num-steps", "2", "--num-draft-tokens", "5"]),
    ("nextn", []),  # the target's own MTP layer (DeepSeek layout), no --draft-model
    ("mlp_speculator", []),
])
def test_feature_drafter_cli_matches_hf(tiny_dirs, head_dirs, tmp_path, capsys, alg, flags):
    path, hf = tiny_dirs["llama"]
    prompt = [5, 17, 33, 9, 120]
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt_ids": prompt}) + "\n")
    out = tmp_path / "o.jsonl"
    model = head_dirs["mtp_target"] if alg == "nextn" else path
    draft = [] if alg == "nextn" else ["--draft-model", str(head_dirs[alg])]
    code, _, err = run(capsys, "--model", str(model), "--prompts", str(tmp_path / "p.jsonl"), "--output", str(out),
                       "--max-new-tokens", "14", "--ignore-eos", "--spec", alg, *draft, *flags, *ENGINE)
    assert code == 0, err
    line = json.loads(out.read_text())
    assert line["output_ids"] == hf_greedy(hf, prompt, 14)  # the MTP layers leave the target unchanged
    assert sum(line["accept_lengths"]) == 13  # every token after prefill's came from a verify step
    assert f"spec[{alg}]: tau=" in err


@pytest.mark.parametrize("case, message", [
    ("eagle_head", "spec.algorithm='eagle3' drives eagle3 heads, but {eagle} holds a eagle head: use --spec eagle"),
    # --spec eagle3 alone means the head shipped for the embedded model, which a tiny target refuses
    ("no_head", "shipped eagle3 head"),
])
def test_wrong_or_missing_head_is_one_line_error(tiny_dirs, head_dirs, tmp_path, capsys, case, message):
    path, _ = tiny_dirs["llama"]
    (tmp_path / "p.jsonl").write_text('{"prompt_ids": [1, 2, 3]}\n')
    draft = ["--draft-model", str(head_dirs["eagle"])] if case == "eagle_head" else []
    code, _, err = run(capsys, "--model", str(path), "--prompts", str(tmp_path / "p.jsonl"), "--spec", "eagle3",
                       *draft, *ENGINE)
    assert code == 2 and "Traceback" not in err
    lines = [x for x in err.splitlines() if x.strip()]
    message = message.format(eagle=head_dirs["eagle"])
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err
    # Positive control: the same head under its own algorithm runs.
    if case == "eagle_head":
        assert run(capsys, "--model", str(path), "--prompts", str(tmp_path / "p.jsonl"), "--spec", "eagle",
                   *draft, "--max-new-tokens", "4", *ENGINE)[0] == 0


def test_adaptive_policy_runs_and_says_what_each_bucket_ran(tiny_dirs, tmp_path, capsys):
    """--adaptive-spec on: whichever program each batch bucket runs, the tokens are plain greedy's,
    and the summary names the choice."""
    path, hf = tiny_dirs["llama"]
    prompts = [[5, 17, 33, 9, 120] * 3, [7, 8, 9]]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in prompts))
    out = tmp_path / "o.jsonl"
    code, _, err = run(capsys, "--model", str(path), "--prompts", str(tmp_path / "p.jsonl"), "--output", str(out),
                       "--max-new-tokens", "10", "--ignore-eos", "--spec", "ngram", "--batch-size", "1",
                       *ENGINE[:-1], "on")
    assert code == 0, err
    for p, line in zip(prompts, map(json.loads, out.read_text().splitlines())):
        assert line["output_ids"] == hf_greedy(hf, p, 10)
    assert re.search(r"adaptive: batch 1 ctx \d+: (plain|k=1|k=3) x\d", err), err
