"""The campaign's learning curve is read from campaign.json: the head each round started from,
then each round's candidate, with whether it shipped."""

from __future__ import annotations

import json

from jaxspec.train.campaign import FIRST_UNUSED, _state, curve, heldout_points, init_head, log_trend, plan_round, plot_curve
from jaxspec.train.campaign import eval_set as c_eval_set


def _round(n, start_tokens, tokens, tau_before, tau_after, shipped):
    return {"round": n, "round_tokens": tokens, "tokens_seen": start_tokens + tokens, "shipped": shipped,
            "heldout_last": {"heldout_acc": [0.4, 0.3]},
            "mtbench": {"shipped": {"tau": tau_before}, "candidate": {"tau": tau_after}}}


def test_curve_and_plot(tmp_path):
    head = tmp_path / "head"
    head.mkdir()
    assert _state(head)["next_conversation"] == FIRST_UNUSED and _state(head)["rounds"] == []
    state = {"next_conversation": 4000, "tokens_seen": 1_500_000,
             "rounds": [_round(1, 760_000, 340_000, 1.32, 1.40, True), _round(2, 1_100_000, 400_000, 1.40, 1.38, False)]}
    (head / "campaign.json").write_text(json.dumps(state))
    pts = curve(_state(head))
    assert [(p["tokens"], p["tau"], p["shipped"]) for p in pts] == [
        (760_000, 1.32, True), (1_100_000, 1.40, True), (1_500_000, 1.38, False)]
    # A round on another prompt set: the head it started from appears again, measured on that set.
    state["rounds"].append({**_round(3, 1_500_000, 300_000, 1.45, 1.47, True), "eval_set": c_eval_set(16)})
    (head / "campaign.json").write_text(json.dumps(state))
    pts = curve(_state(head))
    assert [(p["tokens"], p["tau"], p["eval_set"]) for p in pts[2:]] == [
        (1_500_000, 1.38, "MT-Bench writing 10"), (1_500_000, 1.45, c_eval_set(16)), (1_800_000, 1.47, c_eval_set(16))]
    import jaxspec.train.campaign as c

    c_head = c.HEAD
    try:
        c.HEAD = head
        out = plot_curve(head, tmp_path / "curve.png")
    finally:
        c.HEAD = c_head
    assert out.stat().st_size > 1000


def test_log_trend_recovers_a_line_in_log_tokens():
    """A metric that gains exactly 0.025 per doubling from 0.40 at 1M tokens: the fit gives the slope
    and reaches 0.6 at 2^8 M tokens (numpy's polyfit is the reference's arithmetic; the points are
    exact). A falling metric never reaches a higher target (None), and one token count is refused."""
    import pytest

    pts = [(1e6 * 2 ** k, 0.40 + 0.025 * k) for k in (0, 0.5, 1.5, 2, 2.8)]
    trend = log_trend(pts, 0.6)
    assert abs(trend["per_doubling"] - 0.025) < 1e-9 and trend["points"] == 5
    assert abs(trend["tokens_at_target"] / 256e6 - 1) < 1e-6
    assert log_trend([(1e6, 0.5), (2e6, 0.4)], 0.6)["tokens_at_target"] is None
    with pytest.raises(ValueError, match="two token counts"):
        log_trend([(1e6, 0.5), (1e6, 0.6)], 0.6)
    state = {"rounds": [_round(1, 0, 10, 1.0, 1.1, True), {"round": 2, "tokens_seen": 20}]}  # round 2: no held-out
    assert heldout_points(state) == [(10, 0.4)] and heldout_points(state, 1) == [(10, 0.3)]


def test_init_continues_an_unshipped_candidate(tmp_path):
    """A round continues the last candidate only if it was not shipped and its export survives
    (a fresh machine falls back to the shipped head), and counts the tokens that candidate saw."""
    head, work = tmp_path / "head", tmp_path / "work"
    state = {"tokens_seen": 1_500_000, "rounds": [_round(1, 1_100_000, 400_000, 1.40, 1.38, False)]}
    assert init_head("latest", state, head, work) == (head, 1_500_000)  # export gone
    (work / "round1" / "head").mkdir(parents=True)
    (work / "round1" / "head" / "config.json").write_text("{}")
    assert init_head("latest", state, head, work) == (work / "round1" / "head", 1_500_000)
    assert init_head("shipped", state, head, work) == (head, 1_500_000)
    state["rounds"][0]["tokens_seen"] = 1_900_000  # an unshipped candidate: its own count
    assert init_head("latest", state, head, work)[1] == 1_900_000
    state["rounds"][0]["shipped"] = True
    assert init_head("latest", state, head, work) == (head, 1_500_000)
    assert init_head("latest", {"tokens_seen": 7, "rounds": []}, head, work) == (head, 7)


def test_a_frozen_kv_campaign_captures_what_its_recipe_reads():
    """The FROZEN_KV_MTP campaign's data capture the layers its shipped recipe reads, and evaluate runs it
    under its own algorithm; EAGLE-3's stays as it was."""
    from types import SimpleNamespace

    from jaxspec.train.campaign import CAMPAIGNS
    from jaxspec.train.trainer import train_config

    fkv, e3 = CAMPAIGNS["frozen_kv"], CAMPAIGNS["eagle3"]
    cfg = train_config(fkv.config)
    assert cfg.drafter == "frozen_kv" and fkv.algorithm == "frozen_kv_mtp"
    assert fkv.request(SimpleNamespace(num_layers=30)).layers == tuple(cfg.target_kv_layers) == (28, 29)
    assert e3.request(SimpleNamespace(num_layers=30)).layers == (2, 15, 27) and e3.heldout == "heldout"
    assert fkv.heldout != e3.heldout  # their held-out caches capture different layers


def test_a_used_up_train_split_starts_a_regenerated_epoch():
    """Round 14 found the ShareGPT train split used up: the next round wraps to FIRST_UNUSED in epoch 2
    and regenerates only (raw text would repeat); a round near the end is clipped to the split."""
    size = 17_047
    assert plan_round({"next_conversation": 16_624}, 800, 32, size) == {
        "first": 16_624, "raw": 423, "regen": 0, "epoch": 1}
    assert plan_round({"next_conversation": 16_000}, 800, 32, size) == {
        "first": 16_000, "raw": 800, "regen": 32, "epoch": 1}
    wrapped = plan_round({"next_conversation": 17_056}, 800, 384, size)
    assert wrapped == {"first": FIRST_UNUSED, "raw": 0, "regen": 384, "epoch": 2}
    assert plan_round({"next_conversation": FIRST_UNUSED + 384, "epoch": 2}, 800, 384, size) == {
        "first": FIRST_UNUSED + 384, "raw": 0, "regen": 384, "epoch": 2}
    assert plan_round({"next_conversation": size, "epoch": 2}, 0, 10, size)["epoch"] == 3
    # --repeat-raw: a second pass over ShareGPT's own answers, before the round's regenerated turns
    assert plan_round({"next_conversation": 4096, "epoch": 2}, 1000, 128, size, repeat_raw=True) == {
        "first": 4096, "raw": 1000, "regen": 128, "epoch": 2}
