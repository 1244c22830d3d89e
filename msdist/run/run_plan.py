"""The run plan: the training options resolved once per process, at start-up, into one frozen value.

`resolve` is the only place after `config.parse` that reads the config namespace for training: start-up
(`startup.start`) calls it once, and the recipe review, `build.load_data`, `build.build_model`, the Trainer
and the train face take the `RunPlan` it returns (and plain values), never the namespace
(tests/unit/run/test_run_plan.py checks it on every module's syntax tree). run/options.py holds the single
resolution of each value (every "0 = derive it" fallback); this module gathers them, per concern.

Two facts exist only inside a rank, after start-up: its rank id (MindSpore's, known after the join) and the
class folders it lists. `load_data` completes the plan with them once (`BatchPlan.layout`,
`InputPlan.train_input`) into `build.Data`; nothing derives them again.

To add an option that training reads: give it a field, named as the option, in the part of the plan it belongs to
(`_from_options` fills it); a value derived from options gets its own line in that part's resolver below.
"""
import argparse
import dataclasses
import os
import signal
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Tuple

import numpy as np

from msdist.cluster import preemption
from msdist.rank import device
from msdist.data import pipeline, plan
from msdist.engine import optim
from msdist.run import config, options, peak, profiler, stragglers


@dataclass(frozen=True)
class BatchPlan:
    """The global batch and its layout: cut into `slots` (the original job's ranks: `options.slots_for`), each
    slot into `grad_accum_steps` micro-batches of `micro_batch` images."""
    global_batch: int
    slots: int
    resumed_slots: Optional[int]   # what the checkpoint resumed recorded (`options.resumed_slots`); None: fresh
    grad_accum_steps: int
    micro_batch: int
    eval_batch: int                # evaluation's per-rank batch: --eval_batch_size, or one slot's

    def layout(self, world_size: int, rank: int) -> plan.BatchLayout:
        """This rank's part of every global batch (start-up refused a layout --sync_bn cannot run)."""
        return plan.BatchLayout(self.slots, world_size, rank)

    def describe(self, layout: plan.BatchLayout) -> str:
        """The console line of a rank that accumulates because of its slots ("" when slots == world size)."""
        if layout.slots == layout.world_size:
            return ""
        slots, ranks = layout.slots, layout.world_size
        steps = {len(plan.BatchLayout(slots, ranks, r).owned) * self.grad_accum_steps for r in range(ranks)}
        return (f"batch layout: {slots} slots of {layout.slot_batch(self.global_batch)} images on {ranks} rank(s): "
                f"{' or '.join(str(n) for n in sorted(steps, reverse=True))} micro-batches per step, global batch "
                f"{self.global_batch} as the original job")


@dataclass(frozen=True)
class LearningRates:
    """The LR schedule's options; `--scale_lr` already applied to `base_lr` (by the original job's world size,
    its batch slots, so a job that changed size keeps its schedule)."""
    schedule: str
    base_lr: float
    epochs: int
    warmup_epochs: float
    step_size: int
    gamma: float
    min_lr: float

    def every_step(self, steps_per_epoch: int) -> np.ndarray:
        """The learning rate of every optimizer step."""
        return optim.lr_schedule(self.schedule, self.base_lr, self.epochs, steps_per_epoch, self.warmup_epochs,
                                 self.step_size, self.gamma, self.min_lr)


@dataclass(frozen=True)
class Schedule:
    """When training stops, saves, evaluates and logs (the options of those names). 0 = never / no limit, except
    that the last epoch always saves and evaluates."""
    epochs: int
    max_steps: int
    save_every_epochs: int
    eval_every_epochs: int
    save_every_steps: int
    log_every: int
    lr: LearningRates
    sink_size: int                   # K, steps per host call, resolved for the device (`options.sink_size`)
    # GPU, --sink_size auto: this rank's forecast of one sunk step in seconds (0: none for its GPU), from which the
    # ranks agree on K and the step line's period at start-up (`startup.agree_sink_size`); None: both are final.
    sunk_step_s: Optional[float] = None


@dataclass(frozen=True)
class InputPlan:
    """Where the images come from and how each rank reads them; `spec` is complete but for the rank's batch layout,
    the class count and the workers (`train_input`)."""
    data_dir: str
    skip_bad_images: bool
    num_classes: int                 # --num_classes; 0 = as many as Training/ has class folders
    num_workers: int                 # --num_workers; 0 = this rank's share of the host's cores
    spec: pipeline.TrainInput

    def classes(self, found: Dict[str, int]) -> int:
        return options.num_classes(self.num_classes, found)

    def train_input(self, layout: plan.BatchLayout, classes: int, threads_per_rank: int) -> pipeline.TrainInput:
        """This rank's training input, the same every epoch."""
        return dataclasses.replace(self.spec, layout=layout,
                                   workers=options.workers(self.num_workers, threads_per_rank),
                                   regularization=dataclasses.replace(self.spec.regularization, num_classes=classes))


@dataclass(frozen=True)
class ModelPlan:
    """The network (`name`: --model) and what trains it, besides the step (`options.StepPlan`) and the schedule; each
    other field is the option of its name."""
    name: str
    zero_init_last_bn: bool
    sync_bn: bool
    dist_bn: str
    freeze_backbone: bool
    pretrained: str
    amp_level: str                   # as given (`auto` too): whether it can speed anything up is said at build
    momentum: float
    weight_decay: float
    backbone_lr_scale: float
    ema_decay: float


@dataclass(frozen=True)
class CheckpointPlace:
    """Where this run's checkpoints go and how many are kept; `config_hash` names the options that shape the model."""
    directory: str
    prefix: str
    keep: int
    config_hash: str


@dataclass(frozen=True)
class ResumeRule:
    """`--resume`: "" (fresh), "auto" or a file; with `auto`, `from_rank0` makes every rank restore rank 0's newest
    good checkpoint (an elastic job's rule: `options.resume_from_rank0`)."""
    path: str
    from_rank0: bool


@dataclass(frozen=True)
class OutputPlan:
    directory: str
    logs: str
    overwrite: bool
    tensorboard: bool


@dataclass(frozen=True)
class WatchPlan:
    """What a run measures besides its figures: the profiler window (`--profile_steps` on `--profile_ranks`; None:
    off) and the slow-rank rule (`--straggler_margin`, `--straggler_windows`)."""
    profile: Optional[profiler.ProfileWindow]
    stragglers: stragglers.StragglerRule


@dataclass(frozen=True)
class RunPlan:
    """One process's training, resolved once at start-up (`resolve`).

    Attributes:
        world_size: ranks in the job; device: this rank's device decision (`startup.decide_device`), which the
            join only verifies.
        batch, step, schedule: the batch layout, the compiled step's make-up, and when to stop, save, evaluate, log.
        input, model: the training input and the network with what trains it.
        checkpoints, resume, output: where checkpoints go, what is resumed, where the run writes.
        watch: the profiler window and the slow-rank rule.
        preempt_signal: the signal that means "save, then exit" (the stall options are start-up's:
            `startup.Started.stall`, which every face that joins a job obeys).
        settings: every option's value by name, as config.yaml records them (`write_settings`).
    """
    world_size: int
    device: device.DevicePlan
    seed: int
    batch: BatchPlan
    step: options.StepPlan
    schedule: Schedule
    input: InputPlan
    model: ModelPlan
    checkpoints: CheckpointPlace
    resume: ResumeRule
    output: OutputPlan
    watch: WatchPlan
    preempt_signal: signal.Signals
    settings: Tuple[Tuple[str, Any], ...]


def resolve(cfg: argparse.Namespace, world_size: int, chosen: device.DevicePlan,
            environ: Mapping[str, str] = os.environ, gpu_name: Optional[str] = None) -> RunPlan:
    """The run plan of one process: `cfg` (checked by `startup.run_checks`) on `world_size` ranks and `chosen` device.

    Reads rank 0's newest checkpoint once when resuming (its batch layout), the launcher's variables in
    `environ` (`MSDIST_BATCH_SLOTS`, `MSDIST_RESUME_FROM_RANK0`), and on GPU the host's GPU product name unless
    `gpu_name` gives it.

    Raises:
        ConfigError: `resolve_batch` or `preemption.parse_signal` refuse.
    """
    batch = resolve_batch(cfg, world_size, environ)
    directory, prefix = options.checkpoint_place(cfg)
    if gpu_name is None:
        gpu_name = peak.host_gpu_name() if chosen.target == "GPU" else ""
    step = options.step_plan(cfg, chosen.target, batch.slots)
    return RunPlan(
        world_size=world_size, device=chosen, seed=cfg.seed, batch=batch, step=step,
        schedule=_schedule(cfg, batch.slots, options.sink_size(cfg, chosen.target, batch.slots, world_size),
                           options.sunk_step_forecast(cfg, chosen.target, step.amp_level, batch, world_size,
                                                      gpu_name)),
        input=_from_options(InputPlan, cfg, skip_bad_images=cfg.bad_images == "skip",
                            spec=options.train_input(cfg, plan.BatchLayout(), workers_per_rank=0, classes=0)),
        model=_model(cfg),
        checkpoints=CheckpointPlace(directory, prefix, cfg.keep_checkpoint_max, config.config_hash(cfg)),
        resume=ResumeRule(cfg.resume, options.resume_from_rank0(environ)),
        output=_output(cfg),
        watch=WatchPlan(options.profile_window(cfg), options.straggler_rule(cfg)),
        preempt_signal=preemption.parse_signal(cfg.preempt_signal),
        settings=tuple(vars(cfg).items()))


def _from_options(part, cfg, **resolved):
    """`part` (a plan dataclass) with each field the option of the same name, except those `resolved` gives."""
    return part(**{f.name: resolved[f.name] if f.name in resolved else getattr(cfg, f.name)
                   for f in dataclasses.fields(part)})


def resolve_batch(cfg, world_size: int, environ: Mapping[str, str]) -> BatchPlan:
    """The global batch cut into the job's slots and each slot into micro-batches, once (`startup.check_batch_split`
    asks the same for a face without a plan).

    Raises:
        ConfigError: `options.slots_for`, `options.micro_batch` or `options.batch_layout` (--sync_bn) refuse.
    """
    resumed = options.resumed_slots(cfg, world_size)   # the one read of the checkpoint resumed
    slots = options.slots_for(resumed, world_size, environ)
    options.batch_layout(cfg, slots, world_size, 0)    # its refusal is the same on every rank
    return BatchPlan(cfg.batch_size, slots, resumed, cfg.grad_accum_steps, options.micro_batch(cfg, slots),
                     options.eval_batch(cfg, plan.per_rank_batch(cfg.batch_size, slots)))


def _schedule(cfg, slots: int, sink_size: int, sunk_step_s: Optional[float]) -> Schedule:
    base_lr = cfg.lr * slots if cfg.scale_lr else cfg.lr
    return _from_options(Schedule, cfg, sink_size=sink_size, sunk_step_s=sunk_step_s,
                         lr=LearningRates(cfg.lr_schedule, base_lr, cfg.epochs, cfg.warmup_epochs, cfg.lr_step_size,
                                          cfg.lr_gamma, cfg.min_lr))


def _model(cfg) -> ModelPlan:
    return _from_options(ModelPlan, cfg, name=cfg.model)


@dataclass(frozen=True)
class EvalPlan:
    """`msdist.eval`'s options, resolved once at its start-up (`resolve_eval`): the checkpoint, the Test split and
    how each rank reads it, the network as training built it."""
    ckpt: str
    data_dir: str
    skip_bad_images: bool
    num_classes: int                 # --num_classes; 0 = as many as Training/ has class folders
    num_workers: int                 # --num_workers; 0 = this rank's share of the host's cores
    batch: int                       # per rank: --eval_batch_size, or the training batch's share
    image_size: int
    model: ModelPlan
    output: OutputPlan


def resolve_eval(cfg: argparse.Namespace, world_size: int, chosen: device.DevicePlan) -> EvalPlan:
    """The evaluation plan of one process (`cfg` checked by `startup.EVAL_CHECKS`). `chosen`, taken as every
    `startup.Resolver` takes it, stays with start-up: the join sets the device."""
    del chosen
    return _from_options(EvalPlan, cfg, skip_bad_images=cfg.bad_images == "skip",
                         batch=options.eval_batch(cfg, plan.per_rank_batch(cfg.batch_size, world_size)),
                         model=_model(cfg), output=_output(cfg))


def _output(cfg) -> OutputPlan:
    return OutputPlan(cfg.output_dir, os.path.join(cfg.output_dir, "logs"), cfg.overwrite, cfg.tensorboard)


def write_settings(run: RunPlan, path: str) -> None:
    """config.yaml: the options of this run, which `--config` accepts back."""
    config.save(argparse.Namespace(**dict(run.settings)), path)
