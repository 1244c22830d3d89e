"""Watching a run, in this process: step lines and the progress bar, metrics.jsonl and TensorBoard on resume,
the one meter, the result file (msdist.run's logs, meter, progress, metrics and result modules)."""
import io
import json
import logging
import os
import sys

import pytest

from msdist.base.errors import ConfigError
from msdist.run import logs, meter, metrics, progress, result
from msdist.run.position import Position
from conftest import _records


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def _steps(shown, losses, epoch=0):
    """Run `losses` as the steps of an epoch through the meter and the Progress `shown`; their metrics records."""
    spe = shown.steps_per_epoch
    shown.start_epoch(Position.at(epoch * spe, spe))
    shown.meter.start_epoch()
    records = []
    for i, loss in enumerate(losses, 1):
        shown.meter.data_ready()
        shown.meter.step_done()
        records.append(shown.step(Position.at(epoch * spe + i, spe), loss, 0.1, 0.01, 0.0))
    return records


def _end(shown, losses):
    return shown.end_epoch(sum(losses) / len(losses), {"accuracy": 0.75, "loss": 0.5})


def test_progress_bar_on_a_terminal(tmp_path, capsys):
    log_path = logs.setup_logging(str(tmp_path), 0, console=True)
    term = FakeTerminal()
    shown = progress.Progress(epochs=2, steps_per_epoch=4, log_every=2, meter=meter.Meter(images_per_step=8), bar=term)
    records = _steps(shown, [1.0, 0.8, 0.6, 0.4])
    drawn = term.getvalue()
    # tqdm's bar; its line ends with the epoch's last step, before the save and evaluation messages
    assert drawn.startswith("\r") and drawn.endswith("\n")
    summary = _end(shown, [1.0, 0.8, 0.6, 0.4])
    assert term.getvalue() == drawn
    last = drawn.rstrip("\n").split("\r")[-1]
    assert last.startswith("epoch 1/2 100%|" + "#" * 24 + "| 4/4, loss 0.4000 | lr 1.00e-01 | ")
    # the bar shows the meter's figures, not tqdm's own clock
    assert "img/s | eta " in last and " epoch, " in last and last.rstrip().endswith(" run") and "it/s" not in last
    console = capsys.readouterr().out
    assert "step 2/4" not in console  # the bar owns the terminal: step lines go to the log file only
    assert "epoch 1/2 done | train loss 0.7000 | val accuracy 0.7500 loss 0.5000" in console
    logging.getLogger("msdist").handlers[0].flush()
    with open(log_path, encoding="utf-8") as f:
        assert "epoch 1/2 step 2/4 | loss 0.8000 (0.9000)" in f.read()
    assert [r["step"] for r in records if r] == [2, 4]
    assert summary["train_loss"] == pytest.approx(0.7) and summary["val_accuracy"] == 0.75


def test_step_lines_without_a_terminal(tmp_path, capsys):
    logs.setup_logging(str(tmp_path), 0, console=True)
    shown = progress.Progress(epochs=1, steps_per_epoch=5, log_every=2, meter=meter.Meter(images_per_step=8),
                              max_steps=3)
    assert shown.total_steps == 3
    records = _steps(shown, [1.0, 0.5, 0.25])
    lines = [line for line in capsys.readouterr().out.splitlines() if " step " in line]
    # every log_every steps, and at the last step of a run cut short by max_steps
    assert [line.split(" | ")[0] for line in lines] == ["epoch 1/1 step 2/5", "epoch 1/1 step 3/5"]
    assert lines[-1].split(" | ")[6].strip() == "60%"
    assert [r["global_step"] for r in records if r] == [2, 3]


def test_bar_only_for_rank_0_at_a_real_terminal(monkeypatch):
    term = FakeTerminal()
    monkeypatch.setattr(sys, "stdout", term)
    assert progress.terminal(True, "standalone") is term and progress.terminal(True, "cluster") is term
    assert progress.terminal(False, "standalone") is None
    assert progress.terminal(True, "mpirun") is None  # OpenMPI hands ranks a pty whatever mpirun's output is
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    assert progress.terminal(True, "standalone") is None


def test_duration_formatting():
    assert progress.format_duration(3725) == "1:02:05"
    assert progress.format_duration(59.6) == "0:01:00"
    assert progress.format_duration(None) == "?"


def test_resume_drops_repeated_records_and_tensorboard_steps(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def write_steps(writer, steps):
        for step in steps:
            writer.write({"kind": "step", "global_step": step, "loss": float(step), "lr": 0.1,
                          "images_per_sec": 1.0})

    first = metrics.MetricsWriter(str(tmp_path), tensorboard=True, world_size=2)
    write_steps(first, range(1, 7))  # then the job dies; its last checkpoint was at step 3
    first.close()
    resumed = metrics.open_metrics(True, str(tmp_path), tensorboard=True, world_size=2, start_step=3)
    write_steps(resumed, range(4, 9))
    resumed.close()
    assert [r["global_step"] for r in _records(tmp_path, "step")] == list(range(1, 9))
    assert [r["global_step"] for r in _records(tmp_path, "run")] == [0, 3]
    events = EventAccumulator(str(tmp_path / metrics.TENSORBOARD_DIR))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, 9))


def test_only_rank_0_writes_but_every_rank_checks_tensorboardx(tmp_path, monkeypatch):
    assert metrics.open_metrics(False, str(tmp_path), tensorboard=False, world_size=2) is None
    assert not os.path.exists(tmp_path / metrics.METRICS_FILE)
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # as if it were not installed
    with pytest.raises(ConfigError, match="msdist\\[tensorboard\\]"):
        metrics.open_metrics(False, str(tmp_path), tensorboard=True, world_size=2)


def test_one_meter_counts_data_wait_but_not_the_compile_step(monkeypatch):
    clock = iter([0.0,            # the meter is made
                  0.0,            # epoch start
                  1.0, 11.0,      # first batch after 1 s, first step (compile) 10 s
                  12.0, 14.0,     # 1 s waiting for data, 2 s compute
                  15.0, 17.0])
    monkeypatch.setattr(meter.time, "perf_counter", lambda: next(clock))
    timer = meter.Meter(images_per_step=6)
    timer.start_epoch()
    for _ in range(3):
        timer.data_ready()
        timer.step_done()
    assert timer.first_step_s == 10.0 and timer.data_s == 3.0
    assert timer.images_per_sec() == pytest.approx(2 * 6 / 6.0)   # result.json: 2 steady steps in 6 s of wall time
    # The step line's rate reads the same clock readings: the 2 steps after the compile step, 6 s apart.
    assert timer.sec_per_step() == pytest.approx(3.0) and timer.recent_images_per_sec() == pytest.approx(2.0)
    assert timer.epoch_seconds() == 17.0 and timer.epoch_images_per_sec() == pytest.approx(3 * 6 / 17.0)


def test_the_result_file_is_replaced_whole_never_rewritten_in_place(tmp_path, capsys):
    """A reader (the report, a launcher script) that opened result.json before the write still reads a whole
    file: the new one arrives by rename, so the old one is never truncated under it."""
    path = tmp_path / "result.json"
    path.write_text('{"accuracy": 0.25}')
    with open(path, encoding="utf-8") as reader:
        result.write_result(str(path), {"accuracy": 0.5, "correct": 1, "num_samples": 2, "loss": 0.7, "world_size": 1},
                            "msdist.train done", [], wall_seconds=3.0)
        assert json.load(reader) == {"accuracy": 0.25}
    assert json.loads(path.read_text())["accuracy"] == 0.5 and os.listdir(tmp_path) == ["result.json"]
    assert "== msdist.train done ==" in capsys.readouterr().out
