"""The options resolved once: what each layer needs, as small typed values, decided here from the parsed config.

data/ and engine/ never see the config namespace (tests/unit/test_plain_values.py checks it): they take the
objects made here, each defined where it belongs (`pipeline.TrainInput`, `augment.Regularization`) or
plain values. Every fallback of the form "0 = derive it" is decided here, once, so no two places can
derive it differently. The checks over option values and the world size run earlier, in `config.parse`
and `startup.OPTION_CHECKS`, before MindSpore loads.
"""
import os
from dataclasses import dataclass
from typing import Dict, Mapping, Optional, Tuple

import numpy as np

from msdist.base.errors import ConfigError
from msdist.base.launch_env import BATCH_SLOTS_VAR, RESUME_FROM_RANK0_VAR
from msdist.cluster import runtime
from msdist.data import augment, pipeline, plan
from msdist.engine import jit, optim, precision
from msdist.run import checkpoint_model, config


def num_classes(cfg, classes: Dict[str, int]) -> int:
    """`--num_classes`, or 0 = as many as Training/ has class folders."""
    return cfg.num_classes or len(classes)


def workers(cfg, rt: runtime.RuntimeInfo) -> int:
    """Dataset workers per rank: `--num_workers`, or 0 = this rank's share of the host's cores."""
    return cfg.num_workers or rt.threads_per_rank


def eval_batch(cfg, per_rank_batch: int) -> int:
    """Per-rank evaluation batch: `--eval_batch_size`, or 0 = the per-rank training batch."""
    return cfg.eval_batch_size or per_rank_batch


def regularization(cfg, classes: int) -> augment.Regularization:
    """The training options beyond crop and flip (crop ranges already checked by `config.parse`)."""
    return augment.Regularization(cfg.train_crop, (cfg.crop_scale_min, cfg.crop_scale_max),
                                  (cfg.crop_ratio_min, cfg.crop_ratio_max), cfg.color_jitter, cfg.mixup, cfg.cutmix,
                                  cfg.label_smoothing, classes)


def checkpoint_place(cfg) -> Tuple[str, str]:
    """(directory, prefix) of this run's checkpoints."""
    return os.path.join(cfg.output_dir, "ckpt"), cfg.ckpt_prefix or cfg.model


def resumed_slots(cfg, world_size: int) -> Optional[int]:
    """The batch slots recorded by the run `--resume` continues (`checkpoint_model.recorded_slots`, from rank 0's
    newest checkpoint, so every rank reads the same); None for a fresh start."""
    source = checkpoint_model.resume_source(cfg.resume, *checkpoint_place(cfg), 0)
    return checkpoint_model.recorded_slots(source, world_size) if source else None


def batch_slots(cfg, world_size: int, environ: Mapping[str, str] = os.environ) -> int:
    """How many slots the job's global batch is cut into (`plan.BatchLayout`): the layout of the original job.

    Resuming, the checkpoint's; on more ranks than that (a job grown past the ranks it was started for), one per
    rank, as BatchNorm's micro-batches cannot be kept (`recipe.review` warns). Fresh, `MSDIST_BATCH_SLOTS`
    (`launch_env.BATCH_SLOTS_VAR`, set by a launcher that may shrink the job later), else the world size.

    Raises:
        ConfigError: MSDIST_BATCH_SLOTS is not a whole number of at least the world size.
    """
    return slots_for(resumed_slots(cfg, world_size), world_size, environ)


def slots_for(recorded: Optional[int], world_size: int, environ: Mapping[str, str] = os.environ) -> int:
    """`batch_slots` from the slots the resumed checkpoint recorded (`resumed_slots`; None for a fresh start)."""
    if recorded is not None:
        return max(recorded, world_size)
    text = environ.get(BATCH_SLOTS_VAR, "")
    if not text:
        return world_size
    if not text.isdigit() or int(text) < world_size:
        raise ConfigError(f"{BATCH_SLOTS_VAR}={text!r}: the batch layout needs a whole number of slots of at least "
                          f"the world size {world_size}; set it to the most ranks the job may have, or unset it")
    return int(text)


def resume_from_rank0(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether `--resume auto` restores rank 0's newest good checkpoint on every rank whatever the ranks' own files
    say: an elastic job's (`launch_env.RESUME_FROM_RANK0_VAR`, set by msdist.launch --nnodes MIN:MAX)."""
    return bool(environ.get(RESUME_FROM_RANK0_VAR))


def batch_layout(cfg, slots: int, world_size: int, rank: int) -> plan.BatchLayout:
    """This rank's part of every global batch (slots from `batch_slots`).

    Raises:
        ConfigError: ranks owning unequal numbers of slots under --sync_bn, whose statistics are a collective in
            every micro-batch: the rank with fewer would stop answering.
    """
    layout = plan.BatchLayout(slots, world_size, rank)
    if cfg.sync_bn and not layout.even:
        raise ConfigError(f"--sync_bn true with a batch layout of {slots} slots on {world_size} ranks: the ranks "
                          f"would run unequal numbers of micro-batches, each a collective; resume on a number of "
                          f"ranks that divides {slots}")
    return layout


def train_input(cfg, layout: plan.BatchLayout, workers_per_rank: int, classes: int) -> pipeline.TrainInput:
    """This rank's training input, the same every epoch."""
    return pipeline.TrainInput(image_size=cfg.image_size, global_batch=cfg.batch_size, seed=cfg.seed,
                               shuffle=cfg.shuffle, augment=cfg.augment, padding=cfg.crop_padding,
                               workers=workers_per_rank, layout=layout, regularization=regularization(cfg, classes),
                               device_normalizes=True)


def learning_rates(cfg, slots: int, steps_per_epoch: int) -> np.ndarray:
    """The learning rate of every optimizer step; `--scale_lr` multiplies the base rate by the original job's world
    size (its batch slots), so a job that changed size keeps its schedule."""
    base_lr = cfg.lr * slots if cfg.scale_lr else cfg.lr
    return optim.lr_schedule(cfg.lr_schedule, base_lr, cfg.epochs, steps_per_epoch, cfg.warmup_epochs,
                             cfg.lr_step_size, cfg.lr_gamma, cfg.min_lr)


def micro_batch(cfg, slots: int) -> int:
    """The micro-batch: a slot (one original rank's share of the global batch), split into `--grad_accum_steps`."""
    return plan.micro_batch_size(plan.per_rank_batch(cfg.batch_size, slots), cfg.grad_accum_steps)


def describe_layout(cfg, layout: plan.BatchLayout) -> str:
    """The console line of a rank that accumulates because of its slots ("" when slots == world size)."""
    if layout.slots == layout.world_size:
        return ""
    slots, ranks = layout.slots, layout.world_size
    steps = {len(plan.BatchLayout(slots, ranks, r).owned) * cfg.grad_accum_steps for r in range(ranks)}
    return (f"batch layout: {slots} slots of {layout.slot_batch(cfg.batch_size)} images on {ranks} rank(s): "
            f"{' or '.join(str(n) for n in sorted(steps, reverse=True))} micro-batches per step, global batch "
            f"{cfg.batch_size} as the original job")


@dataclass(frozen=True)
class StepPlan:
    """What the compiled train step is made of, resolved once for this device and world size.

    Attributes:
        amp_level: O0, O2 or O3 (`auto` resolved for the device); amp_dtype: float16 or bfloat16.
        loss_scale: fixed or dynamic, from `--loss_scale` and what carries float16 gradients.
        grad_compression, topk_ratio, threshold, error_feedback: how gradients cross ranks (engine/reducers.py).
        fusion: `--allreduce_fusion` as parameter indices; () = one fused group; None = auto (buckets by bytes).
        bn_stats: SyncBatchNorm's statistics precision on this device (`precision.bn_stats_precision`).
        accum_steps, micro_batch: micro-batches per optimizer step on this rank, and each one's size.
        grad_scale: what this rank's summed micro-batch gradients are multiplied by before the mean over ranks
            (`plan.BatchLayout.gradient_scale`).
        jit_level: MindSpore's compile level for the step, O0 or O1 (`jit.resolve_jit_level`).
    """
    amp_level: str
    amp_dtype: str
    loss_scale: precision.LossScalePlan
    grad_compression: str
    topk_ratio: float
    threshold: float
    error_feedback: bool
    fusion: Optional[Tuple[int, ...]]
    accum_steps: int
    micro_batch: int
    bn_stats: str
    grad_scale: float
    jit_level: str = "O0"

    def describe_precision(self) -> str:
        amp = self.amp_level if self.amp_level == "O0" else f"{self.amp_level} {self.amp_dtype}"
        return f"amp {amp} | loss scale {self.loss_scale.describe()} | jit_level {self.jit_level}"


def step_plan(cfg, device_target: str, layout: plan.BatchLayout) -> StepPlan:
    """The train step's plan on `device_target` (CPU or GPU, resolved) for this rank's part of the batch."""
    amp_level = precision.resolve_amp_level(cfg.amp_level, device_target)
    return StepPlan(amp_level, cfg.amp_dtype,
                    precision.loss_scale_plan(cfg.loss_scale, amp_level, cfg.amp_dtype, cfg.grad_compression),
                    cfg.grad_compression, cfg.topk_ratio, cfg.threshold, cfg.error_feedback,
                    _fusion(cfg.allreduce_fusion), layout.micro_steps(cfg.grad_accum_steps),
                    micro_batch(cfg, layout.slots), precision.bn_stats_precision(device_target),
                    layout.gradient_scale(cfg.grad_accum_steps), jit.resolve_jit_level(cfg.jit_level, device_target))


def _fusion(text: str) -> Optional[Tuple[int, ...]]:
    split = config.fusion_split(text)
    return None if split is None else tuple(split)
