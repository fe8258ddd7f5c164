"""The campaign's learning curve is read from campaign.json: the head each round started from,
then each round's candidate, with whether it shipped."""

from __future__ import annotations

import json

from jaxspec.train.campaign import FIRST_UNUSED, _state, curve, plot_curve


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
    import jaxspec.train.campaign as c

    c_head = c.HEAD
    try:
        c.HEAD = head
        out = plot_curve(head, tmp_path / "curve.png")
    finally:
        c.HEAD = c_head
    assert out.stat().st_size > 1000
