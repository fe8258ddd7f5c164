"""`python -m jaxspec.bench ablate`: grids, the runner on a tiny random model, its files.

The grid runs once per module (interrupted mid-point, then resumed); the tests read its files:
the cross product and exclusions, resume, the CSV / JSON schema, the plots, the invalid points
(an unimplemented drafter, a missing head directory, the shipped head when absent, greedy
verify at temperature 1), and determinism (a row cut off and rerun gives the same tokens).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from jaxspec.bench.ablate_grid import GridError, expand, parse_grid, plan
from tests.conftest import make_tiny_hf
from tests.heads_fixtures import write_medusa_head

GRID = """
name = "tiny"
num_prompts = 2
max_new_tokens = 8
seed = 5
time_split = false

[axes]
prompt_set = ["jsonl:prompts.jsonl"]
drafter = [
  { name = "ngram", algorithm = "ngram" },
  { name = "medusa", algorithm = "medusa", draft_model = "{medusa}" },
  { name = "dflash", algorithm = "dflash" },
  { name = "medusa missing", algorithm = "medusa", draft_model = "{missing}" },
]
shape = [
  { name = "chain 4", topk = 1, num_steps = 3, num_draft_tokens = 4 },
  { name = "tree 6", topk = 2, num_steps = 2, num_draft_tokens = 6, time_split = true },
]
temperature = [0.0, 1.0]

[[exclude]]
shape = "tree 6"
temperature = 1.0

[[exclude]]
drafter = ["medusa", "medusa missing", "dflash"]
shape = "tree 6"

[ceiling]
num_steps = 3
num_draft_tokens = 4
accept_lengths = [3]
"""

PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 12, 9, 10, 11, 12, 9]]


class Stop(Exception):
    pass


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from jaxspec.bench.ablate import run_grid
    from jaxspec.bench.ablate_report import write_report
    from jaxspec.models.loading import load_model

    tmp = tmp_path_factory.mktemp("ablate")
    hf = make_tiny_hf("llama")
    hf.save_pretrained(tmp / "target")
    medusa = write_medusa_head(tmp / "medusa", hf, num_heads=3)
    (tmp / "prompts.jsonl").write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in PROMPTS))
    (tmp / "grid.toml").write_text(GRID.replace("{medusa}", str(medusa)).replace("{missing}", str(tmp / "nope")))
    grid = parse_grid((tmp / "grid.toml").read_text(), str(tmp / "grid.toml"))
    model = load_model(str(tmp / "target"), progress=False)
    out = tmp / "out"
    seen = []

    def interrupt(rows):
        seen.extend(rows)
        if len(seen) >= 7:  # inside the sampled n-gram chain point: its first prompt written, the second not
            raise Stop

    run = dict(model=model, progress=False, max_context=128)
    with pytest.raises(Stop):
        run_grid(grid, out, on_rows=interrupt, **run)
    first = [json.loads(x) for x in (out / "rows.jsonl").read_text().splitlines()]
    resumed = []
    res = run_grid(grid, out, on_rows=resumed.extend, **run)
    files = write_report(grid, res, out)
    return dict(grid=grid, out=out, first=first, resumed=resumed, res=res, files=files, run=run)


def test_cross_product_and_exclusions():
    grid = parse_grid(GRID)
    points, excluded = expand(grid)
    # 4 drafters x 2 shapes x 2 temperatures = 16; rule 1 drops the 4 sampled trees, rule 2 the
    # 3 greedy non-ngram trees.
    assert excluded == 7 and len(points) == 9
    methods = [p.method for p in points]
    assert methods[:3] == ["ngram, chain 4, 0.0", "ngram, chain 4, 1.0", "ngram, tree 6, 0.0"]
    assert all("tree 6" not in m or m.startswith("ngram") for m in methods)
    assert not any("tree 6, 1.0" in m for m in methods)
    # Keys merge in axis order: the shape's keys reach the point's spec, the temperature its run.
    tree = points[2]
    assert tree.spec == dict(algorithm="ngram", topk=2, num_steps=2, num_draft_tokens=6)
    assert tree.run["temperature"] == 0.0 and tree.run["seed"] == 5 and tree.run["batch_size"] == 1
    # The plan adds one plain baseline per (prompt set, batch, sampling) and the ceiling point.
    full, _ = plan(grid)
    kinds = [p.kind for p in full]
    assert kinds == ["baseline"] * 2 + ["point"] * 9 + ["ceiling"]
    assert full[-1].spec["simulate_accept_length"] == 3
    # Ids hash the whole config: another token count is another point, the same grid the same ids.
    assert points[0].point_id(grid) == expand(parse_grid(GRID))[0][0].point_id(grid)
    assert points[0].point_id(grid) != points[0].point_id(grid.shrink(max_new_tokens=4))


@pytest.mark.parametrize("text, msg", [
    ("[axes]\ndrafter = [{ name = 'x', algoritm = 'ngram' }]", "unknown key 'algoritm'"),
    ("[axes]\ndrafter = ['ngram']", "axis 'drafter' is not a point key"),
    ("[axes]\ntemperature = [0.0]\n[[exclude]]\nshape = 'tree'", "no axis 'shape'"),
    ("[axes]\ntemperature = [0.0]\n[[exclude]]\ntemperature = 2.0", "no level 2.0"),
    ("num_prompts = 0", "num_prompts must be >= 1"),
    ("nmu_prompts = 3", "unknown top-level key 'nmu_prompts'"),
    ("[ceiling]\naccept_lengths = []", "ceiling.accept_lengths"),
    ("[axes\n", "not valid TOML"),
])
def test_bad_grids_name_the_problem(text, msg):
    with pytest.raises(GridError, match=msg):
        parse_grid(text, "g.toml")
    assert parse_grid("[axes]\ntemperature = [0.0, 1]\n[[exclude]]\ntemperature = 1.0")  # positive control


def test_resume_reruns_nothing_already_written(world):
    first, resumed, rows = world["first"], world["resumed"], world["res"]["rows"]
    assert len(first) == 7
    keys = [(r["point_id"], r["prompt_index"]) for r in rows]
    assert len(keys) == len(set(keys))  # no row twice
    # Every valid point has both prompts: 2 baselines, 3 ngram, 2 medusa, 1 ceiling -> 8 points, 16 rows.
    assert len(rows) == 16 and len({k[0] for k in keys}) == 8
    assert {(r["point_id"], r["prompt_index"]) for r in resumed}.isdisjoint({(r["point_id"], r["prompt_index"])
                                                                            for r in first})
    assert len(resumed) == 16 - 7


def test_rows_schema_and_metrics(world):
    rows = world["res"]["rows"]
    ngram = [r for r in rows if r["method"] == "ngram, tree 6, 0.0"]
    for r in ngram:
        lens = r["accept_lengths"]
        # The first token comes from prefill; the last step may commit past max_new_tokens.
        assert r["tau"] == pytest.approx(sum(lens) / len(lens)) and sum(lens) >= r["new_tokens"] - 1 == 7
        d = len(r["cond_acceptance"])
        # Conditional acceptance at depth 1 from the accept lengths directly.
        assert r["cond_acceptance"][0] == pytest.approx(sum(x >= 2 for x in lens) / len(lens))
        # An n-gram tree of 6 nodes may be one path of 5 drafts: its plan's max depth.
        assert d == 5 and r["config"]["spec"]["num_draft_tokens"] == 6 and r["config"]["max_new_tokens"] == 8
        assert r["speedup"] == pytest.approx(r["tok_s"] / r["baseline_tok_s"])
        assert set(r["time_split"]) == {"draft", "verify", "other"}
        assert sum(r["time_split"].values()) == pytest.approx(1.0)
    assert all(r["time_split"] is None for r in rows if r["method"] != "ngram, tree 6, 0.0")  # off elsewhere
    sampled = [r for r in rows if r["temperature"] == 1.0 and r["kind"] == "point"]
    assert sampled and [r["seed"] for r in sampled] == [5, 6] * (len(sampled) // 2)
    ceiling = [r for r in rows if r["kind"] == "ceiling"]
    # Forced acceptance of 2 drafts: 3 tokens per verify step.
    assert ceiling and all(r["accept_lengths"] == [3, 3, 3] and r["tau"] == 3.0 for r in ceiling)
    with open(world["out"] / "rows.csv") as f:
        table = list(csv.DictReader(f))
    assert len(table) == len(rows)
    assert {"point_id", "method", "tau", "tok_s", "speedup", "seed", "accept_hist", "draft_frac",
            "accept_pos_1"} <= set(table[0])
    by_id = {(r["point_id"], str(r["prompt_index"])): r for r in rows}
    for t in table:
        assert float(t["tau"]) == pytest.approx(by_id[(t["point_id"], t["prompt_index"])]["tau"])


def test_invalid_points_are_reported_with_the_reason(world):
    invalid = {(r["method"]): r["reason"] for r in world["res"]["invalid"]}
    # No shipped DFLASH drafter fits the tiny target: the loader's message, not a crash.
    assert "does not fit this target" in invalid["dflash, chain 4, 0.0"]
    assert "nope" in invalid["medusa missing, chain 4, 0.0"]
    assert set(invalid) == {"dflash, chain 4, 0.0", "dflash, chain 4, 1.0", "medusa missing, chain 4, 0.0",
                            "medusa missing, chain 4, 1.0"}
    on_disk = [json.loads(x) for x in (world["out"] / "invalid.jsonl").read_text().splitlines()]
    assert len(on_disk) == 4 and all(r["config"]["spec"]["algorithm"] for r in on_disk)
    md = (world["out"] / "summary.md").read_text()
    assert "## Invalid points" in md and "nope" in md and "| ngram, tree 6, 0.0 |" in md


def test_plots_written(world):
    names = {p.name for p in world["files"]}
    for plot in ("acceptance_by_position", "tau_vs_budget", "speedup_vs_batch", "tau_by_prompt_set",
                 "ceiling_vs_measured"):
        assert {f"{plot}.png", f"{plot}.svg"} <= names
        png = world["out"] / "plots" / f"{plot}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
        svg = (world["out"] / "plots" / f"{plot}.svg").read_text()
        assert "<svg" in svg


def test_a_cut_off_row_is_rerun_and_gives_the_same_tokens(world, tmp_path):
    """Determinism, and a half-written last line (a kill mid-write) dropped on resume."""
    from jaxspec.bench.ablate import run_grid

    out = world["out"]
    lines = (out / "rows.jsonl").read_text().splitlines(keepends=True)
    sampled = next(i for i, x in enumerate(lines) if json.loads(x)["method"] == "medusa, chain 4, 1.0")
    removed = json.loads(lines[sampled])
    kept = lines[:sampled] + lines[sampled + 1:]
    (out / "rows.jsonl").write_text("".join(kept[:-1]) + kept[-1][: len(kept[-1]) // 2])  # last row cut in half
    again = []
    run_grid(world["grid"], out, on_rows=again.extend, **world["run"])
    redo = [r for r in again if r["point_id"] == removed["point_id"]]
    assert len(redo) == 1 and redo[0]["accept_lengths"] == removed["accept_lengths"]
    assert redo[0]["seed"] == removed["seed"]
    rows = [json.loads(x) for x in (out / "rows.jsonl").read_text().splitlines()]
    assert len(rows) == 16 and len({(r["point_id"], r["prompt_index"]) for r in rows}) == 16


def test_shipped_grids_parse():
    for path in sorted(Path("configs/ablations").glob("*.toml")):
        grid = parse_grid(path.read_text(), str(path))
        points, _ = expand(grid)
        assert points, path
