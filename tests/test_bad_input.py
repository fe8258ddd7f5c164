"""Bad input that used to escape as a traceback, an OOM kill or a silent wrong answer.

CLI cases must end in one `error: ...` line and exit code 2; the server's are in
test_serve_errors.py. Pieces without a model (cache sizing, detokenizing) are
tested directly.
"""

from __future__ import annotations

import json

import pytest

from jaxspec.generate import main

ENGINE = ["--set", "engine.length_buckets=16,32,64,128", "--max-context", "128", "--quiet"]


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def one_line_error(code: int, err: str) -> str:
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@pytest.mark.parametrize(
    "flags, line, message",
    [
        # 9 pages x 1e9 tokens x 512 bytes: terabytes, refused before anything is allocated.
        (["--page-size", "1000000000"], None, "KV cache needs"),
        (["--num-pages", "1"], None, "engine.num_pages must be 0 (automatic) or >= 2"),
        (["--top-k", "3000000000"], None, "sampling.top_k must be in [0, 2^31)"),
        (["--temperature", "inf"], None, "sampling.temperature: expected a finite float"),
        (["--set", "engine.length_buckets="], None, "engine.length_buckets must be a non-empty list"),
        (["--set", "engine.batch_buckets="], None, "engine.batch_buckets must be a non-empty list"),
        (["--profile-phases"], None, "--profile-phases"),
        ([], {"top_k": 1e12}, "top_k must be an integer in [0, 2^31), got 1000000000000.0"),
        ([], {"temperature": float("nan")}, "temperature must be a finite number >= 0, got NaN"),
        ([], {"temperature": float("inf")}, "temperature must be a finite number >= 0, got Infinity"),
        ([], {"top_p": float("-inf")}, "top_p must be a number in (0, 1]"),
        ([], {"max_new_tokens": 2.7}, "max_new_tokens must be an integer >= 1, got 2.7"),
        ([], {"max_new_tokens": True}, "max_new_tokens must be an integer >= 1, got true"),
        ([], {"seed": 2**40}, "seed must be an integer in [0, 2^32)"),
        ([], {"seed": "7"}, "seed must be an integer in [0, 2^32)"),
        # Issue 23: a field ignored silently ran with no word; now an unknown one is refused.
        ([], {"repetition_pen": 1.3}, "p.jsonl:1: unknown field 'repetition_pen'"),
        ([], {"repetition_penalty": 0}, "p.jsonl:1: repetition_penalty must be a number in (0, 100], got 0"),
        ([], {"presence_penalty": 3}, "p.jsonl:1: presence_penalty must be a number in [-2, 2], got 3"),
        ([], {"logit_bias": {"7": 200}}, "p.jsonl:1: logit_bias[7] must be a number in [-100, 100], got 200"),
        ([], {"stop_token_ids": [10**6], "max_new_tokens": 8}, "stop_token_ids: token id 1000000 is outside the vocabulary"),
    ],
)
def test_bad_cli_input_is_one_line_error(tiny_dirs, tmp_path, capsys, flags, line, message):
    path, _ = tiny_dirs["llama"]
    prompts = tmp_path / "p.jsonl"
    # json.dumps writes NaN/Infinity, which json.loads (and so the CLI) accepts.
    prompts.write_text(json.dumps({"prompt_ids": [1, 2, 3], **(line or {})}) + "\n")
    code, _, err = run_cli(capsys, "--model", str(path), "--prompts", str(prompts), *ENGINE, *flags)
    assert message in one_line_error(code, err)
    assert "Traceback" not in err


def test_cache_too_big_error_gives_the_numbers_and_the_settings(tiny_dirs, tmp_path, capsys):
    path, _ = tiny_dirs["llama"]
    (tmp_path / "p.jsonl").write_text('{"prompt_ids": [1, 2, 3]}\n')
    code, _, err = run_cli(capsys, "--model", str(path), "--prompts", str(tmp_path / "p.jsonl"), *ENGINE,
                           "--page-size", "1000000000", "--batch-size", "2")
    msg = one_line_error(code, err)
    # 2 layers x 2 kv heads x 16 dims x k+v x 4 bytes = 512 bytes per token; 2 rows x 1 page + the null page.
    assert "3 pages x 1000000000 tokens" in msg and "512 bytes per token" in msg
    assert "1536.00 GB" in msg and "host memory" in msg and "engine.page_size" in msg


def test_check_cache_fits_against_reported_memory(monkeypatch):
    import jax.numpy as jnp

    from jaxspec.cache import paged

    shape = (2, 10, 16, 2, 16)  # 2 x 10*16*2*2*16 * 4 bytes = 81920 bytes
    monkeypatch.setattr(paged, "device_memory_available", lambda device: 81920)
    paged.check_cache_fits(shape, jnp.float32)  # exactly fits
    with pytest.raises(paged.CacheMemoryError, match=r"draft KV cache needs 0\.09 MB .* 11 pages x 16 tokens"):
        paged.check_cache_fits((2, 11, 16, 2, 16), jnp.float32, what="draft KV cache")
    monkeypatch.setattr(paged, "device_memory_available", lambda device: None)  # unknown: not refused
    paged.check_cache_fits((2, 10**6, 10**6, 2, 16), jnp.float32)


def test_host_memory_available_reads_meminfo():
    from jaxspec.cache.paged import host_memory_available

    with open("/proc/meminfo") as f:
        kb = next(int(x.split()[1]) for x in f if x.startswith("MemAvailable:"))
    assert abs(host_memory_available() - kb * 1024) < 2**30  # it moves a little meanwhile


def test_developer_role_is_the_system_role_in_the_cli(chat_model_dir, tmp_path, capsys):
    """The server accepts OpenAI's "developer" role; the CLI takes the same role set."""
    lines = [{"messages": [{"role": role, "content": "Answer briefly."}, {"role": "user", "content": "Hi"}],
              "max_new_tokens": 2} for role in ("developer", "system")]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "o.jsonl"
    code, _, err = run_cli(capsys, "--model", str(chat_model_dir), "--prompts", str(prompts), "--output", str(out),
                           "--max-context", "256", "--quiet")
    assert code == 0, err
    developer, system = [json.loads(x) for x in out.read_text().splitlines()]
    assert developer["prompt_ids"] == system["prompt_ids"]


def test_unknown_role_lists_the_shared_role_set():
    from jaxspec.prompts import PromptError, VALID_ROLES, check_messages
    from jaxspec.serve.protocol import APIError, parse_chat

    assert "developer" in VALID_ROLES
    with pytest.raises(PromptError, match="developer"):
        check_messages([{"role": "wizard", "content": "x"}], "line 1")
    with pytest.raises(APIError, match="developer"):
        parse_chat({"messages": [{"role": "wizard", "content": "x"}]}, None, 4)


@pytest.fixture(scope="module")
def tokenizer():
    from jaxspec.models.loading import cached_gguf_dir, default_gguf_path, load_tokenizer

    return load_tokenizer(cached_gguf_dir(default_gguf_path(), progress=False))


@pytest.mark.parametrize("text", ["数学", "façade 👍🏽", "🇫🇷🇯🇵"])
def test_length_cut_inside_a_character_sends_no_replacement_char(tokenizer, text):
    from jaxspec.detok import IncrementalDetokenizer

    ids = tokenizer.encode(text, add_special_tokens=False)
    cuts = [k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith("\ufffd")]
    assert cuts, f"{text!r}: no token boundary inside a character; the test needs one"
    for k in cuts:
        detok = IncrementalDetokenizer(tokenizer, [])
        sent = detok.add(ids[: k - 1]) + detok.add(ids[k - 1: k], final=True)  # max_tokens = k
        assert "\ufffd" not in sent
        assert sent == tokenizer.decode(ids[:k]).rstrip("\ufffd")
