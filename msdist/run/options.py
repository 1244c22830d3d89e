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

from msdist.base.errors import ConfigError
from msdist.base.launch_env import BATCH_SLOTS_VAR, RESUME_FROM_RANK0_VAR
from msdist.data import augment, pipeline, plan
from msdist.engine import jit, precision
from msdist.run import checkpoint_model, chunks, config, hardware, profiler, stragglers


def num_classes(requested: int, classes: Dict[str, int]) -> int:
    """`--num_classes` (`requested`), or 0 = as many as Training/ has class folders."""
    return requested or len(classes)


def workers(requested: int, threads_per_rank: int) -> int:
    """Dataset workers per rank: `--num_workers` (`requested`), or 0 = this rank's share of the host's cores
    (`runtime.RuntimeInfo.threads_per_rank`)."""
    return requested or threads_per_rank


def eval_batch(cfg, per_rank_batch: int) -> int:
    """Per-rank evaluation batch: `--eval_batch_size`, or 0 = the per-rank training batch."""
    return cfg.eval_batch_size or per_rank_batch


def regularization(cfg, classes: int) -> augment.Regularization:
    """The training options beyond crop and flip (crop ranges already checked by `config.parse`)."""
    return augment.Regularization(cfg.train_crop, (cfg.crop_scale_min, cfg.crop_scale_max),
                                  (cfg.crop_ratio_min, cfg.crop_ratio_max), cfg.color_jitter, cfg.mixup, cfg.cutmix,
                                  cfg.label_smoothing, classes)


def profile_window(cfg) -> Optional[profiler.ProfileWindow]:
    """`--profile_steps A:B` on `--profile_ranks` (both checked by `config.parse`); None when off."""
    steps = profiler.parse_steps(cfg.profile_steps)
    return profiler.ProfileWindow(*steps, profiler.parse_ranks(cfg.profile_ranks)) if steps else None


def straggler_rule(cfg) -> stragglers.StragglerRule:
    """`--straggler_margin` (0 = off) and `--straggler_windows`."""
    return stragglers.StragglerRule(cfg.straggler_margin, cfg.straggler_windows)


def checkpoint_place(cfg) -> Tuple[str, str]:
    """(directory, prefix) of this run's checkpoints."""
    return os.path.join(cfg.output_dir, "ckpt"), cfg.ckpt_prefix or cfg.model


def resumed_slots(cfg, world_size: int) -> Optional[int]:
    """The batch slots recorded by the run `--resume` continues (`checkpoint_model.recorded_slots`, from rank 0's
    newest checkpoint, so every rank reads the same); None for a fresh start."""
    source = checkpoint_model.resume_source(cfg.resume, *checkpoint_place(cfg), 0)
    return checkpoint_model.recorded_slots(source, world_size) if source else None


def slots_for(recorded: Optional[int], world_size: int, environ: Mapping[str, str]) -> int:
    """How many slots the job's global batch is cut into (`plan.BatchLayout`): the layout of the original job.

    Resuming (`recorded`: what the checkpoint recorded, `resumed_slots`; None for a fresh start), the checkpoint's;
    on more ranks than that (a job grown past the ranks it was started for), one per rank, as BatchNorm's
    micro-batches cannot be kept (`recipe.review` warns). Fresh, `MSDIST_BATCH_SLOTS` (`launch_env.BATCH_SLOTS_VAR`,
    set by a launcher that may shrink the job later), else the world size.

    Raises:
        ConfigError: MSDIST_BATCH_SLOTS is not a whole number of at least the world size.
    """
    if recorded is not None:
        return max(recorded, world_size)
    text = environ.get(BATCH_SLOTS_VAR, "")
    if not text:
        return world_size
    if not text.isdigit() or int(text) < world_size:
        raise ConfigError(f"{BATCH_SLOTS_VAR}={text!r}: the batch layout needs a whole number of slots of at least "
                          f"the world size {world_size}; set it to the most ranks the job may have, or unset it")
    return int(text)


def resume_from_rank0(environ: Mapping[str, str]) -> bool:
    """Whether `--resume auto` restores rank 0's newest good checkpoint on every rank whatever the ranks' own files
    say: an elastic job's (`launch_env.RESUME_FROM_RANK0_VAR`, set by msdist.launch --nnodes MIN:MAX)."""
    return bool(environ.get(RESUME_FROM_RANK0_VAR))


def batch_layout(cfg, slots: int, world_size: int, rank: int) -> plan.BatchLayout:
    """This rank's part of every global batch (slots from `slots_for`).

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


def micro_batch(cfg, slots: int) -> int:
    """The micro-batch: a slot (one original rank's share of the global batch), split into `--grad_accum_steps`."""
    return plan.micro_batch_size(plan.per_rank_batch(cfg.batch_size, slots), cfg.grad_accum_steps)


@dataclass(frozen=True)
class StepPlan:
    """What the compiled train step is made of, resolved once for this device and world size.

    Attributes:
        amp_level: O0, O2 or O3 (`auto` resolved for the device); amp_dtype: float16 or bfloat16.
        loss_scale: fixed or dynamic, from `--loss_scale` and what carries float16 gradients.
        grad_compression, topk_ratio, threshold, error_feedback: how gradients cross ranks (engine/reducers.py).
        fusion: `--allreduce_fusion` as parameter indices; () = one fused group; None = auto (buckets by bytes).
        bn_stats: SyncBatchNorm's statistics precision on this device (`precision.bn_stats_precision`).
        accum_steps, micro_batch: micro-batches per batch slot and optimizer step (`--grad_accum_steps`), and each
            one's size. A rank owning k slots runs k x accum_steps of them, and its gradient scale follows
            (`plan.BatchLayout.micro_steps`, `gradient_scale`): the only part of the step that depends on the rank.
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
    jit_level: str = "O0"

    def describe_precision(self) -> str:
        amp = self.amp_level if self.amp_level == "O0" else f"{self.amp_level} {self.amp_dtype}"
        return f"amp {amp} | loss scale {self.loss_scale.describe()} | jit_level {self.jit_level}"


def step_plan(cfg, device_target: str, slots: int) -> StepPlan:
    """The train step's plan on `device_target` (CPU or GPU, resolved) for a global batch cut into `slots`."""
    amp_level = precision.resolve_amp_level(cfg.amp_level, device_target)
    return StepPlan(amp_level, cfg.amp_dtype,
                    precision.loss_scale_plan(cfg.loss_scale, amp_level, cfg.amp_dtype, cfg.grad_compression),
                    cfg.grad_compression, cfg.topk_ratio, cfg.threshold, cfg.error_feedback,
                    _fusion(cfg.allreduce_fusion), cfg.grad_accum_steps, micro_batch(cfg, slots),
                    precision.bn_stats_precision(device_target), jit.resolve_jit_level(cfg.jit_level, device_target))


def sink_size(cfg, device_target: str, slots: int, world_size: int) -> int:
    """K, the optimizer steps per host call (`--sink_size`, `chunks.resolve_size`): the same on every rank, whose
    chunk ends are the job's collectives (the stop check)."""
    return chunks.resolve_size(cfg.sink_size, device_target, slots != world_size, cfg.log_every,
                               cfg.save_every_steps)


def sunk_step_forecast(cfg, device_target: str, amp_level: str, batch, world_size: int,
                       gpu_name: str) -> Optional[float]:
    """This rank's forecast of one sunk step in seconds (`hardware.sunk_step_seconds`, its share of the global
    batch at `amp_level` (resolved) on the GPU named `gpu_name`; 0 for a GPU the tables do not hold), where
    `--sink_size auto` sinks steps (GPU, one batch slot per rank, the same on every rank); elsewhere None."""
    if cfg.sink_size != chunks.AUTO or device_target != "GPU" or batch.slots != world_size:
        return None
    step_s = hardware.sunk_step_seconds(gpu_name, cfg.model, hardware.precision_of(amp_level), cfg.image_size,
                                        batch.global_batch // world_size)
    return step_s or 0.0


def _fusion(text: str) -> Optional[Tuple[int, ...]]:
    split = config.fusion_split(text)
    return None if split is None else tuple(split)
