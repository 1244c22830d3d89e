"""The parity benchmark's statistics against values worked out by hand (benchmarks/accuracy_parity.py).

t quantiles from the printed tables: t(0.975, 4) = 2.7764, t(0.95, 4) = 2.1318, t(0.975, 2) = 4.3027.
"""
import json
import math

import pytest

from benchmarks import accuracy_parity as parity


def _result(accuracy, weights=1.0, order="abc", images=400):
    return {"accuracy": accuracy, "num_samples": images, "pairing": {"initial_weights": weights, "sample_order": order}}


def test_paired_difference_matches_the_hand_computed_interval():
    # differences (points): -1, 0, 1, 2, 3 -> mean 1, sd sqrt(2.5), se sqrt(0.5)
    base = [0.50, 0.60, 0.70, 0.80, 0.90]
    arm = [0.49, 0.60, 0.71, 0.82, 0.93]
    out = parity.paired_difference(base, arm, margin=0.5)
    assert out["mean"] == pytest.approx(1.0)
    assert out["sd"] == pytest.approx(math.sqrt(2.5))
    half = 2.7764 * math.sqrt(0.5)
    assert out["ci95"] == pytest.approx([1 - half, 1 + half], abs=1e-3)
    # TOST: the upper test t = (1 - 0.5) / sqrt(0.5) = 0.7071 gives p = P(T4 < 0.7071) ~ 0.741
    assert out["tost_p"] == pytest.approx(0.741, abs=2e-3)
    assert out["verdict"] == "inconclusive"


def test_equivalent_when_the_90_percent_interval_lies_inside_the_margin():
    # differences 0.1, -0.1, 0.0, 0.1, -0.1 points: mean 0, se 0.0447; 90% half-width 2.1318 * 0.0447 = 0.095 < 0.5
    base = [0.5, 0.5, 0.5, 0.5, 0.5]
    arm = [0.501, 0.499, 0.5, 0.501, 0.499]
    out = parity.paired_difference(base, arm, margin=0.5)
    assert out["verdict"] == "equivalent"
    assert out["tost_p"] < 0.05
    # and not with a margin narrower than that half-width
    assert parity.paired_difference(base, arm, margin=0.05)["verdict"] == "inconclusive"


def test_a_gap_beyond_the_margin_is_worse():
    # the three seeds: -1.0, -4.6, -1.6 points
    out = parity.paired_difference([0.593, 0.583, 0.588], [0.583, 0.537, 0.572], margin=0.5)
    assert out["mean"] == pytest.approx(-2.4, abs=1e-9)
    sd = math.sqrt(((1.4) ** 2 + (2.2) ** 2 + (0.8) ** 2) / 2)
    assert out["sd"] == pytest.approx(sd)
    half = 4.3027 * sd / math.sqrt(3)
    assert out["ci95"] == pytest.approx([-2.4 - half, -2.4 + half], abs=1e-3)
    assert out["ci95"][1] > 0 and out["verdict"] == "inconclusive"  # three seeds cannot show it
    out = parity.paired_difference([0.59, 0.58, 0.59, 0.60, 0.58], [0.57, 0.555, 0.565, 0.58, 0.555], margin=0.5)
    assert out["ci95"][1] < 0 and out["verdict"] == "worse"


def test_identical_differences_have_a_point_interval():
    out = parity.paired_difference([0.5, 0.6], [0.5, 0.6], margin=0.5)
    assert out["ci95"] == [0.0, 0.0] and out["verdict"] == "equivalent"
    out = parity.paired_difference([0.5, 0.6], [0.51, 0.61], margin=0.5)
    assert out["verdict"] == "better"


def test_sampling_error_of_the_test_set():
    assert parity.sampling_error(0.9, 400) == pytest.approx(100 * math.sqrt(0.9 * 0.1 / 400))  # 1.5 points


def test_summary_pairs_seeds_and_names_an_unpaired_run():
    results = {parity.ONE_RANK: {1: _result(0.90), 2: _result(0.92), 3: _result(0.94)},
               "2 ranks": {1: _result(0.89), 2: _result(0.90, weights=2.0), 3: _result(0.93)},
               "2 ranks, sync_bn": {1: _result(0.90), 2: _result(0.92, order="xyz")}}
    summary = parity.summarize(results, ranks=2, margin=0.5)
    plain, sync = summary["arms"]["2 ranks"], summary["arms"]["2 ranks, sync_bn"]
    assert plain["seeds"] == [1, 3] and plain["vs_1_rank"]["mean"] == pytest.approx(-1.0)
    assert plain["mean"] == pytest.approx(0.91)  # the unpaired seed 2 left out
    assert sync["seeds"] == [1] and sync["vs_1_rank"]["pairs"] == 1
    assert summary["unpaired"] == ["2 ranks seed 2", "2 ranks, sync_bn seed 2"]
    assert summary["arms"][parity.ONE_RANK]["mean"] == pytest.approx(0.92)
    noise = summary["noise_floor"]
    assert noise["one_rank_spread_points"] == pytest.approx([90.0, 94.0])
    assert noise["one_rank_sd_points"] == pytest.approx(2.0)
    assert noise["sampling_error_points"] == pytest.approx(100 * math.sqrt(0.92 * 0.08 / 400))
    text = parity.table(summary, "setup")
    # seeds 1 and 3 both lost 1 point: a point interval beyond the margin
    assert "| 2 ranks | 2 | 0.9100 | -1.00 | [-1.00, -1.00] | 1.000 | worse |" in text
    assert "not paired with the 1-rank run of their seed: 2 ranks seed 2, 2 ranks, sync_bn seed 2" in text


def test_the_table_says_which_margin_the_spread_could_decide_and_how_many_seeds_the_stated_one_needs():
    # differences -1, 0, 1, 2, 3 points: sd sqrt(2.5), se sqrt(0.5); decidable margin t(0.95, 4) * se = 1.5074
    out = parity.paired_difference([0.50, 0.60, 0.70, 0.80, 0.90], [0.49, 0.60, 0.71, 0.82, 0.93], margin=0.5)
    assert out["decidable_margin"] == pytest.approx(2.1318 * math.sqrt(0.5), abs=1e-3)
    # least n with t(0.95, n-1) * sqrt(2.5) / sqrt(n) < 0.5: n = 29 (t(0.95, 28) = 1.7011 -> 0.4995), n = 28 gives
    # t(0.95, 27) = 1.7033 -> 0.5090
    assert out["seeds_for_margin"] == 29
    assert parity.seeds_for_margin(math.sqrt(2.5), 0.5) == 29
    summary = parity.summarize({parity.ONE_RANK: {s: _result(a) for s, a in enumerate([0.50, 0.60, 0.70, 0.80, 0.90])},
                                "2 ranks": {s: _result(a) for s, a in enumerate([0.49, 0.60, 0.71, 0.82, 0.93])},
                                "2 ranks, sync_bn": {}}, 2, 0.5)
    assert "2 ranks: at this spread (sd 1.58 points over 5 seeds) the narrowest margin TOST could confirm is " \
           "+-1.51 points; +-0.5 needs about 29 paired seeds." in parity.table(summary, "setup")


def test_by_epoch_pairs_each_epoch_and_the_table_shows_where_the_arms_part():
    def run(final, epochs, **pairing):
        return _result(final, **pairing) | {"by_epoch": dict(enumerate(epochs, start=1))}
    # epoch 1: differences -4, -2 points (mean -3, sd sqrt(2), se 1, half-width 12.706); epoch 2: +1, -1 -> mean 0
    results = {parity.ONE_RANK: {1: run(0.8, [0.50, 0.80]), 2: run(0.9, [0.60, 0.90])},
               "2 ranks": {1: run(0.81, [0.46, 0.81]), 2: run(0.89, [0.58, 0.89])},
               "2 ranks, sync_bn": {1: run(0.8, [0.50, 0.80]), 2: run(0.9, [0.55, 0.90], order="xyz")}}
    rows = parity.summarize(results, ranks=2, margin=0.5)["by_epoch"]
    assert [r["epoch"] for r in rows] == [1, 2]
    assert rows[0]["one_rank_mean"] == pytest.approx(0.55)
    first, second = rows[0]["2 ranks"], rows[1]["2 ranks"]
    assert first["mean"] == pytest.approx(-3.0) and first["sd"] == pytest.approx(math.sqrt(2))
    assert first["ci95"] == pytest.approx([-3 - 12.706, -3 + 12.706], abs=1e-2)
    assert second["mean"] == pytest.approx(0.0)
    # the unpaired sync_bn seed 2 is left out epoch by epoch too: one pair, no interval
    assert rows[0]["2 ranks, sync_bn"]["pairs"] == 1 and rows[0]["2 ranks, sync_bn"]["ci95"] is None
    text = parity.table(parity.summarize(results, ranks=2, margin=0.5), "setup")
    assert "| epoch | 1 rank, mean | 2 ranks | 2 ranks, sync_bn |" in text
    assert "| 1 | 0.5500 | -3.00 [-15.71, +9.71] | +0.00 |" in text


def test_epoch_accuracies_read_the_metrics_and_a_resumed_epoch_counts_as_it_ended_last(tmp_path):
    records = [{"kind": "run", "global_step": 0, "world_size": 1},
               {"kind": "epoch", "epoch": 1, "val_accuracy": 0.4},
               {"kind": "epoch", "epoch": 2, "val_accuracy": 0.5},
               # resumed from epoch 1's checkpoint: epoch 2 runs again
               {"kind": "run", "global_step": 10, "world_size": 1},
               {"kind": "epoch", "epoch": 2, "val_accuracy": 0.6},
               {"kind": "epoch", "epoch": 3, "train_loss": 0.5}]  # not evaluated
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert parity.epoch_accuracies(str(tmp_path)) == {1: 0.4, 2: 0.6}
    assert parity.epoch_accuracies(str(tmp_path / "missing")) == {}


def test_the_test_loss_difference_and_its_interval():
    # loss differences +0.1, +0.3 (mean 0.2, sd sqrt(0.02), se 0.1, half-width 12.706 * 0.1)
    results = {parity.ONE_RANK: {1: _result(0.8) | {"loss": 1.0}, 2: _result(0.9) | {"loss": 0.5}},
               "2 ranks": {1: _result(0.8) | {"loss": 1.1}, 2: _result(0.9) | {"loss": 0.8}},
               "2 ranks, sync_bn": {1: _result(0.8) | {"loss": 1.0}}}
    summary = parity.summarize(results, ranks=2, margin=0.5)
    loss = summary["arms"]["2 ranks"]["loss_vs_1_rank"]
    assert loss["mean"] == pytest.approx(0.2) and loss["ci95"] == pytest.approx([0.2 - 1.2706, 0.2 + 1.2706], abs=1e-3)
    assert summary["arms"]["2 ranks, sync_bn"]["loss_vs_1_rank"] is None  # one pair: no interval
    assert "2 ranks: test loss vs 1 rank +0.2000 [-1.0706, +1.4706] (95% CI)." in parity.table(summary, "setup")
    no_loss = {arm: {s: _result(0.8) for s in (1, 2)} for arm in results}
    assert parity.summarize(no_loss, ranks=2, margin=0.5)["arms"]["2 ranks"]["loss_vs_1_rank"] is None
