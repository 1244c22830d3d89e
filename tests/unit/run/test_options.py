"""run/options.py: the options resolved once into what data/ and engine/ take."""
import numpy as np
import pytest

from msdist.base import launch_env
from msdist.base.errors import ConfigError, DataError
from msdist.data import pipeline, plan
from msdist.data.augment import Regularization
from msdist.engine import optim
from conftest import plan_on
from msdist.run import config, options, run_plan


def test_every_derived_value_falls_back_only_when_its_option_is_zero():
    classes = {"apple": 0, "lemon": 1, "mango": 2}
    derived, given = config.parse([]), config.parse(["--num_classes", "7", "--num_workers", "3",
                                                     "--eval_batch_size", "5"])

    class Runtime:
        threads_per_rank = 2
    threads = Runtime.threads_per_rank
    assert (options.num_classes(derived.num_classes, classes), options.workers(derived.num_workers, threads),
            options.eval_batch(derived, 8)) == (3, 2, 8)
    assert (options.num_classes(given.num_classes, classes), options.workers(given.num_workers, threads),
            options.eval_batch(given, 8)) == (7, 3, 5)


def test_train_input_is_this_rank_s_share_with_the_options_it_names():
    cfg = config.parse(["--batch_size", "16", "--image_size", "40", "--seed", "9", "--shuffle", "false",
                        "--crop_padding", "2", "--train_crop", "random_resized", "--crop_scale_min", "0.3",
                        "--mixup", "0.2", "--label_smoothing", "0.1"])
    spec = options.train_input(cfg, plan.BatchLayout(2, 2, 1), workers_per_rank=3, classes=4)
    assert spec == pipeline.TrainInput(image_size=40, global_batch=16, seed=9, shuffle=False, augment=True, padding=2,
                                       workers=3, layout=plan.BatchLayout(2, 2, 1), regularization=Regularization(
                                           "random_resized", (0.3, 1.0), (0.75, 4 / 3), 0.0, 0.2, 0.0, 0.1, 4),
                                       device_normalizes=True)   # the train step normalizes uint8 pixels
    assert spec.batch_size == 8 and not spec.pixels_out   # mixup blends floats on the host
    with pytest.raises(DataError, match="must divide evenly over 3 ranks"):
        options.train_input(cfg, plan.BatchLayout(3, 3, 0), workers_per_rank=1, classes=4).batch_size


def test_learning_rates_scale_by_the_world_size_only_with_scale_lr():
    plain, scaled = config.parse(["--lr", "0.1", "--epochs", "2"]), config.parse(["--lr", "0.1", "--epochs", "2",
                                                                                  "--scale_lr", "true"])
    np.testing.assert_array_equal(_rates(plain, 4, 3), optim.lr_schedule("constant", 0.1, 2, 3))
    np.testing.assert_array_equal(_rates(scaled, 4, 3), optim.lr_schedule("constant", 0.4, 2, 3))


def _rates(cfg, slots: int, steps_per_epoch: int):
    return plan_on(cfg, slots, "CPU").schedule.lr.every_step(steps_per_epoch)


def test_micro_batch_splits_the_rank_s_share_or_refuses_before_mindspore_loads():
    assert options.micro_batch(config.parse(["--batch_size", "16", "--grad_accum_steps", "4"]), 2) == 2
    with pytest.raises(ConfigError, match="grad_accum_steps 3"):
        options.micro_batch(config.parse(["--batch_size", "16", "--grad_accum_steps", "3"]), 2)


def test_step_plan_resolves_precision_for_the_device_and_names_the_step_s_options():
    cpu = options.step_plan(config.parse(["--batch_size", "16", "--grad_accum_steps", "2"]), "CPU", 2)
    assert (cpu.amp_level, cpu.loss_scale.dynamic, cpu.fusion, cpu.accum_steps, cpu.micro_batch) == ("O0", False, None,
                                                                                                       2, 4)
    assert cpu.describe_precision().startswith("amp O0 | loss scale fixed 1, no per-step overflow check")
    gpu = options.step_plan(config.parse(["--grad_compression", "fp16", "--allreduce_fusion", "85,160"]), "GPU", 1)
    assert (gpu.amp_level, gpu.loss_scale.dynamic, gpu.grad_compression, gpu.fusion) == ("O2", True, "fp16",
                                                                                         (85, 160))


def test_eval_refuses_a_global_batch_the_ranks_cannot_share_before_mindspore_loads():
    from msdist.run import startup
    assert startup.check_per_rank_batch in startup.EVAL_CHECKS
    with pytest.raises(DataError, match="must divide evenly over 3 ranks"):
        startup.check_per_rank_batch(config.parse(["--batch_size", "16"]), 3)


def test_a_frozen_backbone_with_cross_rank_batchnorm_is_refused_by_every_launcher_s_pre_check():
    from msdist import launch
    from msdist.run import startup
    frozen_sync = ["--freeze_backbone", "true", "--sync_bn", "true"]
    with pytest.raises(ConfigError, match="--freeze_backbone true and --sync_bn true"):
        launch.parse_args(["-n", "2"] + frozen_sync)
    startup.check_frozen_backbone(config.parse(frozen_sync), 1)   # one rank: sync_bn keeps plain BatchNorm


def _run_with_checkpoints(tmp_path, ranks, batch_slots=None):
    """An output folder whose ckpt/ holds `ranks` ranks' epoch-1 checkpoints (sidecars, as listing reads them);
    `batch_slots` None: written before the layout was recorded."""
    import json
    import os
    directory = tmp_path / "ckpt"
    os.makedirs(directory)
    meta = {"model": "resnet_tiny"} if batch_slots is None else {"model": "resnet_tiny", "batch_slots": batch_slots}
    for rank in range(ranks):
        path = directory / f"resnet_tiny_rank{rank}-1_12.ckpt"
        path.write_bytes(b"")
        sidecar = {"sha256": "0", "epoch": 1, "step": 12, "global_step": 12, "config_hash": "h", "meta": meta}
        (directory / f"{path.name}.json").write_text(json.dumps(sidecar))
    return config.parse(["--model", "resnet_tiny", "--output_dir", str(tmp_path), "--resume", "auto"])


# (ranks that wrote the checkpoint, its recorded slots, world size now, MSDIST_BATCH_SLOTS) -> slots
RESUMED_SLOTS = [
    (2, 2, 1, "", 2),      # shrunk: the checkpoint's layout
    (1, 2, 2, "", 2),      # grown back to the slots it was started for
    (2, 4, 3, "8", 4),     # the checkpoint wins over the launcher's variable
    (2, None, 1, "", 2),   # written before the layout was recorded: the ranks that wrote it
    (1, None, 2, "", 2),   # ... but never fewer than the ranks now
    (1, 1, 2, "", 2),      # grown past its slots: one per rank (recipe.review warns)
]


@pytest.mark.parametrize("writers,recorded,world,variable,slots", RESUMED_SLOTS)
def test_a_resumed_job_keeps_the_batch_slots_of_its_checkpoint(tmp_path, writers, recorded, world, variable, slots):
    cfg = _run_with_checkpoints(tmp_path, writers, recorded)
    assert run_plan.resolve_batch(cfg, world, {launch_env.BATCH_SLOTS_VAR: variable}).slots == slots


def test_a_fresh_job_takes_its_slots_from_the_launcher_or_its_world_size(tmp_path):
    cfg = config.parse(["--output_dir", str(tmp_path), "--resume", "auto"])   # nothing to resume yet
    assert run_plan.resolve_batch(cfg, 2, {}).slots == 2
    assert run_plan.resolve_batch(cfg, 2, {launch_env.BATCH_SLOTS_VAR: "4"}).slots == 4
    for bad in ("1", "two", "-4"):
        with pytest.raises(ConfigError, match=f"{launch_env.BATCH_SLOTS_VAR}='{bad}'"):
            run_plan.resolve_batch(cfg, 2, {launch_env.BATCH_SLOTS_VAR: bad})


def test_the_batch_layout_is_said_once_and_shapes_the_step_and_the_schedule():
    cfg = config.parse(["--batch_size", "16", "--lr", "0.1", "--scale_lr", "true", "--epochs", "1"])
    layout = options.batch_layout(cfg, 4, 3, 0)
    run = plan_on(cfg, 3, "CPU", {launch_env.BATCH_SLOTS_VAR: "4"})
    assert run.batch.describe(layout) == ("batch layout: 4 slots of 4 images on 3 rank(s): 2 or 1 "
                                          "micro-batches per step, global batch 16 as the original job")
    assert run.batch.describe(options.batch_layout(cfg, 2, 2, 0)) == ""
    step = run.step
    # A rank owning two of the slots runs each slot's micro-batches twice, its gradients scaled to match.
    assert (layout.micro_steps(step.accum_steps), step.micro_batch, layout.gradient_scale(step.accum_steps)) == \
        (2, 4, 3 / 4)
    # --scale_lr scales by the original job's ranks (its slots), whatever the world size now.
    np.testing.assert_array_equal(run.schedule.lr.every_step(3), optim.lr_schedule("constant", 0.4, 1, 3))
    with pytest.raises(ConfigError, match="--sync_bn true with a batch layout of 4 slots on 3 ranks"):
        options.batch_layout(config.parse(["--sync_bn", "true"]), 4, 3, 1)
