"""Rank 0's durable record of a run: `metrics.jsonl` (what `python -m msdist.report` reads), mirrored as
TensorBoard scalars under `{output_dir}/tb` with `--tensorboard true`. `open_metrics` returns None on the
other ranks, so the training loop reads `if writer is not None`.
"""
import json
import os
import time
from typing import Optional

from msdist.base.errors import ConfigError
from msdist.base.files import atomic_write_text

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tb"
# TensorBoard tag of each metrics.jsonl field, per record kind; the x axis is always global_step.
TENSORBOARD_TAGS = {
    "step": {"loss": "train/loss", "lr": "train/lr", "images_per_sec": "train/images_per_sec"},
    "epoch": {"val_loss": "val/loss", "val_accuracy": "val/accuracy"},
}


def _require_tensorboardx():
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        raise ConfigError("--tensorboard true needs the tensorboardX package: pip install 'msdist[tensorboard]' "
                          "(or pip install tensorboardX)") from None
    return SummaryWriter


def _drop_records_after(path: str, global_step: int) -> None:
    """Forget records past `global_step`: a resumed run repeats those steps and writes them again."""
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:
        kept = [line for line in f if line.strip() and json.loads(line).get("global_step", 0) <= global_step]
    atomic_write_text(path, "".join(kept))


class MetricsWriter:
    """Rank 0's record of a run: `metrics.jsonl` always, TensorBoard scalars when asked.

    Each (re)start first drops the records of steps the run is about to repeat and appends a
    `{"kind": "run", ...}` record, so the file reads like one uninterrupted run.

    Args:
        output_dir: the run's output directory.
        tensorboard: also write TensorBoard event files under `{output_dir}/tb`.
        world_size: ranks in this run, recorded for the report.
        start_step: global step the run starts (or resumes) from.
    """

    def __init__(self, output_dir: str, tensorboard: bool, world_size: int, start_step: int = 0):
        self.path = os.path.join(output_dir, METRICS_FILE)
        _drop_records_after(self.path, start_step)
        self._file = open(self.path, "a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            # purge_step hides older events from the first step this run writes on, the TensorBoard twin of
            # the truncation above. Event files are named by the second they were opened in; the suffix keeps
            # a quick restart from overwriting its predecessor's file, and keeps the files in creation order.
            self._tb = _require_tensorboardx()(os.path.join(output_dir, TENSORBOARD_DIR), purge_step=start_step + 1,
                                               flush_secs=10, filename_suffix=f".{time.time_ns()}")
        self.write({"kind": "run", "global_step": start_step, "world_size": world_size,
                    "time": round(time.time(), 3)})

    def write(self, record: dict) -> None:
        """Append one record (flushed at once, so a report of a running job is current)."""
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, tag in TENSORBOARD_TAGS.get(record["kind"], {}).items():
                if key in record:
                    self._tb.add_scalar(tag, record[key], record["global_step"])

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def open_metrics(is_main: bool, output_dir: str, tensorboard: bool, world_size: int,
                 start_step: int = 0) -> Optional[MetricsWriter]:
    """The run's MetricsWriter on rank 0, None elsewhere.

    Every rank checks that tensorboardX is importable, so a missing package stops all ranks alike
    instead of leaving the others waiting for a rank 0 that exited.
    """
    if tensorboard:
        _require_tensorboardx()
    return MetricsWriter(output_dir, tensorboard, world_size, start_step) if is_main else None
