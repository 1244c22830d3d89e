"""What a run is made of, built once per rank: the checked data (`load_data`) and the model with
everything that trains it (`build_model`). `trainer.Trainer` runs them; `msdist.eval` shares the
data check (`checked_classes`).
"""
import logging
import time
from dataclasses import dataclass
from typing import Dict, Sequence, Tuple

import numpy as np

from models import DEFAULT_CONVENTION
from msdist.base.errors import DataError, alike_on_every_rank
from msdist.cluster import runtime
from msdist.data import pipeline, plan
from msdist.run import options

_logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Data:
    """The run's data, resolved once: splits, class map, this rank's training input and the epoch's steps."""
    classes: Dict[str, int]
    train: "pipeline.Split"
    test: "pipeline.Split"
    excluded: Sequence[str]
    num_classes: int                      # the model's outputs (`options.num_classes`)
    train_input: "pipeline.TrainInput"   # what every epoch's training dataset is built from
    steps_per_epoch: int
    eval_batch: int                       # per rank

    @property
    def per_rank_batch(self) -> int:
        return self.train_input.batch_size


def checked_classes(cfg, dist, collectives) -> Tuple[Dict[str, int], Sequence[str]]:
    """Check the tree (each rank decodes a 1/N slice once, cached): the class map and the files every rank leaves out.

    All ranks leave out the same files, so the class map and the shards agree everywhere.
    """
    from msdist.data import shared_check
    excluded = shared_check.shared_exclusions(cfg.data_dir, cfg.bad_images == "skip", dist.rank, collectives)
    return pipeline.class_map(cfg.data_dir), excluded


def load_data(cfg, dist, collectives, rt, batch_slots: int) -> Data:
    """Check the tree, list both splits, plan the epoch; log the run's shape.

    Args:
        batch_slots: the job's batch layout (`options.batch_slots`, resolved at start-up).
    """
    with alike_on_every_rank():  # every rank checks the same tree (each decodes a slice, all agree)
        classes, excluded = checked_classes(cfg, dist, collectives)
        train_split = pipeline.list_split(cfg.data_dir, pipeline.TRAIN_SPLIT, classes, exclude=excluded)
        steps = plan.steps_per_epoch(len(train_split), cfg.batch_size)
        if steps == 0:
            raise DataError(f"{len(train_split)} training images cannot fill one global batch of {cfg.batch_size}; "
                            "lower --batch_size")
        test_split = pipeline.list_split(cfg.data_dir, pipeline.TEST_SPLIT, classes, exclude=excluded)
    outputs = options.num_classes(cfg, classes)
    layout = options.batch_layout(cfg, batch_slots, dist.world_size, dist.rank)
    spec = options.train_input(cfg, layout, options.workers(cfg, rt), outputs)
    # Evaluation's per-rank batch: one slot's, the same on every rank (a rank's own share varies when uneven).
    data = Data(classes, train_split, test_split, excluded, outputs, spec, steps,
                options.eval_batch(cfg, layout.slot_batch(cfg.batch_size)))
    _logger.info("world size %d (%s, %s) | global batch %d = %d per rank | %d classes | %d train / %d test images"
                 " | %d steps/epoch (%d left over) | %s", dist.world_size, dist.device_target,
                 dist.backend or "standalone", cfg.batch_size, data.per_rank_batch, len(classes), len(train_split),
                 len(test_split), steps, len(train_split) - steps * cfg.batch_size, rt.summary())
    layout_line = options.describe_layout(cfg, layout)
    if layout_line:
        _logger.info("%s", layout_line)
    return data


@dataclass(frozen=True)
class Model:
    """The network and everything that trains it; the stateful parts (optimizer, reducer, scaler, ema) each
    declare what a checkpoint holds of them (`trainer.state_parameters` collects it)."""
    net: object
    optimizer: object
    reducer: object          # msdist.engine.reducers: the cross-rank gradient mean, or None on one rank
    scaler: object           # msdist.engine.loss_scale.LossScaler
    ema: object              # msdist.engine.ema.EMA of the weights (--ema_decay), or None
    train_step: object       # msdist.engine.step.TrainStep, compiled
    lrs: np.ndarray
    compile_seconds: float
    convention: str          # how the network pads (models.CONVENTIONS), recorded in its checkpoints


def seed_everything(seed: int) -> None:
    import random

    import mindspore as ms
    random.seed(seed)
    np.random.seed(seed)
    ms.set_seed(seed)  # same seed on every rank: identical initial weights without a broadcast


def _convention(cfg, rank: int, source) -> str:
    """How the network pads (models.CONVENTIONS): as the checkpoint --resume restores was built, else as the
    --pretrained weights (`source`) were trained, else MindSpore's."""
    from msdist.run import checkpoint_model
    resumed = checkpoint_model.resume_meta(cfg.resume, *options.checkpoint_place(cfg), rank)
    if resumed:
        return checkpoint_model.meta_convention(resumed)
    return DEFAULT_CONVENTION if source is None else source.convention


def build_model(cfg, dist, data: Data, rt) -> Model:
    """Network (SyncBN, AMP), LR schedule, optimizer, gradient reducer, and the compiled train step."""
    import mindspore as ms

    from msdist.engine import ema, loss_scale, optim, precision, reducers, step
    from msdist.run import weights
    plan = options.step_plan(cfg, dist.device_target, data.train_input.layout)
    precision.warn_if_no_speedup(cfg.amp_level, dist.device_target)
    _logger.info("precision: %s", plan.describe_precision())
    with alike_on_every_rank():  # every rank reads the same file
        source = weights.read(cfg.pretrained) if cfg.pretrained else None
    convention = _convention(cfg, dist.rank, source)
    net = step.build_network(cfg.model, data.num_classes, cfg.zero_init_last_bn, cfg.sync_bn,
                             dist.world_size, convention, plan.bn_stats)
    if source is not None:  # before resume, which overrides it
        with alike_on_every_rank():
            weights.load_pretrained(net, source, cfg.model)
    if cfg.freeze_backbone:
        weights.freeze_backbone(net)
    net = step.mixed_precision(net, plan.amp_level, plan.amp_dtype)
    lrs = options.learning_rates(cfg, data.train_input.layout.slots, data.steps_per_epoch)
    optimizer = optim.create_optimizer(net.trainable_params(), lrs, cfg.momentum, cfg.weight_decay,
                                       cfg.backbone_lr_scale, weights.HEAD_PREFIX)
    gradient_buckets = step.bucket_gradients(net, plan.fusion, dist.world_size)
    reducer = reducers.create_reducer(plan.grad_compression, optimizer.parameters, dist.world_size,
                                      topk_ratio=plan.topk_ratio, threshold=plan.threshold,
                                      error_feedback=plan.error_feedback, buckets=gradient_buckets)
    scaler = loss_scale.LossScaler(plan.loss_scale, dist.world_size, rank=dist.rank)
    # batch_size stays the global batch of one optimizer step; accumulation splits each rank's share.
    micro_batch, size = plan.micro_batch, data.train_input.image_size
    soft_labels = data.train_input.regularization.soft_labels
    pixels = data.train_input.pixels_out   # uint8 batches, normalized in the step's graph
    train_step = step.TrainStep(net, step.create_loss(soft_labels), optimizer, scaler, reducer, plan.accum_steps,
                                plan.grad_scale, len(data.train_input.layout.owned), plan.jit_level,
                                (pipeline.MEAN, pipeline.STD) if pixels else None)
    _logger.info("input: %s", data.train_input.describe_images())
    _logger.info("gradients: %s in %d bucket(s), last layers first (%s MB) | %d micro-batch(es) of %d per rank per "
                 "optimizer step", plan.grad_compression, len(gradient_buckets),
                 "/".join(f"{b.nbytes / 2**20:.1f}" for b in gradient_buckets), plan.accum_steps, micro_batch)
    train_step.set_train(True)
    compile_start = time.perf_counter()
    with runtime.compile_cache_scope(rt):  # compiled ahead of the first batch, so a restart can load it
        train_step.compile(ms.Tensor(shape=(micro_batch, 3, size, size), dtype=ms.uint8 if pixels else ms.float32),
                           step.label_placeholder(micro_batch, data.num_classes, soft_labels))
    compile_seconds = time.perf_counter() - compile_start
    _logger.info("train step compiled in %.1f s", compile_seconds)
    runtime.release_compile_memory()
    averaged = ema.create(net, cfg.ema_decay)  # after --pretrained, so the average starts from those weights
    return Model(net, optimizer, reducer, scaler, averaged, train_step, lrs, compile_seconds, convention)
