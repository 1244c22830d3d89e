"""The one meter of a training run: every timing figure is read from the clock readings it takes.

The step line's and the bar's img/s and ETAs (`recent_images_per_sec`, `sec_per_step`), the epoch
summary's (`epoch_seconds`, `epoch_images_per_sec`), result.json's (`images_per_sec`, `first_step_s`)
and every rank's window figures (`take_window`, `RankFigures`) all come from the same readings, one per
event: so no two figures of one step can disagree because two clocks timed it.
"""
import collections
import statistics
import time
from typing import Optional, Sequence, Tuple

_RATE_WINDOW = 20        # steps the recent img/s and the ETAs average over


class Meter:
    """One rank's clock of the training loop; the first step (graph compile) is kept apart.

    Events, in loop order: `start_epoch` (work before it, evaluation, saving, building the pipeline, is not
    training), then per step `data_ready` (the batch arrived) and `step_done`; at a log step
    `take_window` and `charge_compute` around the collective that gathers the window's figures.

    Args:
        images_per_step: images per optimizer step over all ranks (the global batch).
    """

    def __init__(self, images_per_step: int):
        self.images_per_step = images_per_step
        self.first_step_s: Optional[float] = None
        self.steady_s = 0.0          # wall time of the steps after the first, data wait included
        self.steady_steps = 0
        self.data_s = 0.0            # all time spent waiting for batches
        self._mark = time.perf_counter()
        self._window = [0.0, 0.0, 0]  # compute s, data s, steps since take_window
        self._stamps: collections.deque = collections.deque(maxlen=_RATE_WINDOW + 1)  # recent step ends
        self._epoch_start = self.last_step_at = self._mark   # last_step_at: when the newest step ended
        self._epoch_steps = 0

    def start_epoch(self) -> None:
        """The epoch's steps begin now (a resumed epoch's too, part-way through)."""
        now = time.perf_counter()
        self._mark = self._epoch_start = self.last_step_at = now
        self._epoch_steps = 0
        self._stamps.clear()
        self._stamps.append(now)

    def data_ready(self) -> float:
        """The step's batch arrived; returns the seconds waited for it."""
        now = time.perf_counter()
        waited = now - self._mark
        self.data_s += waited
        self._window[1] += waited
        if self.first_step_s is not None:
            self.steady_s += waited  # throughput is wall-clock: a step that waits for its batch is slower
        self._mark = now
        return waited

    def step_done(self, steps: int = 1) -> float:
        """The step was launched (or, at a log step, finished); returns its seconds since `data_ready`.

        `steps` > 1: that many steps ran in the one call (a sunk chunk, run/feed.py). A process's first call is kept
        apart as its first step, compile included, whatever its number of steps.
        """
        now = time.perf_counter()
        took = now - self._mark
        self._window[0] += took
        self._window[2] += steps
        if self.first_step_s is None:
            self.first_step_s = took
            self._stamps.clear()  # the first step of a process includes graph compilation: keep it out of rates
        else:
            self.steady_s += took
            self.steady_steps += steps
        self._stamps.append(now)
        self.last_step_at = now
        self._epoch_steps += steps
        self._mark = now
        return took

    def take_window(self) -> Tuple[float, float]:
        """(compute s, data wait s) per step since the last call; call right after a blocking loss read.

        Steps are launched without waiting for the device, so one step's own time is only its launch;
        the blocking read at a log step waits for the whole backlog. Over the window the sum is exact:
        wall time minus the time spent waiting for batches.
        """
        compute, data, steps = self._window
        self._window = [0.0, 0.0, 0]
        return (compute / steps, data / steps) if steps else (0.0, 0.0)

    def charge_compute(self) -> None:
        """Count the time since the last mark as training of the steps to come (a log step's collective,
        which waits for the slowest rank: not waiting for input)."""
        now = time.perf_counter()
        self._window[0] += now - self._mark
        if self.first_step_s is not None:
            self.steady_s += now - self._mark
        self._mark = now

    def images_per_sec(self) -> float:
        """Whole-run throughput in steady state (result.json): data wait included, first step excluded."""
        if self.steady_steps:
            return self.steady_steps * self.images_per_step / self.steady_s
        return self.images_per_step / self.first_step_s if self.first_step_s else 0.0

    def sec_per_step(self) -> Optional[float]:
        """Mean wall time of the recent steps of this epoch, or None before the first one after compilation."""
        if len(self._stamps) < 2:
            return None
        return (self._stamps[-1] - self._stamps[0]) / (len(self._stamps) - 1)

    def recent_images_per_sec(self) -> float:
        """The step line's and the bar's img/s: over the recent steps, data wait included."""
        rate = self.sec_per_step()
        return self.images_per_step / rate if rate else 0.0

    def epoch_seconds(self) -> float:
        """From the epoch's start to its last step so far."""
        return self.last_step_at - self._epoch_start

    def epoch_images_per_sec(self) -> float:
        """The epoch summary's img/s: the epoch's steps so far over `epoch_seconds` (its first step included)."""
        seconds = self.epoch_seconds()
        return self._epoch_steps * self.images_per_step / seconds if seconds > 0 else 0.0


class RankFigures:
    """Every rank's step time and share of time waiting for input, window by window (each rank's `Meter`).

    The figures travel in the AllGather that a log step already does for the loss, so they cost no
    collective and no host sync of their own; every rank ends up holding every rank's figures.
    """

    def __init__(self):
        self._step_s: list = []    # per window: wall seconds per step (training + input wait), one per rank
        self._data_s: list = []    # per window: input-wait seconds per step, one per rank

    def add(self, step_s: Sequence[float], data_s: Sequence[float]) -> dict:
        """Add one window (a value per rank); returns its metrics.jsonl fields."""
        wall = [s + d for s, d in zip(step_s, data_s)]
        self._step_s.append(wall)
        self._data_s.append(list(data_s))
        return {"rank_step_s": [round(w, 4) for w in wall],
                "rank_input_wait": [round(d / w, 4) if w > 0 else 0.0 for d, w in zip(data_s, wall)]}

    def summary(self) -> dict:
        """result.json's fields: each rank's median step time and input-wait share (over its log windows),
        and the rank that waited most. Empty before the first log step."""
        if not self._step_s:
            return {}
        ranks = []
        for r, walls in enumerate(zip(*self._step_s)):
            waited = sum(window[r] for window in self._data_s)
            ranks.append({"rank": r, "median_step_s": round(statistics.median(walls), 4),
                          "input_wait_share": round(waited / sum(walls), 4) if sum(walls) > 0 else 0.0})
        return {"ranks": ranks, "most_input_wait_rank": max(ranks, key=lambda x: x["input_wait_share"])["rank"]}
