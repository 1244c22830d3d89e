"""Logging and progress: rank 0 speaks on the console, every rank writes its own log file.

`setup_logging` configures the standard `logging` tree once per process. `Progress` turns step
timings into the fixed step line and the epoch summary; only rank 0 builds one that prints.
"""
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from typing import List, Optional

_logger = logging.getLogger(__name__)
_FORMAT = "%(asctime)s rank{rank} %(levelname)s %(message)s"


def setup_logging(log_dir: str, rank: int, console: bool) -> str:
    """Send msdist's log to `{log_dir}/rank_{rank}.log`, and to stdout on the console rank.

    Returns:
        The log file path.
    """
    os.makedirs(log_dir, exist_ok=True)
    path = os.path.join(log_dir, f"rank_{rank}.log")
    root = logging.getLogger("msdist")
    root.handlers.clear()
    root.setLevel(logging.INFO)
    root.propagate = False
    file_handler = logging.FileHandler(path, encoding="utf-8")
    file_handler.setFormatter(logging.Formatter(_FORMAT.format(rank=rank), "%H:%M:%S"))
    root.addHandler(file_handler)
    if console:
        stream = logging.StreamHandler(sys.stdout)
        stream.setFormatter(logging.Formatter("%(message)s"))
        root.addHandler(stream)
    crash = logging.getLogger("msdist.crash")
    crash.handlers = [file_handler]
    crash.propagate = False
    return path


@dataclass
class StepTimer:
    """Wall-clock bookkeeping of one training run; the first step (graph compile) is kept apart."""
    images_per_step: int
    first_step_s: Optional[float] = None
    steady_s: float = 0.0
    steady_steps: int = 0
    data_s: float = 0.0
    _mark: float = field(default_factory=time.perf_counter)

    def data_ready(self) -> float:
        now = time.perf_counter()
        waited = now - self._mark
        self.data_s += waited
        self._mark = now
        return waited

    def step_done(self) -> float:
        now = time.perf_counter()
        took = now - self._mark
        if self.first_step_s is None:
            self.first_step_s = took
        else:
            self.steady_s += took
            self.steady_steps += 1
        self._mark = now
        return took

    def restart_clock(self) -> None:
        """Call after work that is not training (evaluation, saving, building the next epoch)."""
        self._mark = time.perf_counter()

    def images_per_sec(self) -> float:
        """Whole-job throughput in steady state (compile excluded)."""
        if self.steady_steps:
            return self.steady_steps * self.images_per_step / self.steady_s
        return self.images_per_step / self.first_step_s if self.first_step_s else 0.0


class Progress:
    """Formats the step line `epoch e/E step b/B | loss now (avg) | lr | s/step | img/s | data s`."""

    def __init__(self, epochs: int, steps_per_epoch: int, global_batch: int, log_every: int):
        self.epochs, self.steps_per_epoch = epochs, steps_per_epoch
        self.global_batch, self.log_every = global_batch, log_every
        self._losses: List[float] = []

    def start_epoch(self) -> None:
        self._losses = []

    def step(self, epoch: int, step: int, loss: float, lr: float, step_s: float, data_s: float) -> None:
        self._losses.append(loss)
        if step % self.log_every == 0 or step == self.steps_per_epoch:
            avg = sum(self._losses) / len(self._losses)
            _logger.info("epoch %d/%d step %d/%d | loss %.4f (%.4f) | lr %.6f | %.3f s/step | %.1f img/s | data %.3f s",
                         epoch + 1, self.epochs, step, self.steps_per_epoch, loss, avg, lr, step_s,
                         self.global_batch / step_s if step_s > 0 else 0.0, data_s)

    def epoch_loss(self) -> float:
        return sum(self._losses) / len(self._losses) if self._losses else float("nan")
