"""Prompt input: JSONL files and chat templating, shared by the CLI, benchmarks and server."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class PromptError(ValueError):
    """A malformed prompt or prompt file; the message names the line."""


# One role set for the CLI, benchmarks and server. "developer" is OpenAI's newer
# name for "system"; chat templates only know the latter, so it is renamed.
VALID_ROLES = ("system", "developer", "user", "assistant", "tool")
ROLE_ALIASES = {"developer": "system"}


def check_messages(messages: Any, where: str) -> list[dict]:
    """The messages with aliased roles renamed, or PromptError naming the bad one."""
    if not isinstance(messages, list) or not messages:
        raise PromptError(f"{where}: 'messages' must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise PromptError(f"{where}: messages[{i}] must be an object with a string 'content'")
        if m.get("role") not in VALID_ROLES:
            raise PromptError(f"{where}: messages[{i}] has unknown role {m.get('role')!r}; valid: {VALID_ROLES}")
    return [{**m, "role": ROLE_ALIASES.get(m["role"], m["role"])} for m in messages]


def encode_entry(entry: dict, tokenizer, where: str) -> list[int]:
    """Token ids of one input entry: {"messages"}, {"prompt"} or {"prompt_ids"}."""
    if "prompt_ids" in entry:
        ids = entry["prompt_ids"]
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise PromptError(f"{where}: 'prompt_ids' must be a non-empty list of integers")
        return ids
    if "messages" not in entry and "prompt" not in entry:
        raise PromptError(f"{where}: expected one of 'messages', 'prompt' or 'prompt_ids'")
    if "messages" in entry:
        messages = check_messages(entry["messages"], where)
    elif not isinstance(entry["prompt"], str) or not entry["prompt"]:
        raise PromptError(f"{where}: 'prompt' must be a non-empty string")
    if tokenizer is None:
        raise PromptError(f"{where}: the model has no tokenizer; give 'prompt_ids'")
    if "messages" in entry:
        if not getattr(tokenizer, "chat_template", None):
            raise PromptError(f"{where}: the model has no chat template; give 'prompt' or 'prompt_ids'")
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)
    return tokenizer.encode(entry["prompt"], add_special_tokens=False)


def read_jsonl(path: str | Path) -> list[dict]:
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise PromptError(f"prompts file not found: {path}") from None
    except UnicodeDecodeError:
        raise PromptError(f"{path}: not UTF-8 text") from None
    entries = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as e:
            raise PromptError(f"{path}:{n}: malformed JSON ({e.msg})") from None
        if not isinstance(entry, dict):
            raise PromptError(f"{path}:{n}: each line must be a JSON object")
        entry["_where"] = f"{path}:{n}"
        entries.append(entry)
    if not entries:
        raise PromptError(f"{path}: no prompts")
    return entries
