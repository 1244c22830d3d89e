"""`python -m msdist.train --config configs/<x>.yaml [--key value ...]`

One entry point for every launch: standalone, `mpirun -n N`, `msdist.launch -n N`, msrun.
This file is wiring, readable top to bottom; each concern lives in its own module.
"""
import json
import logging
import os
import random
import time

import numpy as np

from msdist import config, distributed, runtime
from msdist.errors import ConfigError, DataError, cli_main

_logger = logging.getLogger("msdist.train")


@cli_main
def main(argv=None) -> int:
    cfg = config.parse(argv)
    launch = distributed.detect_launch()
    rt = runtime.prepare(cfg.verbose, "auto", launch.local_world_size)
    return train(cfg, launch, rt)


def _seed_everything(seed: int) -> None:
    import mindspore as ms
    random.seed(seed)
    np.random.seed(seed)
    ms.set_seed(seed)  # same seed on every rank: identical initial weights without a broadcast


def _check_output_dir(path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".write-test-{os.getpid()}")
        with open(probe, "w", encoding="utf-8"):
            pass
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"output_dir {path!r} is not writable ({e.strerror}); choose another --output_dir") from None


def train(cfg, launch: distributed.LaunchEnv, rt: runtime.RuntimeInfo) -> int:
    # MindSpore loads only here, after runtime.prepare() set the variables it reads when it loads.
    from mindspore import nn

    from models import create_model
    from msdist import checkpoint, engine, monitor, optim
    from msdist.data import pipeline

    if not cfg.data_dir:
        raise ConfigError("data_dir is not set; pass --data_dir DIR (a folder with Training/ and Test/), "
                          "or make demo data with: python -m msdist.data synth DIR")
    if not os.path.isdir(cfg.data_dir):
        raise DataError(f"data_dir {cfg.data_dir!r} does not exist; pass --data_dir pointing at a folder "
                        "with Training/ and Test/")
    _check_output_dir(cfg.output_dir)
    log_dir = os.path.join(cfg.output_dir, "logs")
    dist = distributed.init(launch, cfg.device_target, log_dir, cfg.deterministic)
    monitor.setup_logging(log_dir, dist.rank, console=dist.is_main)
    _seed_everything(cfg.seed)

    classes = pipeline.class_map(cfg.data_dir)
    train_split = pipeline.list_split(cfg.data_dir, pipeline.TRAIN_SPLIT, classes)
    test_split = pipeline.list_split(cfg.data_dir, pipeline.TEST_SPLIT, classes)
    num_classes = cfg.num_classes or len(classes)
    batch = pipeline.per_rank_batch(cfg.batch_size, dist.world_size)
    steps_per_epoch = pipeline.steps_per_epoch(len(train_split), cfg.batch_size)
    if steps_per_epoch == 0:
        raise DataError(f"{len(train_split)} training images cannot fill one global batch of {cfg.batch_size}; "
                        "lower --batch_size")
    workers = cfg.num_workers or rt.threads_per_rank
    _logger.info("world size %d (%s, %s) | global batch %d = %d per rank | %d classes | %d train / %d test images"
                 " | %d steps/epoch | oneDNN ISA %s (%s) | %d threads/rank",
                 dist.world_size, dist.device_target, dist.backend or "standalone", cfg.batch_size, batch,
                 num_classes, len(train_split), len(test_split), steps_per_epoch, rt.cpu_isa, rt.isa_source,
                 rt.threads_per_rank)
    if dist.is_main:
        config.save(cfg, os.path.join(cfg.output_dir, "config.yaml"))

    net = create_model(cfg.model, num_classes, zero_init_last_bn=cfg.zero_init_last_bn)
    if cfg.sync_bn:
        from msdist.layers import convert_sync_batchnorm
        net = convert_sync_batchnorm(net, dist.world_size)
    base_lr = cfg.lr * dist.world_size if cfg.scale_lr else cfg.lr
    lrs = optim.lr_schedule(cfg.lr_schedule, base_lr, cfg.epochs, steps_per_epoch, cfg.warmup_epochs,
                            cfg.lr_step_size, cfg.lr_gamma, cfg.min_lr)
    optimizer = optim.create_optimizer(net.trainable_params(), lrs, cfg.momentum, cfg.weight_decay, cfg.loss_scale)
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    train_step = engine.TrainStep(net, loss_fn, optimizer, cfg.loss_scale,
                                  engine.default_reducer(optimizer.parameters, dist.world_size))
    train_step.set_train(True)
    saved_params = list(net.get_parameters()) + list(optimizer.moments) + [optimizer.global_step]

    collectives = distributed.Collectives(dist.world_size)
    ckpt_dir = os.path.join(cfg.output_dir, "ckpt")
    prefix = cfg.ckpt_prefix or cfg.model
    cfg_hash = config.config_hash(cfg)
    start = checkpoint.resume_state(cfg.resume, ckpt_dir, prefix, dist.rank, collectives, train_step, saved_params, cfg_hash,
                         steps_per_epoch)
    distributed.check_replicas_identical(collectives, net, "at start")

    def save(epoch: int, step: int, global_step: int) -> None:
        distributed.check_replicas_identical(collectives, net, f"at epoch {epoch} step {step}")
        info = checkpoint.save([{"name": p.name, "data": p} for p in saved_params], ckpt_dir, prefix, dist.rank,
                               {"epoch": epoch, "step": step, "global_step": global_step, "config_hash": cfg_hash})
        checkpoint.prune(ckpt_dir, prefix, dist.rank, cfg.keep_checkpoint_max)
        _logger.info("saved %s", info.path)

    def evaluate() -> dict:
        eval_batch = cfg.eval_batch_size or batch
        data = pipeline.build_eval_dataset(test_split, batch_size=eval_batch, image_size=cfg.image_size,
                                           world_size=dist.world_size, rank=dist.rank, workers=workers)
        return engine.evaluate(net, data, eval_batch, collectives)

    progress = monitor.Progress(cfg.epochs, steps_per_epoch, cfg.batch_size, cfg.log_every)
    timer = monitor.StepTimer(images_per_step=cfg.batch_size)
    global_step, last_saved, metrics = start.global_step, start.global_step, None
    train_start = time.perf_counter()
    for epoch in range(start.epoch, cfg.epochs):
        if cfg.max_steps and global_step >= cfg.max_steps:
            break
        skip = start.skip_steps if epoch == start.epoch else 0
        data = pipeline.build_train_dataset(train_split, batch_size=batch, image_size=cfg.image_size, epoch=epoch,
                                            seed=cfg.seed, shuffle=cfg.shuffle, augment=cfg.augment,
                                            padding=cfg.crop_padding, world_size=dist.world_size, rank=dist.rank,
                                            global_batch=cfg.batch_size, workers=workers, skip_steps=skip)
        progress.start_epoch()
        timer.restart_clock()
        step = skip
        for images, labels in data.create_tuple_iterator(num_epochs=1):
            data_s = timer.data_ready()
            loss = float(train_step(images, labels).asnumpy())
            step_s = timer.step_done()
            step += 1
            global_step += 1
            if step % cfg.log_every == 0 or step == steps_per_epoch:
                loss = float(collectives.sum([loss])[0]) / dist.world_size
            progress.step(epoch, step, loss, float(lrs[global_step - 1]), step_s, data_s)
            if cfg.max_steps and global_step >= cfg.max_steps:
                break
        epoch_done = step == steps_per_epoch
        if epoch_done and ((epoch + 1) % cfg.save_every_epochs == 0 or epoch + 1 == cfg.epochs):
            save(epoch + 1, step, global_step)
            last_saved = global_step
        if epoch_done and cfg.eval_every_epochs and (epoch + 1) % cfg.eval_every_epochs == 0 \
                and epoch + 1 < cfg.epochs:
            metrics = evaluate()
            _logger.info("epoch %d eval accuracy %.4f (%d samples)", epoch + 1, metrics["accuracy"],
                         metrics["num_samples"])
    train_seconds = time.perf_counter() - train_start
    if global_step != last_saved:
        save(epoch + 1, step, global_step)

    metrics = evaluate()
    result = {"accuracy": metrics["accuracy"], "num_samples": metrics["num_samples"], "correct": metrics["correct"],
              "loss": metrics["loss"], "world_size": dist.world_size, "epochs": cfg.epochs,
              "global_steps": global_step, "global_batch": cfg.batch_size, "per_rank_batch": batch,
              "train_seconds": round(train_seconds, 3), "images_per_sec": round(timer.images_per_sec(), 3),
              "first_step_seconds": round(timer.first_step_s or 0.0, 3), "model": cfg.model,
              "device_target": dist.device_target}
    if dist.is_main:
        print(f"eval result: {{'accuracy': {metrics['accuracy']:.4f}}}", flush=True)
        with open(os.path.join(cfg.output_dir, "result.json"), "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
