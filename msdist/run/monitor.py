"""Watching a run: per-rank logs, the progress bar or step lines, metrics.jsonl and TensorBoard.

* `setup_logging` configures the standard `logging` tree once per process: every rank writes its
  own log file, rank 0 also speaks on stdout.
* `Progress` turns step timings into the fixed step line (every `log_every` steps, into each rank's
  log) and, on rank 0 at an interactive terminal, a live progress bar; it also writes the epoch
  summary. It formats only: averaging over ranks stays with the caller, who owns the collectives.
* `MetricsWriter` is rank 0's durable record: one JSON object per logged step and per epoch in
  `{output_dir}/metrics.jsonl` (what `python -m msdist.report` reads), mirrored as TensorBoard
  scalars under `{output_dir}/tb` with `--tensorboard true`. `open_metrics` returns None on the
  other ranks, so the training loop reads `if writer is not None`.
"""
import collections
import json
import logging
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence, TextIO, Tuple

from msdist.base.errors import ConfigError
from msdist.base.files import atomic_write_text
from msdist.run.position import Position

_logger = logging.getLogger(__name__)
_FORMAT = "%(asctime)s rank{rank} %(levelname)s %(message)s"

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tb"
# TensorBoard tag of each metrics.jsonl field, per record kind; the x axis is always global_step.
TENSORBOARD_TAGS = {
    "step": {"loss": "train/loss", "lr": "train/lr", "images_per_sec": "train/images_per_sec"},
    "epoch": {"val_loss": "val/loss", "val_accuracy": "val/accuracy"},
}
_RATE_WINDOW = 20        # steps the live img/s and the ETAs average over
_BAR_WIDTH = 24
_BAR_REDRAW_S = 0.2      # a terminal redrawn at every step of a fast model costs more than it shows


def _console_wanted(record: logging.LogRecord) -> bool:
    # Step lines pass `extra={"console": False}` while the progress bar owns the terminal.
    return getattr(record, "console", True)


def log_path(log_dir: str, rank: int, name: str = "rank") -> str:
    """This rank's log file: `{log_dir}/{name}_{rank}.log`."""
    return os.path.join(log_dir, f"{name}_{rank}.log")


def setup_logging(log_dir: str, rank: int, console: bool, name: str = "rank") -> str:
    """Send msdist's log to `{log_dir}/{name}_{rank}.log`, and to stdout on the console rank.

    Returns:
        The log file path.
    """
    os.makedirs(log_dir, exist_ok=True)
    path = log_path(log_dir, rank, name)
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
        stream.addFilter(_console_wanted)
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
    _window: list = field(default_factory=lambda: [0.0, 0.0, 0])  # compute s, data s, steps since take_window

    def take_window(self) -> Tuple[float, float]:
        """(compute s, data wait s) per step since the last call; call right after a blocking loss read.

        Steps are launched without waiting for the device, so one step's own time is only its launch;
        the blocking read at a log step waits for the whole backlog. Over the window the sum is exact:
        wall time minus the time spent waiting for batches.
        """
        compute, data, steps = self._window
        self._window = [0.0, 0.0, 0]
        return (compute / steps, data / steps) if steps else (0.0, 0.0)

    def data_ready(self) -> float:
        now = time.perf_counter()
        waited = now - self._mark
        self.data_s += waited
        self._window[1] += waited
        if self.first_step_s is not None:
            self.steady_s += waited  # throughput is wall-clock: a step that waits for its batch is slower
        self._mark = now
        return waited

    def step_done(self) -> float:
        now = time.perf_counter()
        took = now - self._mark
        self._window[0] += took
        self._window[2] += 1
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

    def charge_compute(self) -> None:
        """Count the time since the last mark as training of the steps to come (a log step's collective,
        which waits for the slowest rank: not waiting for input)."""
        now = time.perf_counter()
        self._window[0] += now - self._mark
        if self.first_step_s is not None:
            self.steady_s += now - self._mark
        self._mark = now

    def images_per_sec(self) -> float:
        """Whole-job throughput in steady state: data wait included, first step (graph compile) excluded."""
        if self.steady_steps:
            return self.steady_steps * self.images_per_step / self.steady_s
        return self.images_per_step / self.first_step_s if self.first_step_s else 0.0


def terminal(is_main: bool, launch_kind: str) -> Optional[TextIO]:
    """stdout when this rank speaks to an interactive terminal (the progress bar goes there), else None.

    Args:
        is_main: whether this rank speaks on the console at all.
        launch_kind: `cluster.LaunchEnv.kind`. Under "mpirun" isatty() proves nothing: OpenMPI gives
            every rank a pseudo-terminal even when mpirun's own output goes to a file or a pipe.
    """
    if not is_main or launch_kind == "mpirun" or not sys.stdout.isatty():
        return None
    return sys.stdout


def format_duration(seconds: Optional[float]) -> str:
    """`H:MM:SS`, or `?` while there is nothing to estimate from."""
    if seconds is None or seconds != seconds or seconds == float("inf"):
        return "?"
    whole = int(round(seconds))
    return f"{whole // 3600}:{whole % 3600 // 60:02d}:{whole % 60:02d}"


def render_bar(fraction: float, width: int = _BAR_WIDTH) -> str:
    """`[#########.......]`, `fraction` clipped to 0..1."""
    done = int(round(width * min(max(fraction, 0.0), 1.0)))
    return "[" + "#" * done + "." * (width - done) + "]"


class Progress:
    """Step lines, the live bar and the epoch summary of one training run.

    Every `log_every` steps (and at the end of an epoch or of the run) the step line
    `epoch e/E step b/B | loss now (avg) | lr | s/step | img/s | data s | pct | eta` goes to the
    log: the rank's file always, the console too unless a bar is drawn. img/s and the ETAs use the
    wall time of the last steps, data loading included.

    Args:
        epochs: epochs of the whole run.
        steps_per_epoch: optimizer steps in one epoch.
        global_batch: images per optimizer step over all ranks.
        log_every: steps between step lines.
        max_steps: the run stops after this many steps in total; 0 = no limit.
        bar: stream for the live progress bar (see `terminal`), or None for step lines only.
    """

    def __init__(self, epochs: int, steps_per_epoch: int, global_batch: int, log_every: int,
                 max_steps: int = 0, bar: Optional[TextIO] = None):
        self.epochs, self.steps_per_epoch = epochs, steps_per_epoch
        self.global_batch, self.log_every = global_batch, log_every
        full = epochs * steps_per_epoch
        self.total_steps = min(full, max_steps) if max_steps else full
        self.bar = bar
        self.epoch = 0
        self._loss_sum, self._loss_steps, self._loss_mark = 0.0, 0, 0
        self._last_loss = float("nan")
        self._first_step = 0
        self._step = self._global_step = 0
        self._epoch_start = self._last_step_time = time.perf_counter()
        self._stamps: collections.deque = collections.deque(maxlen=_RATE_WINDOW + 1)
        self._compiled = False
        self._last_draw = 0.0
        self._drawn_width = 0

    def start_epoch(self, at: Position) -> None:
        """Begin the epoch of the step after `at`, part-way through it when a resumed run skips steps already done."""
        self.epoch = at.next_epoch_number(self.steps_per_epoch)
        first_step = self._first_step = at.skip(self.steps_per_epoch)
        self._step = first_step
        self._loss_sum, self._loss_steps, self._loss_mark = 0.0, 0, first_step
        self._epoch_start = self._last_step_time = time.perf_counter()
        self._stamps.clear()
        self._stamps.append(self._epoch_start)

    def is_log_step(self, at: Position) -> bool:
        """True where a step line and a metrics record are due after the step to `at` (the caller averages the
        loss there)."""
        return at.step % self.log_every == 0 or at.step == self.steps_per_epoch or at.global_step == self.total_steps

    def sec_per_step(self) -> Optional[float]:
        """Mean wall time of the recent steps, or None before the first one after compilation."""
        if len(self._stamps) < 2:
            return None
        return (self._stamps[-1] - self._stamps[0]) / (len(self._stamps) - 1)

    def images_per_sec(self) -> float:
        rate = self.sec_per_step()
        return self.global_batch / rate if rate else 0.0

    def eta(self) -> Tuple[Optional[float], Optional[float]]:
        """(seconds left in this epoch, seconds left in the run), None when unknown."""
        rate = self.sec_per_step()
        if rate is None:
            return None, None
        epoch_end = min(self.steps_per_epoch,
                        self._step + self.total_steps - self._global_step)
        return (epoch_end - self._step) * rate, (self.total_steps - self._global_step) * rate

    def step(self, at: Position, loss: Optional[float], lr: float, step_s: float, data_s: float) -> Optional[dict]:
        """Account one optimizer step; at a log step write the step line and return its metrics record.

        Args:
            at: the position after the step.
            loss: the mean loss of the steps since the last value given (the rank mean at log steps); None
                while it has not been read from the device (the train loop reads it at log steps only).
            lr: the learning rate of this step.
            step_s: compute time per step; data_s: time spent waiting per batch (at log steps: over the
                steps since the previous log step, `StepTimer.take_window`).
        """
        now = time.perf_counter()
        step, global_step = at.step, at.global_step
        self._step, self._global_step, self._last_step_time = step, global_step, now
        if loss is not None:
            self._loss_sum += loss * (step - self._loss_mark)
            self._loss_steps += step - self._loss_mark
            self._loss_mark, self._last_loss = step, loss
        if not self._compiled:  # the first step of a process includes graph compilation: keep it out of rates
            self._compiled = True
            self._stamps.clear()
        self._stamps.append(now)
        record = None
        if self.is_log_step(at):
            record = self._log_step(self._last_loss, lr, step_s, data_s)
        if self.bar is not None:
            self._draw(self._last_loss, lr, force=record is not None)
            if step == self.steps_per_epoch or global_step == self.total_steps:
                self._close_bar()  # before the save and evaluation messages that follow
        return record

    def _log_step(self, loss: float, lr: float, step_s: float, data_s: float) -> dict:
        epoch_eta, run_eta = self.eta()
        _logger.info("epoch %d/%d step %d/%d | loss %.4f (%.4f) | lr %.6f | %.3f s/step | %.1f img/s | data %.3f s"
                     " | %3.0f%% | eta %s epoch, %s run",
                     self.epoch, self.epochs, self._step, self.steps_per_epoch, loss, self.epoch_loss(), lr,
                     step_s, self.images_per_sec(), data_s, 100.0 * self._step / self.steps_per_epoch,
                     format_duration(epoch_eta), format_duration(run_eta),
                     extra={"console": self.bar is None})
        return {"kind": "step", "epoch": self.epoch, "step": self._step, "steps_per_epoch": self.steps_per_epoch,
                "global_step": self._global_step, "loss": loss, "lr": lr,
                "images_per_sec": round(self.images_per_sec(), 3), "time": round(time.time(), 3)}

    def bar_line(self, loss: float, lr: float) -> str:
        """The live bar: `epoch e/E [####....] pct b/B | loss | lr | img/s | eta <epoch>, <run>`."""
        epoch_eta, run_eta = self.eta()
        fraction = self._step / self.steps_per_epoch
        return (f"epoch {self.epoch}/{self.epochs} {render_bar(fraction)} {100 * fraction:3.0f}% "
                f"{self._step}/{self.steps_per_epoch} | loss {loss:.4f} | lr {lr:.2e} | "
                f"{self.images_per_sec():.1f} img/s | eta {format_duration(epoch_eta)} epoch, "
                f"{format_duration(run_eta)} run")

    def _draw(self, loss: float, lr: float, force: bool) -> None:
        if not force and self._last_step_time - self._last_draw < _BAR_REDRAW_S:
            return
        self._last_draw = self._last_step_time
        line = self.bar_line(loss, lr)
        # Pad over the previous line's tail: plain `\r` works on every terminal, escape codes don't.
        self.bar.write("\r" + line.ljust(self._drawn_width))
        self.bar.flush()
        self._drawn_width = len(line)

    def _close_bar(self) -> None:
        if self._drawn_width:
            self.bar.write("\n")
            self.bar.flush()
            self._drawn_width = 0

    def epoch_loss(self) -> float:
        """Mean loss of this rank's steps in the current epoch (those read so far)."""
        return self._loss_sum / self._loss_steps if self._loss_steps else float("nan")

    def end_epoch(self, train_loss: float, val: Optional[dict] = None) -> dict:
        """Close the bar, log the epoch summary and return the epoch's metrics record.

        Args:
            train_loss: the epoch's mean training loss, averaged over ranks by the caller.
            val: `{"accuracy", "loss", ...}` when the epoch ended with an evaluation.
        """
        if self.bar is not None:
            self._close_bar()
        seconds = self._last_step_time - self._epoch_start
        images = (self._step - self._first_step) * self.global_batch
        images_per_sec = images / seconds if seconds > 0 else 0.0
        record = {"kind": "epoch", "epoch": self.epoch, "step": self._step,
                  "steps_per_epoch": self.steps_per_epoch, "global_step": self._global_step,
                  "train_loss": train_loss, "epoch_seconds": round(seconds, 3),
                  "images_per_sec": round(images_per_sec, 3), "time": round(time.time(), 3)}
        evaluated = ""
        if val is not None:
            record.update(val_accuracy=val["accuracy"], val_loss=val["loss"])
            evaluated = f" | val accuracy {val['accuracy']:.4f} loss {val['loss']:.4f}"
        _logger.info("epoch %d/%d done | train loss %.4f%s | %.1f s | %.1f img/s", self.epoch, self.epochs,
                     train_loss, evaluated, seconds, images_per_sec)
        return record


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


class RankFigures:
    """Every rank's step time and share of time waiting for input, window by window.

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


def input_wait_line(summary: dict) -> str:
    """`input wait rank 1 waited most: 12.0% of its time | rank 0: 0.031 s/step, 1.0% | ...`, or "" without figures."""
    if not summary.get("ranks"):
        return ""
    most = summary["ranks"][summary["most_input_wait_rank"]]
    per_rank = " | ".join(f"rank {r['rank']}: {r['median_step_s']:.3f} s/step, {100 * r['input_wait_share']:.1f}%"
                          for r in summary["ranks"])
    return (f"input wait rank {most['rank']} waited most: {100 * most['input_wait_share']:.1f}% of its time | "
            f"{per_rank}")


@dataclass
class Watch:
    """Everything one rank's training loop reports to: progress lines or bar, the step timer, every rank's
    step and input-wait figures, the metrics files (rank 0 only; None elsewhere) and the heartbeat."""
    progress: Progress
    timer: StepTimer
    writer: Optional[MetricsWriter]
    beat: object
    ranks: RankFigures = field(default_factory=RankFigures)
    _window_fields: dict = field(default_factory=dict)   # the last log window's per-rank fields, for its record

    @classmethod
    def open(cls, *, epochs: int, steps_per_epoch: int, global_batch: int, log_every: int, max_steps: int,
             output_dir: str, tensorboard: bool, is_main: bool, world_size: int, launch_kind: str,
             start_step: int, beat) -> "Watch":
        progress = Progress(epochs, steps_per_epoch, global_batch, log_every, max_steps,
                            bar=terminal(is_main, launch_kind))
        return cls(progress, StepTimer(images_per_step=global_batch),
                   open_metrics(is_main, output_dir, tensorboard, world_size, start_step), beat)

    def close_window(self, local_loss: float, collectives) -> Tuple[float, float, float]:
        """A log step, right after this rank's loss was read from the device (which waited for its queued
        steps): one AllGather, the one the loss needed anyway, carries every rank's loss and window figures.

        Returns:
            (the rank mean loss, this rank's training s per step, its input-wait s per step) over the window.
        """
        self.timer.step_done()
        step_s, data_s = self.timer.take_window()
        rows = collectives.gather([local_loss, step_s, data_s])
        self.timer.charge_compute()
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


def summary_block(title: str, metrics: dict, *, world_size: int, wall_seconds: float,
                  images_per_sec: Optional[float] = None, files: Sequence[Tuple[str, str]] = ()) -> str:
    """The few lines that end a run on the console: the job's result and where its outputs are.

    Args:
        title: e.g. "msdist.train done".
        metrics: the job's evaluation (`accuracy`, `correct`, `num_samples`, `loss`, and `top5_accuracy` if present).
        files: (label, path) pairs; those that do not exist are left out.
    """
    accuracy = f"top-1 {metrics['accuracy']:.4f} ({metrics['correct']}/{metrics['num_samples']} test images)"
    if "top5_accuracy" in metrics:
        accuracy += f" | top-5 {metrics['top5_accuracy']:.4f}"
    speed = f" | {images_per_sec:.1f} img/s" if images_per_sec else ""
    lines = [f"== {title} ==", f"accuracy   {accuracy}", f"loss       {metrics['loss']:.4f}",
             f"job        {world_size} rank(s){speed} | wall time {format_duration(wall_seconds)}"]
    waits = input_wait_line(metrics)
    if waits:
        lines.append(waits)
    width = max((len(label) for label, _ in files), default=0)
    lines += [f"{label.ljust(max(width, 10))} {path}" for label, path in files if path and os.path.exists(path)]
    return "\n".join(lines)


def write_result(path: str, result: dict, title: str, files: Sequence[Tuple[str, str]], *, wall_seconds: float,
                 images_per_sec: Optional[float] = None) -> None:
    """Write a run's result file (train's result.json, eval's eval_result.json), then the console's closing
    block: the job's accuracy and where everything is (`files`: (label, path) pairs after the result)."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    print(f"eval result: {{'accuracy': {result['accuracy']:.4f}}}", flush=True)
    print(summary_block(title, result, world_size=result["world_size"], wall_seconds=wall_seconds,
                        images_per_sec=images_per_sec, files=[("result", path), *files]), flush=True)
