"""`Watch`: everything one rank's training loop reports to, built once per run."""
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from msdist.run import stragglers
from msdist.run.flops import FlopRate
from msdist.run.meter import Meter, RankFigures
from msdist.run.metrics import MetricsWriter, open_metrics
from msdist.run.position import Position
from msdist.run.progress import Progress, terminal


@dataclass
class Watch:
    """One rank's reporting: the meter (the one clock), progress lines or bar, every rank's step and
    input-wait figures, and the metrics files (rank 0 only; None elsewhere). With the straggler watch on
    (run/stragglers.py), every rank measures its core wait and rank 0 names a slow rank."""
    meter: Meter
    progress: Progress
    writer: Optional[MetricsWriter]
    ranks: RankFigures = field(default_factory=RankFigures)
    core_wait: Optional[stragglers.CoreWait] = None
    slow_ranks: Optional[stragglers.StragglerWatch] = None
    _window_fields: dict = field(default_factory=dict)   # the last log window's per-rank fields, for its record
    _named: List[dict] = field(default_factory=list)     # straggler records waiting for their step's record

    @classmethod
    def open(cls, *, epochs: int, steps_per_epoch: int, global_batch: int, log_every: int, max_steps: int,
             output_dir: str, tensorboard: bool, is_main: bool, world_size: int, launch_kind: str,
             start_step: int, collectives, flop_rate: Optional[FlopRate] = None,
             straggler_rule: stragglers.StragglerRule = stragglers.StragglerRule(0.0)) -> "Watch":
        meter = Meter(images_per_step=global_batch)
        progress = Progress(epochs, steps_per_epoch, log_every, meter, max_steps, bar=terminal(is_main, launch_kind),
                            flop_rate=flop_rate)
        measures, watch = stragglers.open_watch(straggler_rule, collectives, world_size, is_main)
        return cls(meter, progress, open_metrics(is_main, output_dir, tensorboard, world_size, start_step),
                   core_wait=stragglers.CoreWait() if measures else None, slow_ranks=watch)

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
        core_wait = [self.core_wait.take()] if self.core_wait is not None else []
        rows = collectives.gather([local_loss, step_s, data_s, *core_wait])
        self.meter.charge_compute()
        self._window_fields = self.ranks.add(rows[:, 1], rows[:, 2])
        if core_wait:
            self._window_fields["rank_core_wait"] = [round(float(c), 4) for c in rows[:, 3]]
        if self.slow_ranks is not None:
            self._observe_ranks()
        return float(rows[:, 0].mean()), step_s, data_s

    def _observe_ranks(self) -> None:
        """Rank 0: the window's slow ranks; those named now are written after the step's record."""
        fields = self._window_fields
        slow, self._named = self.slow_ranks.observe(fields["rank_step_s"], fields["rank_input_wait"],
                                                    fields["rank_core_wait"])
        if slow:
            fields["slow_ranks"] = slow

    def record(self, record: Optional[dict]) -> None:
        if self.writer is not None and record is not None:
            if record["kind"] == "step":
                record = {**record, **self._window_fields}
            self.writer.write(record)
            if record["kind"] == "step":
                for named in self._named:
                    self.writer.write({**named, "global_step": record["global_step"]})
                self._named = []

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
