"""The parity benchmark end to end on the shipped photos (benchmarks/accuracy_parity.py): real 1- and 2-rank runs
(msdist.launch), paired by what their result.json records, resumed where they stopped."""
import json
import os

import pytest

from conftest import TINY_CONFIG
from benchmarks import accuracy_parity as parity

ARMS = parity.arm_names(2)


def _bench(data_dir, out):
    return parity.main(["--data_dir", data_dir, "--output_dir", str(out), "--config", TINY_CONFIG,
                        "--seeds", "1,2", "--epochs", "1", "--", "--eval_every_epochs", "1"])


def _result(out, arm, seed):
    with open(os.path.join(out, arm.replace(" ", "_").replace(",", ""), f"seed{seed}", "result.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def bench(tmp_path_factory, data_dir):
    out = tmp_path_factory.mktemp("parity")
    return out, _bench(data_dir, out)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_arms_are_paired_and_the_differences_are_the_runs(bench):
    out, summary = bench
    assert summary["unpaired"] == []
    pairing = _result(out, parity.ONE_RANK, 1)["pairing"]
    assert _result(out, "2 ranks", 1)["pairing"] == pairing != _result(out, parity.ONE_RANK, 2)["pairing"]
    for arm in ARMS[1:]:
        row = summary["arms"][arm]
        diffs = [100 * (_result(out, arm, s)["accuracy"] - _result(out, parity.ONE_RANK, s)["accuracy"]) for s in (1, 2)]
        assert row["seeds"] == [1, 2] and row["vs_1_rank"]["mean"] == pytest.approx(sum(diffs) / 2)
    with open(out / "parity.json") as f:
        assert json.load(f)["arms"] == summary["arms"]
    assert "| 2 ranks, sync_bn | 2 |" in (out / "parity.md").read_text()
    # evaluated after every epoch: the one epoch's row is the final evaluation, paired the same way
    [epoch] = summary["by_epoch"]
    assert epoch["epoch"] == 1 and epoch["one_rank_mean"] == pytest.approx(summary["arms"][parity.ONE_RANK]["mean"])
    assert epoch["2 ranks"]["mean"] == pytest.approx(summary["arms"]["2 ranks"]["vs_1_rank"]["mean"])


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_rerun_resumes_only_the_unfinished_run_and_names_an_unpaired_one(bench, data_dir, capfd):
    out, summary = bench
    unfinished = out / "2_ranks" / "seed2" / "result.json"
    unfinished.unlink()  # as if the job died after its last checkpoint
    broken = out / "2_ranks_sync_bn" / "seed1" / "result.json"
    result = json.loads(broken.read_text())
    result["pairing"]["initial_weights"] += 1
    broken.write_text(json.dumps(result))
    capfd.readouterr()
    again = _bench(data_dir, out)
    assert capfd.readouterr().err.count("ran ") == 1  # the other five runs were read, not trained again
    assert "resumed from" in (out / "runs.log").read_text()
    assert unfinished.exists()
    assert again["unpaired"] == ["2 ranks, sync_bn seed 1"]
    assert again["arms"]["2 ranks, sync_bn"]["seeds"] == [2]
    assert again["arms"]["2 ranks"] == summary["arms"]["2 ranks"]
