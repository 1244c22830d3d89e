"""The options resolved once: what each layer needs, as small typed values, decided here from the parsed config.

data/ and engine/ never see the config namespace (tests/unit/test_plain_values.py checks it): they take the
objects made here, each defined where it belongs (`pipeline.TrainInput`, `augment.Regularization`) or
plain values. Every fallback of the form "0 = derive it" is decided here, once, so no two places can
derive it differently. The checks over option values and the world size run earlier, in `config.parse`
and `startup.OPTION_CHECKS`, before MindSpore loads.
"""
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import numpy as np

from msdist.cluster import runtime
from msdist.data import augment, pipeline, plan
from msdist.engine import optim, precision
from msdist.run import config


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


def train_input(cfg, world_size: int, rank: int, workers_per_rank: int, classes: int) -> pipeline.TrainInput:
    """This rank's training input, the same every epoch."""
    return pipeline.TrainInput(image_size=cfg.image_size, global_batch=cfg.batch_size, seed=cfg.seed,
                               shuffle=cfg.shuffle, augment=cfg.augment, padding=cfg.crop_padding,
                               workers=workers_per_rank, world_size=world_size, rank=rank,
                               regularization=regularization(cfg, classes))


def learning_rates(cfg, world_size: int, steps_per_epoch: int) -> np.ndarray:
    """The learning rate of every optimizer step; `--scale_lr` multiplies the base rate by the world size."""
    base_lr = cfg.lr * world_size if cfg.scale_lr else cfg.lr
    return optim.lr_schedule(cfg.lr_schedule, base_lr, cfg.epochs, steps_per_epoch, cfg.warmup_epochs,
                             cfg.lr_step_size, cfg.lr_gamma, cfg.min_lr)


def micro_batch(cfg, world_size: int) -> int:
    """Each rank's micro-batch: its share of the global batch, split into `--grad_accum_steps`."""
    return plan.micro_batch_size(plan.per_rank_batch(cfg.batch_size, world_size), cfg.grad_accum_steps)


@dataclass(frozen=True)
class StepPlan:
    """What the compiled train step is made of, resolved once for this device and world size.

    Attributes:
        amp_level: O0, O2 or O3 (`auto` resolved for the device); amp_dtype: float16 or bfloat16.
        loss_scale: fixed or dynamic, from `--loss_scale` and what carries float16 gradients.
        grad_compression, topk_ratio, threshold, error_feedback: how gradients cross ranks (engine/reducers.py).
        fusion: `--allreduce_fusion` as parameter indices; () = one fused group; None = auto (buckets by bytes).
        bn_stats: SyncBatchNorm's statistics precision on this device (`precision.bn_stats_precision`).
        accum_steps, micro_batch: micro-batches per optimizer step, and each one's size per rank.
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

    def describe_precision(self) -> str:
        amp = self.amp_level if self.amp_level == "O0" else f"{self.amp_level} {self.amp_dtype}"
        return f"amp {amp} | loss scale {self.loss_scale.describe()}"


def step_plan(cfg, device_target: str, world_size: int) -> StepPlan:
    """The train step's plan on `device_target` (CPU or GPU, resolved) in a job of `world_size` ranks."""
    amp_level = precision.resolve_amp_level(cfg.amp_level, device_target)
    return StepPlan(amp_level, cfg.amp_dtype,
                    precision.loss_scale_plan(cfg.loss_scale, amp_level, cfg.amp_dtype, cfg.grad_compression),
                    cfg.grad_compression, cfg.topk_ratio, cfg.threshold, cfg.error_feedback,
                    _fusion(cfg.allreduce_fusion), cfg.grad_accum_steps, micro_batch(cfg, world_size),
                    precision.bn_stats_precision(device_target))


def _fusion(text: str) -> Optional[Tuple[int, ...]]:
    split = config.fusion_split(text)
    return None if split is None else tuple(split)
