"""run/progress.py: step lines and the progress bar (with run/logs.py's console), the epoch loss."""
import io
import logging
import sys

import pytest

from msdist.run import logs, meter, progress
from msdist.run.position import Position


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


def test_epoch_loss_weights_each_window_by_its_steps():
    shown = progress.Progress(epochs=1, steps_per_epoch=4, log_every=3, meter=meter.Meter(images_per_step=8))
    shown.start_epoch(Position())
    for step, loss in ((1, None), (2, None), (3, 2.0), (4, 6.0)):  # read at step 3 (log) and 4 (epoch end)
        shown.step(Position(1, step, step), loss, 0.1, 0.01, 0.0)
    assert shown.epoch_loss() == (3 * 2.0 + 6.0) / 4
