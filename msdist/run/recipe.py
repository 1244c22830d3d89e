"""Is this training recipe right for the device and world size it runs on? MindSpore-free.

One review, shared by the start-up of `msdist.train` (its warnings logged once, by rank 0) and by
`python -m msdist.check --plan` (printed before the job starts), so the two never disagree:

* refused (`check_amp_dtype`): bfloat16 on GPU. MindSpore's GPU Conv2D registers float32 and float16
  kernels only (mindspore-ai/mindspore plugin/device/gpu/kernel/nn/convolution/conv2d_forward_gpu_kernel.cc
  lines 23-30, `Conv2dFwdGpuKernelMod::GetFuncList`, commit 384f67e7), so an O2/O3 bfloat16 ResNet fails
  at kernel selection, after the ranks have started and compiled;
* warned (`recipe_warnings`): a recipe that runs but trains badly. BatchNorm normalizes over each
  rank's own images unless `sync_bn` is on: under 16 images its batch statistics are noise (the
  seed's 32 images over 8 GPUs leave 4), and up to 64 it measured a gap to one card that SyncBN
  closed (the warning gives the figures); a fixed loss scale other than 1 where float16 carries
  gradients stops the run at its first overflow, which a dynamic scale skips instead.
"""
from typing import List, Optional

from msdist.base import launch_env
from msdist.base.errors import ConfigError
from msdist.engine import precision
from msdist.run import options, run_plan

# Below this many images per rank, per-rank BatchNorm statistics are too noisy to train well: the
# smallest per-GPU batch that torchvision's and timm's ResNet recipes use without SyncBatchNorm.
MIN_BN_BATCH = 16
NOISY_BN_COST = "at 2 images per rank a measured run lost 33 accuracy points to one card"
# Up to this many images per rank, per-rank BatchNorm measured a gap to one card that SyncBN closed: the
# paired-seed parity benchmark at 64 (docs/accuracy_parity.md, "Where the gap is"). Above it nothing was
# measured, and published ImageNet recipes train per-GPU BatchNorm over 32 and more to one card's accuracy.
MEASURED_BN_BATCH = 64
MEASURED_BN_COST = ("at 64 images per rank, per-rank BatchNorm measured 1.8 accuracy points below one card (95% CI "
                    "-3.9..+0.3) and a higher test loss on every seed (ResNet-18, 8 epochs, 5 paired seeds; "
                    "docs/accuracy_parity.md); --sync_bn true matched one card there for about 7% of a 2-rank CPU "
                    "step")


def check_amp_dtype(amp_level: str, amp_dtype: str, device_target: str) -> None:
    """Refuse bfloat16 on GPU, where MindSpore has no bfloat16 convolution.

    Args:
        amp_level: the resolved amp level (O0 casts nothing, so any amp_dtype is harmless there).
        amp_dtype: float16 or bfloat16.
        device_target: the resolved device, CPU or GPU.

    Raises:
        ConfigError: bfloat16 at O2/O3 on GPU.
    """
    if device_target == "GPU" and amp_level != "O0" and amp_dtype == "bfloat16":
        raise ConfigError(f"--amp_dtype bfloat16 with amp {amp_level} on GPU: MindSpore 2.10's GPU Conv2D has float32 "
                          "and float16 kernels only; use --amp_dtype float16 (with --loss_scale auto)")


def recipe_warnings(plan: options.StepPlan, *, batch_size: int, world_size: int, sync_bn: bool) -> List[str]:
    """One line per known weakness of this recipe on this device and world size, with numbers and the fix.

    Args:
        plan: the train step's plan (`options.step_plan`): its micro-batch is what each rank's BatchNorm
            normalizes over, its loss scale the resolved one.
    """
    bn = bn_warning(plan, batch_size, world_size) if world_size > 1 and not sync_bn else None
    found = [bn] if bn else []
    # `auto` scales dynamically exactly where float16 carries gradients (engine/precision.py's rule)
    float16_grads = precision.loss_scale_plan("auto", plan.amp_level, plan.amp_dtype, plan.grad_compression).dynamic
    if float16_grads and not plan.loss_scale.dynamic and plan.loss_scale.initial != 1:
        found.append(f"float16 gradients with the fixed loss scale {plan.loss_scale.initial:g}: the run stops at its "
                     "first overflow; use --loss_scale auto (dynamic: an overflowing step is skipped and the scale "
                     "halved)")
    return found


def bn_warning(plan: options.StepPlan, batch_size: int, world_size: int) -> Optional[str]:
    """What per-rank BatchNorm over this micro-batch costs, as measured, and the fix; None above the measured
    range."""
    if plan.micro_batch > MEASURED_BN_BATCH:
        return None
    accum = f" / {plan.accum_steps} micro-batches" if plan.accum_steps > 1 else ""
    seen = f"BatchNorm sees {plan.micro_batch} images per rank (batch_size {batch_size} / {world_size} ranks{accum})"
    if plan.micro_batch < MIN_BN_BATCH:
        return (f"{seen}, under {MIN_BN_BATCH}: its statistics are noise ({NOISY_BN_COST}); raise --batch_size "
                f"to at least {MIN_BN_BATCH * world_size * plan.accum_steps} or pass --sync_bn true")
    return f"{seen}: {MEASURED_BN_COST}"


def review(run: run_plan.RunPlan) -> List[str]:
    """The recipe review of one run: refusals raised, warnings returned (the same at start-up and in --plan).

    Args:
        run: the run plan (`run_plan.resolve`): its world size, resolved device, batch layout and step.

    Raises:
        ConfigError: `check_amp_dtype`.
    """
    step, batch = run.step, run.batch
    check_amp_dtype(step.amp_level, step.amp_dtype, run.device.target)
    # The original job's micro-batches (its batch layout), which a job that changed its world size keeps.
    return layout_warnings(batch, run.world_size, run.model.sync_bn) + \
        recipe_warnings(step, batch_size=batch.global_batch, world_size=batch.slots, sync_bn=run.model.sync_bn)


def layout_warnings(batch: run_plan.BatchPlan, world_size: int, sync_bn: bool) -> List[str]:
    """Where a job that changed its world size cannot train exactly as the original job did: its BatchNorm
    statistics span other images.

    Args:
        batch: the batch layout now (`slots`) and the one the checkpoint recorded (`resumed_slots`, or None).
    """
    found = []
    slots, resumed, accum = batch.slots, batch.resumed_slots, batch.grad_accum_steps
    if resumed is not None and resumed < world_size:
        found.append(f"the run resumed was started for {resumed} rank(s) (its batch slots) and grew to {world_size}: "
                     f"BatchNorm now sees {batch.global_batch // slots // accum} images per micro-batch "
                     f"instead of {batch.global_batch // resumed // accum}, not the original job's "
                     f"training; start a job that may grow with {launch_env.BATCH_SLOTS_VAR} set to the most ranks it "
                     "will have")
    if sync_bn and slots != world_size:
        found.append(f"--sync_bn true with {slots} batch slots on {world_size} rank(s): each micro-batch's BatchNorm "
                     f"statistics span {world_size} slots' images instead of {slots}, not the original job's training")
    return found
