"""`Watch`: everything one rank's training loop reports to, built once per run."""
from dataclasses import dataclass, field
from typing import Optional, Tuple

from msdist.run.meter import Meter, RankFigures
from msdist.run.metrics import MetricsWriter, open_metrics
from msdist.run.position import Position
from msdist.run.progress import Progress, terminal


@dataclass
class Watch:
    """One rank's reporting: the meter (the one clock), progress lines or bar, every rank's step and
    input-wait figures, and the metrics files (rank 0 only; None elsewhere)."""
    meter: Meter
    progress: Progress
    writer: Optional[MetricsWriter]
    ranks: RankFigures = field(default_factory=RankFigures)
    _window_fields: dict = field(default_factory=dict)   # the last log window's per-rank fields, for its record

    @classmethod
    def open(cls, *, epochs: int, steps_per_epoch: int, global_batch: int, log_every: int, max_steps: int,
             output_dir: str, tensorboard: bool, is_main: bool, world_size: int, launch_kind: str,
             start_step: int) -> "Watch":
        meter = Meter(images_per_step=global_batch)
        progress = Progress(epochs, steps_per_epoch, log_every, meter, max_steps, bar=terminal(is_main, launch_kind))
        return cls(meter, progress, open_metrics(is_main, output_dir, tensorboard, world_size, start_step))

    def start_epoch(self, at: Position) -> None:
        """The epoch's steps begin (after its pipeline was built): the clock and the bar start here."""
        self.progress.start_epoch(at)
        self.meter.start_epoch()

    def close_window(self, local_loss: float, collectives) -> Tuple[float, float, float]:
        """A log step, right after this rank's loss was read from the device (which waited for its queued
        steps): one AllGather, the one the loss needed anyway, carries every rank's loss and window figures.

        Returns:
            (the rank mean loss, this rank's training s per step, its input-wait s per step) over the window.
        """
        self.meter.step_done()
        step_s, data_s = self.meter.take_window()
        rows = collectives.gather([local_loss, step_s, data_s])
        self.meter.charge_compute()
        self._window_fields = self.ranks.add(rows[:, 1], rows[:, 2])
        return float(rows[:, 0].mean()), step_s, data_s

    def record(self, record: Optional[dict]) -> None:
        if self.writer is not None and record is not None:
            if record["kind"] == "step":
                record = {**record, **self._window_fields}
            self.writer.write(record)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
