"""The recipe review (msdist/run/recipe.py): refusals and warnings, as tables; and `--plan` saying the same."""
import os

import pytest

from conftest import REPO, plan_on
from msdist.base.errors import ConfigError
from msdist.engine import precision
from msdist.run import config, options, recipe, run_plan


SEED_CONFIG = os.path.join(REPO, "configs", "resnet50_fruits360.yaml")


def _warnings(batch_size=1024, world_size=8, grad_accum_steps=1, sync_bn=False, amp_level="O2", amp_dtype="float16",
              loss_scale="auto", grad_compression="none"):
    scale = precision.loss_scale_plan(loss_scale, amp_level, amp_dtype, grad_compression)
    plan = options.StepPlan(amp_level, amp_dtype, scale, grad_compression, 0.01, 1e-3, True, (), grad_accum_steps,
                            batch_size // world_size // grad_accum_steps, "float32")
    return recipe.recipe_warnings(plan, batch_size=batch_size, world_size=world_size, sync_bn=sync_bn)


@pytest.mark.parametrize("case, warned", [
    (dict(), False),                                              # the GPU recipe: 128 per rank
    (dict(batch_size=32), True),                                  # the seed on 8 GPUs: 4 per rank
    (dict(batch_size=128), True),                                 # 16 per rank: the measured gap's range
    (dict(batch_size=512), True),                                 # 64 per rank: where the gap was measured
    (dict(batch_size=520), False),                                # 65 per rank: past the measured range
    (dict(batch_size=120), True),                                 # 15 per rank
    (dict(batch_size=256, grad_accum_steps=4), True),             # 32 per rank, 8 per micro-batch
    (dict(batch_size=1024, grad_accum_steps=4), True),            # 128 per rank, 32 per micro-batch
    (dict(batch_size=32, sync_bn=True), False),                   # statistics over the global batch
    (dict(batch_size=4, world_size=1), False),                    # one rank: its batch is the global batch
])
def test_bn_batch_warning(case, warned):
    lines = [w for w in _warnings(**case) if w.startswith("BatchNorm")]
    assert len(lines) == int(warned), lines


def test_bn_warning_names_the_numbers_and_both_fixes():
    (line,) = _warnings(batch_size=256, grad_accum_steps=4)
    assert line == ("BatchNorm sees 8 images per rank (batch_size 256 / 8 ranks / 4 micro-batches), under 16: its "
                    f"statistics are noise ({recipe.NOISY_BN_COST}); raise --batch_size to at least 512 or pass "
                    "--sync_bn true")


def test_bn_warning_between_16_and_64_images_gives_the_measured_gap_and_what_sync_bn_costs():
    (line,) = _warnings(batch_size=128, world_size=2)
    assert line == f"BatchNorm sees 64 images per rank (batch_size 128 / 2 ranks): {recipe.MEASURED_BN_COST}"
    assert "--sync_bn true" in recipe.MEASURED_BN_COST and "of a 2-rank CPU step" in recipe.MEASURED_BN_COST
    assert _warnings(batch_size=130, world_size=2) == []  # 65 per rank


@pytest.mark.parametrize("case, warned", [
    (dict(loss_scale=1024.0), True),                              # O2 float16, fixed 1024: stops at first overflow
    (dict(loss_scale=1.0), False),                                # a fixed 1 is no scaling
    (dict(loss_scale="dynamic"), False),
    (dict(loss_scale="auto"), False),                             # auto = dynamic under float16
    (dict(loss_scale=1024.0, amp_level="O0"), False),             # float32: no float16 gradient to overflow
    (dict(loss_scale=1024.0, amp_level="O0", grad_compression="fp16"), True),  # float16 exchange at O0
    (dict(loss_scale=1024.0, amp_dtype="bfloat16"), False),       # bfloat16 has float32's range
    (dict(loss_scale=1024.0, amp_level="O3"), True),
])
def test_fixed_scale_under_float16_warning(case, warned):
    lines = [w for w in _warnings(**case) if w.startswith("float16")]
    assert len(lines) == int(warned), lines


@pytest.mark.parametrize("amp_level, amp_dtype, device, refused", [
    ("O2", "bfloat16", "GPU", True),
    ("O3", "bfloat16", "GPU", True),
    ("O0", "bfloat16", "GPU", False),   # O0 casts nothing
    ("O2", "float16", "GPU", False),
    ("O2", "bfloat16", "CPU", False),   # CPU runs it (slowly: docs/performance.md), MindSpore's CPU casts around it
])
def test_bfloat16_on_gpu_is_refused_with_the_reason(amp_level, amp_dtype, device, refused):
    if not refused:
        recipe.check_amp_dtype(amp_level, amp_dtype, device)
        return
    with pytest.raises(ConfigError, match=r"GPU Conv2D has float32 and float16 kernels only; use --amp_dtype float16"):
        recipe.check_amp_dtype(amp_level, amp_dtype, device)


def test_review_resolves_amp_auto_per_device():
    cfg = config.parse(["--config", SEED_CONFIG, "--amp_dtype", "bfloat16"])
    with pytest.raises(ConfigError):
        recipe.review(plan_on(cfg, 1, "GPU"))   # auto = O2 on GPU
    assert recipe.review(plan_on(cfg, 1, "CPU")) == []  # auto = O0 on CPU


@pytest.mark.parametrize("world,slots,resumed,sync_bn,expected", [
    (2, 2, None, False, []),
    (1, 2, 2, True, ["--sync_bn true with 2 batch slots on 1 rank(s)"]),   # shrunk: each micro-batch spans 1 slot
    (2, 2, 1, False, ["the run resumed was started for 1 rank(s) (its batch slots) and grew to 2: BatchNorm now "
                      "sees 8 images per micro-batch instead of 16"]),
])
def test_a_changed_world_size_warns_where_batchnorm_sees_other_images(world, slots, resumed, sync_bn, expected):
    batch = run_plan.BatchPlan(global_batch=16, slots=slots, resumed_slots=resumed, grad_accum_steps=1,
                               micro_batch=16 // slots, eval_batch=16 // slots)
    found = recipe.layout_warnings(batch, world, sync_bn)
    assert len(found) == len(expected) and all(w.startswith(e) for w, e in zip(found, expected)), found
