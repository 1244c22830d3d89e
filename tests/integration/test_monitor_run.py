"""Watching a real run (resnet_tiny, 32x32, synthetic data, 2 epochs): step lines on a pipe, metrics.jsonl,
TensorBoard events, and the report CLI."""
import json
import math
import os
import shutil
import struct
import subprocess
import sys

import pytest

from msdist import report
from msdist.run import metrics
from conftest import REPO, _records


STEPS_PER_EPOCH = 7  # 60 synthetic training images, global batch 8
TB_TAGS = {"train/loss", "train/lr", "train/images_per_sec", "val/loss", "val/accuracy"}


def _env():
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """(output_dir, stdout) of a 2-epoch run that evaluates every epoch and writes TensorBoard events."""
    from msdist.data.synth import synthesize

    root = tmp_path_factory.mktemp("monitor")
    synthesize(str(root / "data"), 3, 20)
    out = root / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "msdist.train", "--config", "configs/tiny_test.yaml", "--data_dir", str(root / "data"),
         "--output_dir", str(out), "--batch_size", "8", "--log_every", "2", "--eval_every_epochs", "1",
         "--tensorboard", "true"],
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return str(out), proc.stdout


# ---------------------------------------------------------------- a real run

@pytest.mark.multiprocess
def test_step_lines_and_epoch_summaries_on_a_pipe(tiny_run):
    _, stdout = tiny_run
    lines = stdout.splitlines()
    steps = [line for line in lines if line.startswith("epoch 1/2 step ")]
    # log_every 2 over 7 steps: steps 2, 4, 6 and the epoch's last step 7.
    assert [line.split("|")[0].strip() for line in steps] == [f"epoch 1/2 step {s}/7" for s in (2, 4, 6, 7)]
    for field in ("loss ", "lr ", "img/s", "%", "eta ", " epoch, ", " run"):
        assert all(field in line for line in steps), field
    assert "\r" not in stdout  # no bar when stdout is not a terminal
    summaries = [line for line in lines if " done | train loss " in line]
    assert len(summaries) == 2 and all("val accuracy" in s and "img/s" in s for s in summaries)
    assert any(line.startswith("input wait rank 0 waited most: ") for line in lines)  # the closing summary


@pytest.mark.multiprocess
def test_metrics_jsonl_has_step_and_epoch_records(tiny_run):
    run_dir, _ = tiny_run
    runs, steps, epochs = (_records(run_dir, k) for k in ("run", "step", "epoch"))
    assert [r["world_size"] for r in runs] == [1]
    assert [r["global_step"] for r in steps] == [2, 4, 6, 7, 9, 11, 13, 14]
    assert all(math.isfinite(r["loss"]) and r["lr"] > 0 and r["images_per_sec"] > 0 for r in steps)
    assert [(e["epoch"], e["global_step"]) for e in epochs] == [(1, 7), (2, 14)]
    assert all(0 <= e["val_accuracy"] <= 1 and math.isfinite(e["train_loss"]) for e in epochs)
    with open(os.path.join(run_dir, "result.json"), encoding="utf-8") as f:
        result = json.load(f)
    assert epochs[-1]["val_accuracy"] == result["accuracy"]  # the last epoch's evaluation is the final one
    # Every rank's step time and input-wait share, per log window and for the run (here the one rank).
    assert all(len(r["rank_step_s"]) == 1 and r["rank_step_s"][0] > 0 and 0 <= r["rank_input_wait"][0] < 1
               for r in steps)
    assert [r["rank"] for r in result["ranks"]] == [0] and result["most_input_wait_rank"] == 0
    assert result["ranks"][0]["median_step_s"] > 0 and 0 <= result["ranks"][0]["input_wait_share"] < 1


@pytest.mark.multiprocess
def test_tensorboard_events_read_back_with_tensorboard(tiny_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, _ = tiny_run
    events = EventAccumulator(os.path.join(run_dir, metrics.TENSORBOARD_DIR))
    events.Reload()
    assert TB_TAGS <= set(events.Tags()["scalars"])
    steps = _records(run_dir, "step")
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == [r["global_step"] for r in steps]
    assert [e.value for e in loss] == pytest.approx([r["loss"] for r in steps], rel=1e-5)
    assert [e.step for e in events.Scalars("val/accuracy")] == [STEPS_PER_EPOCH, 2 * STEPS_PER_EPOCH]
    assert all(0 <= e.value <= 1 for e in events.Scalars("val/accuracy"))
    assert all(e.value > 0 for e in events.Scalars("train/lr") + events.Scalars("train/images_per_sec"))


def _png_size(path):
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", head[16:24])


@pytest.mark.multiprocess
def test_report_cli_for_one_run(tiny_run):
    run_dir, _ = tiny_run
    proc = subprocess.run([sys.executable, "-m", "msdist.report", run_dir], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    width, height = _png_size(os.path.join(run_dir, "report.png"))
    assert width >= 800 and height >= 600
    assert os.path.getsize(os.path.join(run_dir, "report.png")) > 20_000
    assert _png_size(os.path.join(run_dir, report.CLASSES_PNG))[0] >= 800  # confusion matrix + per-class accuracy
    with open(os.path.join(run_dir, "result.json"), encoding="utf-8") as f:
        accuracy = json.load(f)["accuracy"]
    row = next(line for line in proc.stdout.splitlines() if line.startswith("run (1p) "))
    assert f"{accuracy:.4f}" in row and "best acc (epoch)" in proc.stdout and "final acc" in proc.stdout
    assert "model=resnet_tiny" in proc.stdout


@pytest.mark.multiprocess
def test_report_overlays_two_runs(tiny_run, tmp_path, capsys):
    run_dir, _ = tiny_run
    other = tmp_path / "other"
    shutil.copytree(run_dir, other)
    with open(other / "config.yaml", "a", encoding="utf-8") as f:
        f.write("sync_bn: true\n")  # a config difference the summary must surface
    out = tmp_path / "compare.png"
    assert report.main([run_dir, str(other), "--out", str(out), "--label", "first", "--label", "second"]) == 0
    text = capsys.readouterr().out
    assert _png_size(out)[0] >= 800
    assert "first (1p)" in text and "second (1p)" in text and "sync_bn=True" in text
    assert sum(line.startswith(("first (1p) ", "second (1p) ")) for line in text.splitlines()) == 2


@pytest.mark.multiprocess
def test_report_without_metrics_is_a_one_line_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "msdist.report", str(tmp_path)], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "msdist: error:" in proc.stderr and "metrics.jsonl" in proc.stderr
