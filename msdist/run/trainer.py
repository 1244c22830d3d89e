"""The Trainer: the one owner of a training run.

It holds the run's position (`position.Position`), decides when to save, evaluate, make the ranks'
BatchNorm statistics one model (`--dist_bn`) and keep the best checkpoint, and resumes. What a
checkpoint holds besides the model is collected here from the components that declare it, each
under its own prefix in its own module: the optimizer (`optim.state_parameters`), the reducer
(`reducers.state_parameters`), the loss scaler and the EMA (`state_parameters()` of each). The
Saver (`checkpoint_saver.Saver`) writes them.

The loop's sections are small methods, one place each for what happens there: `_train_epoch` cuts the epoch
into chunks of up to `--sink_size` steps (run/chunks.py) run from one or more pipelines (`_train_segment`: on GPU
the K-long chunks from the run's one sunk feed, `_open_sunk`), `_host_chunk` waits for each batch (`data_ready()`)
and `_train_step` runs the compiled step, `_sunk_chunk` runs K steps in one call, and after each chunk
`_report` writes the step line and the heartbeat, `_end_epoch` saves (`_save`) and evaluates
(`_evaluate`) when the schedule says so, after making the ranks one model once for both (`_one_model`).
Off schedule, the state is written as it is (`_write`, no `--dist_bn` unify, no EMA sync): every
`--save_every_steps` steps by a background thread (`_save_by_steps`, run/background_save.py), and at the
step the ranks agree on after a preemption signal (`_save_preempted`, rank/preempt_stop.py), after which
the run ends for a requeue.
"""
import logging
import time
from dataclasses import dataclass
from typing import Optional

from msdist.cluster.phases import Phase
from msdist.cluster.preemption import REQUEUE_EXIT
from msdist.data import pipeline
from msdist.engine import bn_stats, loss_scale, optim, reducers, sink
from msdist.rank import distributed, preempt_stop
from msdist.run import checkpoint, chunks, evaluation, feed, resume_point, run_plan
from msdist.run.background_save import BackgroundSaver
from msdist.run.build import Data, Model
from msdist.run.checkpoint_model import model_meta
from msdist.run.checkpoint_saver import Saver
from msdist.run.meter import Meter
from msdist.run.position import Position
from msdist.run.profiler import StepProfiler
from msdist.run.watch import Watch

_logger = logging.getLogger(__name__)


def state_parameters(model: Model) -> list:
    """Every Parameter besides the model's own that an exact resume needs, as its components declare them."""
    state = optim.state_parameters(model.optimizer) + reducers.state_parameters(model.reducer) + \
        model.scaler.state_parameters()
    return state + (model.ema.state_parameters() if model.ema is not None else [])


@dataclass(frozen=True)
class Outcome:
    """How a run ended: where, its final evaluation, and the figures result.json reports."""
    position: Position
    metrics: dict
    train_start: float            # time.perf_counter() when the first epoch began
    train_seconds: float
    meter: Meter                  # the run's clock: result.json's img/s and first step
    newest: Optional[checkpoint.CheckpointInfo]
    ranks: dict                   # every rank's median step time and input-wait share (meter.RankFigures)
    preempted: bool = False       # stopped by --preempt_signal: saved at `position`, not evaluated


class Trainer:
    """One rank's run from its start (fresh or resumed) to its final evaluation.

    Args:
        run: the run plan (`run_plan.resolve`, at start-up): schedule, checkpoints, resume rule, output.
        dist, collectives: this rank and the job's host-side collectives.
        data, model: what `build.load_data` and `build.build_model` made.
        beat: this rank's heartbeat (msdist.rank.heartbeat_writer), told what the loop is doing.
        launch_kind: how the job was started (the progress bar is drawn only on a terminal).
        listener: this rank's `preempt_stop.Listener` (None: the run ignores preemption).
        flop_rate: the step line's TFLOP/s (`flops.FlopRate`), or None.
    """

    def __init__(self, run: run_plan.RunPlan, dist, collectives, data: Data, model: Model, beat, launch_kind: str,
                 listener: Optional[preempt_stop.Listener] = None, flop_rate=None):
        self.run, self.dist, self.collectives, self.data, self.model = run, dist, collectives, data, model
        self.schedule = run.schedule
        self.steps_per_epoch = data.steps_per_epoch
        self.beat, self.launch_kind = beat, launch_kind
        place = run.checkpoints
        self.saver = Saver(directory=place.directory, prefix=place.prefix, rank=dist.rank, keep=place.keep,
                           config_hash=place.config_hash, net=model.net, train_state=state_parameters(model),
                           collectives=collectives,
                           meta=model_meta(run.model.name, data.num_classes, data.train_input.image_size, data.classes,
                                           model.convention, data.train_input.layout.slots))
        self.background = BackgroundSaver(self.saver, collectives)   # --save_every_steps
        self.watch: Optional[Watch] = None
        self.saved_at = 0
        self.listener, self.flop_rate = listener, flop_rate
        self.stop: Optional[preempt_stop.Agreement] = None
        self.profiler: Optional[StepProfiler] = None   # --profile_steps, on the ranks it covers
        self.sunk: Optional[feed.SunkFeed] = None   # GPU, K > 1: the run's sunk chunks (`_open_sunk`)
        # Where chunks end (run/chunks.py), and the Cell a sunk call runs (GPU, K > 1; else None).
        window = run.watch.profile
        self.limits = chunks.Limits(self.schedule.log_every, self.schedule.save_every_steps, self.schedule.max_steps,
                                    () if window is None else (window.first - 1, window.last))
        self.sunk_step = sink.sunk_step(model.train_step, model.ema, dist.device_target, self.schedule.sink_size,
                                        run.step.jit_level)
        _logger.info("%s", chunks.describe(self.schedule.sink_size, self.sunk_step is not None,
                                           model.train_step.slot_stats.several))
        # What the stall watch scales a save's and an evaluation's allowance from.
        self._state_bytes = sum(p.nbytes for p in model.net.get_parameters()) + \
            sum(p.nbytes for p in state_parameters(model))
        eval_batch = dist.world_size * data.eval_batch
        self._eval_batches = -(-len(data.test) // eval_batch) * (2 if model.ema is not None else 1)

    def resume(self) -> Position:
        """Restore the checkpoint `--resume` names (every resumable Parameter); where training continues."""
        self.saver.remove_temporaries()
        path, rank0s = self.run.resume.path, False
        if path == "auto":
            point = resume_point.agree(self.saver.directory, self.saver.prefix, self.dist.rank, self.collectives,
                                       elastic=self.run.resume.from_rank0)
            if point is None:
                _logger.info("resume auto: no checkpoint in %s yet; starting fresh", self.saver.directory)
                return Position()
            path, rank0s = point.info.path, point.rank0s
        if not path:
            return Position()
        info = self.saver.resume(path, drop_residuals=rank0s)  # rank 0's unsent gradient is not this rank's
        self.model.train_step.slot_stats.restart()  # this rank's other batch slots, if any: not in checkpoints
        at = info.position.resumed(self.steps_per_epoch, info.path)
        layout = self.data.train_input.layout
        _logger.info("resumed from %s: epoch %d, step %d of %d, global step %d | batch layout %d slots on %d rank(s)",
                     info.path, at.next_epoch(self.steps_per_epoch), at.skip(self.steps_per_epoch),
                     self.steps_per_epoch, at.global_step, layout.slots, layout.world_size)
        return at

    def fit(self) -> Outcome:
        """Train from the resumed position to the end (epochs or --max_steps); save and evaluate the last model."""
        schedule, output = self.schedule, self.run.output
        at = self.resume()
        distributed.check_replicas_identical(self.collectives, self.model.net, "at start")
        self.watch = Watch.open(epochs=schedule.epochs, steps_per_epoch=self.steps_per_epoch,
                                global_batch=self.run.batch.global_batch, log_every=schedule.log_every,
                                max_steps=schedule.max_steps, output_dir=output.directory,
                                tensorboard=output.tensorboard,
                                is_main=self.dist.is_main, world_size=self.dist.world_size,
                                launch_kind=self.launch_kind, start_step=at.global_step,
                                collectives=self.collectives, flop_rate=self.flop_rate,
                                straggler_rule=self.run.watch.stragglers)
        self.profiler = StepProfiler.open(self.run.watch.profile, self.dist.rank, self.dist.device_target,
                                          output.directory, at.global_step)
        self.saved_at, metrics = at.global_step, None
        self.stop = preempt_stop.Agreement(self.listener, self.collectives, at.global_step,
                                           faults=self.background.failure_row)
        self.sunk = self._open_sunk(at)
        train_start = time.perf_counter()
        try:
            while at.next_epoch(self.steps_per_epoch) < schedule.epochs and not self._reached(at) and not self._preempted:
                at = self._train_epoch(at)
                if at.epoch_complete(self.steps_per_epoch) or not self._preempted:
                    metrics = self._end_epoch(at)  # an epoch's end is on schedule, preempted there or not
        finally:
            if self.sunk is not None:   # the run's end, --max_steps, an agreed stop or an error
                self.sunk.close()
        train_seconds = time.perf_counter() - train_start
        if self.profiler is not None:
            self.profiler.close(at.global_step)
        if self._preempted:
            return self._save_preempted(at, train_start, train_seconds)
        self.watch.close()
        # Save the last step if unsaved; evaluate unless the last epoch did (not when stopped by max_steps, or
        # resumed from a finished run).
        final = self._save_and_evaluate(at, save=at.global_step != self.saved_at, evaluate=metrics is None)
        self._settle_writes(at)
        return Outcome(at, metrics or final, train_start, train_seconds, self.watch.meter, self.saver.newest,
                       self.watch.ranks.summary())

    @property
    def _preempted(self) -> bool:
        return self.stop.agreed_step is not None

    def _save_preempted(self, at: Position, train_start: float, train_seconds: float) -> Outcome:
        """Every rank agreed to stop at `at`: save the training state as it is, unless the schedule just did, and
        wait until every rank's checkpoint is complete."""
        self._settle_writes(at)   # a background write failed on some rank: every rank exits with a failure, not 200
        if at.global_step != self.saved_at:
            self.beat.enter(Phase.CHECKPOINT_SAVE, nbytes=self._state_bytes)
            loss_scale.check_finite(self.model.scaler)  # never write weights a fixed scale has made inf or NaN
            self._write(at)
        # Every rank's file is on disk before any rank exits 200: a relay or launcher that sees 200 from its own
        # ranks knows the checkpoint is complete everywhere. A rank whose blocking save failed never arrives here,
        # and the others end with MindSpore's lost-peer error instead of 200.
        self.collectives.sum([1.0])
        self.watch.close()
        _logger.warning("preempted: the ranks agreed on global step %d; checkpoint complete %.1f s after the "
                        "signal; exiting with %d (requeue)", at.global_step,
                        time.monotonic() - self.stop.requested_at, REQUEUE_EXIT)
        return Outcome(at, {}, train_start, train_seconds, self.watch.meter, self.saver.newest,
                       self.watch.ranks.summary(), preempted=True)

    def _reached(self, at: Position) -> bool:
        """Whether `--max_steps` (0 = no limit) stops training at this position."""
        return bool(self.schedule.max_steps) and at.global_step >= self.schedule.max_steps

    def _due(self, at: Position, every_epochs: int) -> bool:
        """Whether the schedule acts after complete epoch `at.epoch`: every `every_epochs` (0 = never), and the last."""
        return at.epoch == self.schedule.epochs or bool(every_epochs) and at.epoch % every_epochs == 0

    def _train_epoch(self, at: Position) -> Position:
        """The optimizer steps of the epoch `at` is in (or begins), from where it stands, in chunks of up to
        `--sink_size` steps (run/chunks.py), the boundary work after each; stop early at max_steps or a stop."""
        steps_per_epoch, k = self.steps_per_epoch, self.schedule.sink_size
        lengths = list(chunks.epoch_lengths(at.global_step, at.skip(steps_per_epoch), steps_per_epoch, k, self.limits))
        for index, (sunk, part) in enumerate(chunks.segments(lengths, k, sinks=self.sunk_step is not None)):
            at, stopped = self._train_segment(at, part, sunk, first=index == 0)
            if stopped:
                break
        return at

    def _open_sunk(self, at: Position) -> Optional[feed.SunkFeed]:
        """GPU, K > 1: the run's one sunk feed, every K-long chunk from `at` to the end (run/feed.py); else None."""
        if self.sunk_step is None:
            return None
        self.beat.enter(Phase.DATA_WAIT)  # building the pipeline
        k, spe = self.schedule.sink_size, self.steps_per_epoch
        run = chunks.run_chunks(at.global_step, spe, self.schedule.epochs, k, self.limits)
        return feed.open_sunk_run(self.data.train, self.data.train_input, run, self.sunk_step, k)

    def _train_segment(self, at: Position, lengths: list, sunk: bool, first: bool):
        """One segment's chunks (`chunks.segments`: on CPU the whole epoch), host-fed from its own pipeline or sunk
        from the run's; (where it ended, whether the run stops there)."""
        epoch, skip = at.next_epoch(self.steps_per_epoch), at.skip(self.steps_per_epoch)
        self.beat.enter(Phase.DATA_WAIT)  # building the pipeline and its first batch
        host = None if sunk else pipeline.build_train_dataset(self.data.train, self.data.train_input, epoch, skip)
        if first:
            self.watch.start_epoch(at)
        source = self.sunk if sunk else feed.HostFeed(host)
        try:
            for length in lengths:
                at = self._sunk_chunk(source, at, length) if sunk else self._host_chunk(source, at, length)
                self.background.raise_crash()  # a fault of the writer's own; a failed write: _stop_agreed
                self._save_by_steps(at)
                if self._reached(at) or self._stop_agreed(at):
                    return at, True
        finally:
            if not sunk:   # the run's sunk feed stays open for its next chunks
                source.close()
        return at, False

    def _host_chunk(self, source: feed.HostFeed, at: Position, length: int) -> Position:
        """`length` steps, one call each, their batches from the host (the next fetched while a step runs:
        data/prefetch.py); the step line and the heartbeat after the last."""
        for left in range(length - 1, -1, -1):
            images, labels = source.next_batch()
            self.beat.enter(Phase.TRAIN_STEP)
            data_s = self.watch.meter.data_ready()
            at = self._train_step(images, labels, at)
            if left:  # inside the chunk: the next batch is waited for as after any step
                self.watch.meter.step_done()
                self.beat.enter(Phase.DATA_WAIT)
        self._report(at, data_s)
        return at

    def _sunk_chunk(self, source: feed.SunkFeed, at: Position, length: int) -> Position:
        """GPU: `length` (= K) steps and their EMA updates in one sunk call; the step line and the heartbeat after."""
        self.beat.enter(Phase.TRAIN_STEP)
        data_s = self.watch.meter.data_ready()  # the batches wait in the device's queue
        if self.profiler is not None:
            self.profiler.before_step(at.global_step + 1)
        source.run_chunk(self.dist.rank, at.global_step)
        self.model.train_step.losses.step_done(length)
        if self.profiler is not None:
            self.profiler.after_step(at.global_step + length)
        self.watch.meter.step_done(steps=length - 1)  # `_report` counts the last
        at = Position.at(at.global_step + length, self.steps_per_epoch)
        self._report(at, data_s)
        return at

    def _stop_agreed(self, at: Position) -> bool:
        """Whether every rank stops after `at` (preempt_stop.Agreement): a collective at check steps, in a phase of its
        own, so that a rank held there by a stuck one says where it waits (heartbeat's stall line)."""
        self.beat.enter(Phase.STOP_CHECK)
        agreed = self.stop.stop_at(at.global_step)
        self.beat.enter(Phase.DATA_WAIT)
        if self.stop.faulted is not None:
            raise self.background.failure_error(self.stop.faulted, at.global_step, self.steps_per_epoch)
        return agreed

    def _settle_writes(self, at: Position) -> None:
        """Wait for the background write in flight; if any rank's failed, every rank names it and stops. One small
        gather at a save, an evaluation and the end (never per step), so a rank whose write failed while the loop
        waited for it does not leave the others in the next collective."""
        self.background.wait()
        if self.schedule.save_every_steps:
            rows = self.collectives.gather(self.background.failure_row())
            if rows.any():
                raise self.background.failure_error(rows, at.global_step, self.steps_per_epoch)

    def _train_step(self, images, labels, at: Position) -> Position:
        """One optimizer step (and the EMA's update after it); nothing is read back here. MindSpore 2.10 ends each
        graph run on GPU with a stream sync, so the host's work between calls idles the device: a sunk chunk
        (`_sunk_chunk`) takes it out of K - 1 of every K steps."""
        if self.profiler is not None:
            self.profiler.before_step(at.global_step + 1)
        self.model.train_step.train_on(images, labels)  # its loss is summed on the device (step.LossAccumulator)
        if self.model.ema is not None:
            self.model.ema()
        if self.profiler is not None:
            self.profiler.after_step(at.global_step + 1)
        return at.advanced(self.steps_per_epoch)

    def _report(self, at: Position, data_s: float) -> None:
        """The step line (at log steps), metrics, and the heartbeat."""
        watch = self.watch
        loss = None
        if watch.progress.is_log_step(at):  # the loss read back: it waits for every step before it
            loss, step_s, data_s = watch.close_window(self.model.train_step.losses.read(), self.collectives)
            loss_scale.check_finite(self.model.scaler, self.model.train_step.finite_weights, loss, at.global_step)
        else:
            step_s = watch.meter.step_done()
        watch.record(watch.progress.step(at, loss, float(self.model.lrs[at.global_step - 1]), step_s, data_s))
        self.beat.step_done(at.epoch, at.step, at.global_step)
        self.beat.enter(Phase.DATA_WAIT)

    def _save_by_steps(self, at: Position) -> None:
        """Every --save_every_steps steps, off schedule: the loop waits for the in-memory copy only."""
        every = self.schedule.save_every_steps
        if not every or at.global_step % every or at.epoch_complete(self.steps_per_epoch) and (
                self._due(at, self.schedule.save_every_epochs) or self._due(at, self.schedule.eval_every_epochs)):
            return  # the schedule acts at this epoch's end at once (and its best file links its own save)
        self.beat.enter(Phase.CHECKPOINT_SAVE, nbytes=self._state_bytes)
        loss_scale.check_finite(self.model.scaler)
        waited = self.background.save(at)
        _logger.info("save by steps at global step %d: the loop waited %.3f s (copy)", at.global_step, waited)
        self.beat.enter(Phase.DATA_WAIT)

    def _end_epoch(self, at: Position) -> Optional[dict]:
        """After an epoch's steps: save and evaluate when due; the epoch summary. The evaluation, or None."""
        complete = at.epoch_complete(self.steps_per_epoch)
        # The last epoch's evaluation is the final one, so its epoch summary can show it.
        metrics = self._save_and_evaluate(at, save=complete and self._due(at, self.schedule.save_every_epochs),
                                          evaluate=complete and self._due(at, self.schedule.eval_every_epochs))
        self.beat.enter(Phase.EPOCH_END)   # the epoch's loss summed over ranks: a collective
        loss = float(self.collectives.sum([self.watch.progress.epoch_loss()])[0]) / self.dist.world_size
        self.watch.record(self.watch.progress.end_epoch(loss, metrics))
        return metrics

    def _one_model(self) -> None:
        """Before weights are evaluated or written: stop a fixed-scale run that met an inf or NaN; without sync_bn
        each rank keeps its own BatchNorm statistics, so make them one model (--dist_bn)."""
        loss_scale.check_finite(self.model.scaler, self.model.train_step.finite_weights)
        bn_stats.unify_bn_stats(self.model.net, self.collectives, self.run.model.dist_bn,
                                self.model.train_step.slot_stats.others, self.data.train_input.layout.slots)
        if self.model.ema is not None:
            self.model.ema.synchronize(self.collectives)

    def _save_and_evaluate(self, at: Position, *, save: bool, evaluate: bool) -> Optional[dict]:
        """Save and/or evaluate the model at `at`, the ranks made one model once for both: the BatchNorm statistics
        are gathered and the EMA synced once, and the best checkpoint can be the file just saved (`Saver.keep_best`
        decides by position). The evaluation, or None."""
        if save:
            self.beat.enter(Phase.CHECKPOINT_SAVE, nbytes=self._state_bytes)
        elif evaluate:
            self.beat.enter(Phase.EVALUATION, batches=self._eval_batches)
        else:
            return None
        self._settle_writes(at)  # at most one write in flight, and keep_best may link the newest checkpoint
        self._one_model()  # its collectives count toward the phase entered above
        if save:
            self._save(at)
        return self._evaluate(at) if evaluate else None

    def _save(self, at: Position) -> None:
        """Write this position's checkpoints (the EMA's, then the resumable one); after `_one_model`."""
        if self.model.ema is not None:
            self.saver.save_tagged("ema", self.model.ema.as_model_checkpoint(), at)
        self._write(at)

    def _write(self, at: Position) -> None:
        """Write the resumable state as it is. Off schedule (a preemption) nothing else happens: making the ranks
        one model there would change the training state, and the resumed run would differ from an uninterrupted one."""
        self.background.wait()  # at most one write in flight; the next prune counts its file
        began = time.perf_counter()
        self.saver.save(at)
        _logger.info("blocking save at global step %d took %.3f s", at.global_step, time.perf_counter() - began)
        self.saved_at = at.global_step

    def _evaluate(self, at: Position) -> dict:
        """Evaluate the model (and its EMA) on the whole Test split; keep the best checkpoint. After `_one_model`."""
        self.beat.enter(Phase.EVALUATION, batches=self._eval_batches)
        metrics = self._evaluate_net()
        self.saver.keep_best(at, metrics["accuracy"])
        if self.model.ema is not None:
            with self.model.ema.swapped_into():
                metrics["ema"] = self._evaluate_net()
            _logger.info("EMA weights: accuracy %.4f loss %.4f", metrics["ema"]["accuracy"], metrics["ema"]["loss"])
        return metrics

    def _evaluate_net(self) -> dict:
        data = self.data
        return evaluation.evaluate_split(self.model.net, data.test, batch_size=data.eval_batch,
                                         image_size=data.train_input.image_size, dist=self.dist,
                                         workers=data.train_input.workers, collectives=self.collectives,
                                         num_classes=data.num_classes)
