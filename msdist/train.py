"""`python -m msdist.train --config configs/<x>.yaml [--key value ...]`

One entry point for every launch: standalone, `mpirun -n N`, `msdist.launch -n N`, msrun.
This file is wiring, readable top to bottom; each concern lives in its own module.
"""
import json
import logging
import os
import random
import tempfile
import time

import numpy as np

from msdist import config, distributed, heartbeat, runtime
from msdist.errors import ConfigError, DataError, cli_main

_logger = logging.getLogger("msdist.train")
_PROCESS_START = time.perf_counter()  # for result.json's start-to-first-step figure


@cli_main
def main(argv=None) -> int:
    cfg = config.parse(argv)
    launch = distributed.detect_launch()
    from msdist.data import pipeline
    # Fail on these before the slow cluster start-up and before MindSpore loads.
    pipeline.per_rank_batch(cfg.batch_size, launch.world_size)
    pipeline.check_data_dir(cfg.data_dir)
    cache = ""
    if cfg.compile_cache:
        # max_steps does not shape the graph: a resume that trains further must find the cache warm.
        graph_options = [o for o in config.TRAIN_OPTIONS if o.name != "max_steps"]
        cache = runtime.compile_cache_dir(cfg.output_dir, config.config_hash(cfg, graph_options), launch.world_size,
                                          cfg.num_classes or len(pipeline.class_map(cfg.data_dir)), cfg.device_target)
    rt = runtime.prepare(cfg.verbose, cfg.cpu_isa, launch.local_world_size, local_rank=launch.local_rank,
                         rank=launch.rank, bind_cores=cfg.bind_cores, compile_cache=cache,
                         device_target=cfg.device_target)
    return runtime.exit_without_teardown(train(cfg, launch, rt))


def _reached(max_steps: int, global_step: int) -> bool:
    """Whether `--max_steps` (0 = no limit) stops training at this optimizer step."""
    return bool(max_steps) and global_step >= max_steps


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


def _claim_output_dir(path: str, resume: str, overwrite: bool, is_main: bool):
    """Refuse to mix a new run into another run's checkpoints; with `overwrite`, move that run aside.

    Nothing is deleted: the old run's results (ckpt/, config.yaml, result.json, metrics...) move to
    `{path}/replaced-<time>/`, so the new run's checkpoints can neither collide with the old ones nor
    get them pruned. logs/ (files append) and compile_cache/ (keyed by config) stay. Every rank
    decides alike; only the main rank moves files.

    Returns:
        The folder the old run was moved to, or None.
    """
    ckpt_dir = os.path.join(path, "ckpt")
    old = [n for n in os.listdir(ckpt_dir) if not n.startswith(".")] if os.path.isdir(ckpt_dir) else []
    if not old or resume:
        return None
    if not overwrite:
        raise ConfigError(f"output_dir {path!r} holds another run's checkpoints ({len(old)} files in ckpt/); "
                          "pass --resume auto to continue that run, --overwrite true to start a new one (the old "
                          "run is moved aside, not deleted), or choose another --output_dir")
    if not is_main:
        return None
    archive = tempfile.mkdtemp(prefix=f"replaced-{time.strftime('%Y%m%d-%H%M%S')}-", dir=path)
    for name in os.listdir(path):
        if not (name.startswith((".", "replaced-")) or name in ("logs", "compile_cache")):
            os.rename(os.path.join(path, name), os.path.join(archive, name))
    return archive


def train(cfg, launch: distributed.LaunchEnv, rt: runtime.RuntimeInfo) -> int:
    from msdist.data import check as data_check
    from msdist.data import pipeline

    _check_output_dir(cfg.output_dir)
    replaced = _claim_output_dir(cfg.output_dir, cfg.resume, cfg.overwrite, launch.rank == 0)
    # MindSpore loads only here (path errors stay fast), after runtime.prepare() set its variables.
    import mindspore as ms
    from mindspore import nn

    from msdist import checkpoint, comm, engine, loss_scale, monitor, optim, precision
    from msdist.eval import evaluate_split

    log_dir = os.path.join(cfg.output_dir, "logs")
    # Beats from before cluster init, so msdist.launch can tell a rank stuck there from a slow one.
    beat = heartbeat.Heartbeat(log_dir, launch.rank).start()
    dist = distributed.init(launch, cfg.device_target, log_dir, cfg.deterministic)
    runtime.configure_mindspore(rt)
    monitor.setup_logging(log_dir, dist.rank, console=dist.is_main)
    if replaced:
        _logger.warning("overwrite: moved the previous run in %s to %s", cfg.output_dir, replaced)
    _seed_everything(cfg.seed)

    collectives = distributed.Collectives(dist.world_size)
    # Rank 0 decodes every image once per tree state (cached); all ranks then leave out the same files.
    excluded = data_check.shared_exclusions(cfg.data_dir, cfg.bad_images == "skip", dist.is_main, collectives)
    classes = pipeline.class_map(cfg.data_dir)
    train_split = pipeline.list_split(cfg.data_dir, pipeline.TRAIN_SPLIT, classes, exclude=excluded)
    test_split = pipeline.list_split(cfg.data_dir, pipeline.TEST_SPLIT, classes, exclude=excluded)
    num_classes = cfg.num_classes or len(classes)
    batch = pipeline.per_rank_batch(cfg.batch_size, dist.world_size)
    steps_per_epoch = pipeline.steps_per_epoch(len(train_split), cfg.batch_size)
    if steps_per_epoch == 0:
        raise DataError(f"{len(train_split)} training images cannot fill one global batch of {cfg.batch_size}; "
                        "lower --batch_size")
    workers = cfg.num_workers or rt.threads_per_rank
    amp_level = precision.resolve_amp_level(cfg.amp_level, dist.device_target)
    precision.warn_if_no_speedup(cfg.amp_level, dist.device_target)
    scale_plan = precision.loss_scale_plan(cfg.loss_scale, amp_level, cfg.amp_dtype, cfg.grad_compression)
    _logger.info("world size %d (%s, %s) | global batch %d = %d per rank | %d classes | %d train / %d test images"
                 " | %d steps/epoch (%d left over) | %s | amp %s | loss scale %s",
                 dist.world_size, dist.device_target, dist.backend or "standalone", cfg.batch_size, batch,
                 num_classes, len(train_split), len(test_split), steps_per_epoch,
                 len(train_split) - steps_per_epoch * cfg.batch_size, rt.summary(),
                 amp_level if amp_level == "O0" else f"{amp_level} {cfg.amp_dtype}", scale_plan.describe())
    if dist.is_main:
        config.save(cfg, os.path.join(cfg.output_dir, "config.yaml"))

    net = engine.build_network(cfg.model, num_classes, cfg.zero_init_last_bn, cfg.sync_bn, dist.world_size)
    net = engine.mixed_precision(net, amp_level, cfg.amp_dtype)
    base_lr = cfg.lr * dist.world_size if cfg.scale_lr else cfg.lr
    lrs = optim.lr_schedule(cfg.lr_schedule, base_lr, cfg.epochs, steps_per_epoch, cfg.warmup_epochs,
                            cfg.lr_step_size, cfg.lr_gamma, cfg.min_lr)
    optimizer = optim.create_optimizer(net.trainable_params(), lrs, cfg.momentum, cfg.weight_decay)
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    engine.split_allreduce_fusion(config.fusion_split(cfg.allreduce_fusion), len(optimizer.parameters),
                                  dist.world_size)
    reducer = comm.create_reducer(cfg.grad_compression, optimizer.parameters, dist.world_size,
                                  topk_ratio=cfg.topk_ratio, threshold=cfg.threshold,
                                  error_feedback=cfg.error_feedback)
    scaler = loss_scale.LossScaler(scale_plan, dist.world_size)
    # batch_size stays the global batch of one optimizer step; accumulation splits each rank's share.
    micro_batch = comm.micro_batch_size(batch, cfg.grad_accum_steps)
    if cfg.grad_accum_steps > 1:
        train_step = comm.AccumulatingTrainStep(net, loss_fn, optimizer, scaler, reducer,
                                                cfg.grad_accum_steps)
    else:
        train_step = engine.TrainStep(net, loss_fn, optimizer, scaler, reducer)
    _logger.info("gradients: %s | %d micro-batch(es) of %d per rank per optimizer step", cfg.grad_compression,
                 cfg.grad_accum_steps, micro_batch)
    train_step.set_train(True)
    compile_start = time.perf_counter()
    with runtime.compile_cache_scope(rt):  # compiled ahead of the first batch, so a restart can load it
        train_step.compile(ms.Tensor(shape=(micro_batch, 3, cfg.image_size, cfg.image_size), dtype=ms.float32),
                           ms.Tensor(shape=(micro_batch,), dtype=ms.int32))
    compile_seconds = time.perf_counter() - compile_start
    _logger.info("train step compiled in %.1f s", compile_seconds)
    saved_params = list(net.get_parameters()) + list(optimizer.moments) + [optimizer.global_step] + \
        comm.residuals(reducer) + loss_scale.state_params(scaler)  # per-rank residuals; the loss scale

    ckpt_dir = os.path.join(cfg.output_dir, "ckpt")
    prefix = cfg.ckpt_prefix or cfg.model
    cfg_hash = config.config_hash(cfg)
    start = checkpoint.resume_state(cfg.resume, ckpt_dir, prefix, dist.rank, collectives, train_step,
                                    saved_params, cfg_hash, steps_per_epoch)
    distributed.check_replicas_identical(collectives, net, "at start")

    def save(epoch: int, step: int, global_step: int) -> None:
        distributed.check_replicas_identical(collectives, net, f"at epoch {epoch} step {step}")
        info = checkpoint.save([{"name": p.name, "data": p} for p in saved_params], ckpt_dir, prefix, dist.rank,
                               {"epoch": epoch, "step": step, "global_step": global_step, "config_hash": cfg_hash})
        checkpoint.prune(ckpt_dir, prefix, dist.rank, cfg.keep_checkpoint_max)
        _logger.info("saved %s", info.path)

    def evaluate() -> dict:
        return evaluate_split(net, test_split, batch_size=cfg.eval_batch_size or batch, image_size=cfg.image_size,
                              dist=dist, workers=workers, collectives=collectives)

    progress = monitor.Progress(cfg.epochs, steps_per_epoch, cfg.batch_size, cfg.log_every, cfg.max_steps,
                                bar=monitor.terminal(dist.is_main, launch.kind))
    writer = monitor.open_metrics(dist.is_main, cfg.output_dir, cfg.tensorboard, dist.world_size, start.global_step)
    timer = monitor.StepTimer(images_per_step=cfg.batch_size)
    poison_step = loss_scale.test_overflow_step(dist.rank)
    losses = engine.LossAccumulator()
    global_step, last_saved, metrics = start.global_step, start.global_step, None
    train_start = time.perf_counter()
    for epoch in range(start.epoch, cfg.epochs):
        if _reached(cfg.max_steps, global_step):
            break  # resumed from a run that already reached max_steps
        skip = start.skip_steps if epoch == start.epoch else 0
        data = pipeline.build_train_dataset(train_split, batch_size=batch, image_size=cfg.image_size, epoch=epoch,
                                            seed=cfg.seed, shuffle=cfg.shuffle, augment=cfg.augment,
                                            padding=cfg.crop_padding, world_size=dist.world_size, rank=dist.rank,
                                            global_batch=cfg.batch_size, workers=workers, skip_steps=skip)
        progress.start_epoch(epoch, skip)
        timer.restart_clock()
        step = skip
        for images, labels in data.create_tuple_iterator(num_epochs=1):
            loss_scale.poison_for(scaler, poison_step, global_step + 1)  # test hook; no-op unless asked
            data_s = timer.data_ready()
            losses.add(train_step.train_on(images, labels))
            step += 1
            global_step += 1
            loss = None
            if progress.is_log_step(step, global_step):  # the only host sync: it waits for the queued steps
                loss = float(collectives.sum([losses.read()])[0]) / dist.world_size
            step_s = timer.step_done()
            if loss is not None:
                step_s, data_s = timer.take_window()
            record = progress.step(step, global_step, loss, float(lrs[global_step - 1]), step_s, data_s)
            if writer is not None and record is not None:
                writer.write(record)
            beat.update(epoch + 1, step, global_step)
            if _reached(cfg.max_steps, global_step):
                break
        epoch_done = step == steps_per_epoch
        if epoch_done and ((epoch + 1) % cfg.save_every_epochs == 0 or epoch + 1 == cfg.epochs):
            save(epoch + 1, step, global_step)
            last_saved = global_step
        # The last epoch's evaluation is the final one, so its epoch summary can show it.
        metrics = None
        if epoch_done and (epoch + 1 == cfg.epochs
                           or cfg.eval_every_epochs and (epoch + 1) % cfg.eval_every_epochs == 0):
            metrics = evaluate()
        record = progress.end_epoch(float(collectives.sum([progress.epoch_loss()])[0]) / dist.world_size, metrics)
        if writer is not None:
            writer.write(record)
        if _reached(cfg.max_steps, global_step):
            break  # here, not at the next epoch's top, so `epoch` stays the one the last step ran in
    train_seconds = time.perf_counter() - train_start
    if global_step != last_saved:
        save(epoch + 1, step, global_step)
    if writer is not None:
        writer.close()

    if metrics is None:  # stopped early by max_steps, or resumed from a finished run
        metrics = evaluate()
    result = {"accuracy": metrics["accuracy"], "num_samples": metrics["num_samples"], "correct": metrics["correct"],
              "loss": metrics["loss"], "world_size": dist.world_size, "epochs": cfg.epochs,
              "global_steps": global_step, "global_batch": cfg.batch_size, "per_rank_batch": batch,
              "train_seconds": round(train_seconds, 3), "images_per_sec": round(timer.images_per_sec(), 3),
              "first_step_seconds": round(timer.first_step_s or 0.0, 3), "compile_seconds": round(compile_seconds, 3),
              "start_to_first_step_seconds": round(train_start - _PROCESS_START + (timer.first_step_s or 0.0), 3),
              "model": cfg.model,
              "device_target": dist.device_target, "skipped_images": len(excluded)}
    if dist.is_main:
        print(f"eval result: {{'accuracy': {metrics['accuracy']:.4f}}}", flush=True)
        with open(os.path.join(cfg.output_dir, "result.json"), "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
