"""run/metrics.py: metrics.jsonl and TensorBoard on resume, and who writes them."""
import os
import sys

import pytest

from conftest import _records
from msdist.base.errors import ConfigError
from msdist.run import metrics


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
