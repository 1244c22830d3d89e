"""What a run shows while it trains: the step lines, the progress bar (tqdm) and the epoch summary.

It formats only: every timing figure is read from the run's `meter.Meter`, and averaging over ranks
stays with the caller, who owns the collectives.
"""
import logging
import sys
import time
from typing import Optional, TextIO, Tuple

from tqdm import tqdm

from msdist.run.flops import FlopRate
from msdist.run.meter import Meter
from msdist.run.position import Position

_logger = logging.getLogger(__name__)
# tqdm draws the bar; its own rate, elapsed and remaining fields are left out because they would be a
# second clock: the figures after the counts are the meter's (`Progress.bar_figures`).
_BAR_FORMAT = "{desc} {percentage:3.0f}%|{bar:24}| {n_fmt}/{total_fmt}{postfix}"
_BAR_REDRAW_S = 0.2      # a terminal redrawn at every step of a fast model costs more than it shows


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


class Progress:
    """Step lines, the live bar and the epoch summary of one training run.

    Every `log_every` steps (and at the end of an epoch or of the run) the step line
    `epoch e/E step b/B | loss now (avg) | lr | s/step | img/s | data s | pct | eta | TFLOP/s` goes to the
    log: the rank's file always, the console too unless a bar is drawn. img/s, the ETAs and TFLOP/s are
    the meter's recent rate, data loading included.

    Args:
        epochs: epochs of the whole run.
        steps_per_epoch: optimizer steps in one epoch.
        log_every: steps between step lines.
        meter: the run's clock.
        max_steps: the run stops after this many steps in total; 0 = no limit.
        bar: stream for the live progress bar (see `terminal`), or None for step lines only.
        flop_rate: the model's FLOPs and the device's peak (run/flops.py), or None for no TFLOP/s.
    """

    def __init__(self, epochs: int, steps_per_epoch: int, log_every: int, meter: Meter, max_steps: int = 0,
                 bar: Optional[TextIO] = None, flop_rate: Optional[FlopRate] = None):
        self.epochs, self.steps_per_epoch, self.log_every, self.meter = epochs, steps_per_epoch, log_every, meter
        self.flop_rate = flop_rate
        full = epochs * steps_per_epoch
        self.total_steps = min(full, max_steps) if max_steps else full
        self.stream = bar
        self._bar: Optional[tqdm] = None
        self.epoch = 0
        self._loss_sum, self._loss_steps, self._loss_mark = 0.0, 0, 0
        self._last_loss = float("nan")
        self._step = self._global_step = 0
        self._figures_at = float("-inf")   # the meter's time of the step whose figures the bar shows

    def start_epoch(self, at: Position) -> None:
        """Begin the epoch of the step after `at`, part-way through it when a resumed run skips steps already done."""
        self.epoch = at.next_epoch_number(self.steps_per_epoch)
        first_step = at.skip(self.steps_per_epoch)
        self._step = first_step
        self._loss_sum, self._loss_steps, self._loss_mark = 0.0, 0, first_step
        if self.stream is not None:
            self._bar = tqdm(total=self.steps_per_epoch, initial=first_step, file=self.stream,
                             desc=f"epoch {self.epoch}/{self.epochs}", bar_format=_BAR_FORMAT,
                             mininterval=_BAR_REDRAW_S, dynamic_ncols=True)

    def is_log_step(self, at: Position) -> bool:
        """True where a step line and a metrics record are due after the step to `at` (the caller averages the
        loss there)."""
        return at.step % self.log_every == 0 or at.step == self.steps_per_epoch or at.global_step == self.total_steps

    def eta(self) -> Tuple[Optional[float], Optional[float]]:
        """(seconds left in this epoch, seconds left in the run), None when unknown."""
        rate = self.meter.sec_per_step()
        if rate is None:
            return None, None
        epoch_end = min(self.steps_per_epoch, self._step + self.total_steps - self._global_step)
        return (epoch_end - self._step) * rate, (self.total_steps - self._global_step) * rate

    def step(self, at: Position, loss: Optional[float], lr: float, step_s: float, data_s: float) -> Optional[dict]:
        """Account one optimizer step; at a log step write the step line and return its metrics record.

        Args:
            at: the position after the step.
            loss: the mean loss of the steps since the last value given (the rank mean at log steps); None
                while it has not been read from the device (the train loop reads it at log steps only).
            lr: the learning rate of this step.
            step_s: compute time per step; data_s: time spent waiting per batch (at log steps: over the
                steps since the previous log step, `Meter.take_window`).
        """
        step = self._step = at.step
        self._global_step = at.global_step
        if loss is not None:
            self._loss_sum += loss * (step - self._loss_mark)
            self._loss_steps += step - self._loss_mark
            self._loss_mark, self._last_loss = step, loss
        record = self._log_step(self._last_loss, lr, step_s, data_s) if self.is_log_step(at) else None
        if self._bar is not None:
            last = step == self.steps_per_epoch or at.global_step == self.total_steps
            self._advance_bar(step, lr, fresh=record is not None or last)
            if last:
                self._close_bar()  # before the save and evaluation messages that follow
        return record

    def _advance_bar(self, step: int, lr: float, fresh: bool) -> None:
        """Move the bar to `step`; tqdm redraws it at most every _BAR_REDRAW_S, so its figures are formatted
        about as often (formatting them at every step cost ~50 us a step, measured), and at log steps."""
        if fresh or self.meter.last_step_at - self._figures_at >= _BAR_REDRAW_S:
            self._figures_at = self.meter.last_step_at
            self._bar.set_postfix_str(self.bar_figures(self._last_loss, lr), refresh=False)
        self._bar.update(step - self._bar.n)

    def _log_step(self, loss: float, lr: float, step_s: float, data_s: float) -> dict:
        epoch_eta, run_eta = self.eta()
        images_per_sec = self.meter.recent_images_per_sec()
        rate = self.flop_rate
        _logger.info("epoch %d/%d step %d/%d | loss %.4f (%.4f) | lr %.6f | %.3f s/step | %.1f img/s | data %.3f s"
                     " | %3.0f%% | eta %s epoch, %s run%s",
                     self.epoch, self.epochs, self._step, self.steps_per_epoch, loss, self.epoch_loss(), lr,
                     step_s, images_per_sec, data_s, 100.0 * self._step / self.steps_per_epoch,
                     format_duration(epoch_eta), format_duration(run_eta),
                     f" | {rate.step_line(images_per_sec)}" if rate else "", extra={"console": self.stream is None})
        return {"kind": "step", "epoch": self.epoch, "step": self._step, "steps_per_epoch": self.steps_per_epoch,
                "global_step": self._global_step, "loss": loss, "lr": lr,
                "images_per_sec": round(images_per_sec, 3), "time": round(time.time(), 3),
                **(rate.fields(images_per_sec) if rate else {})}

    def bar_figures(self, loss: float, lr: float) -> str:
        """What the bar shows after its counts: `loss | lr | img/s | eta <epoch>, <run>`, from the meter."""
        epoch_eta, run_eta = self.eta()
        return (f"loss {loss:.4f} | lr {lr:.2e} | {self.meter.recent_images_per_sec():.1f} img/s | "
                f"eta {format_duration(epoch_eta)} epoch, {format_duration(run_eta)} run")

    def _close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()  # draws the final state and ends its line
            self._bar = None

    def epoch_loss(self) -> float:
        """Mean loss of this rank's steps in the current epoch (those read so far)."""
        return self._loss_sum / self._loss_steps if self._loss_steps else float("nan")

    def end_epoch(self, train_loss: float, val: Optional[dict] = None) -> dict:
        """Close the bar, log the epoch summary and return the epoch's metrics record.

        Args:
            train_loss: the epoch's mean training loss, averaged over ranks by the caller.
            val: `{"accuracy", "loss", ...}` when the epoch ended with an evaluation.
        """
        self._close_bar()
        seconds, images_per_sec = self.meter.epoch_seconds(), self.meter.epoch_images_per_sec()
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
