"""What a run is made of, built once per rank: the checked data (`load_data`) and the model with
everything that trains it (`build_model`). `trainer.Trainer` runs them; `msdist.eval` shares the
data check (`checked_classes`).
"""
import hashlib
import logging
import time
from dataclasses import dataclass
from typing import Dict, Sequence, Tuple

import numpy as np

from models import DEFAULT_CONVENTION
from msdist.base.errors import DataError, alike_on_every_rank
from msdist.data import pipeline, plan
from msdist.rank import runtime
from msdist.run import run_plan

_logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Data:
    """The run's data, resolved once: splits, class map, this rank's training input and the epoch's steps."""
    classes: Dict[str, int]
    train: "pipeline.Split"
    test: "pipeline.Split"
    excluded: Sequence[str]
    num_classes: int                      # the model's outputs (`run_plan.InputPlan.classes`)
    train_input: "pipeline.TrainInput"   # what every epoch's training dataset is built from
    steps_per_epoch: int
    eval_batch: int                       # per rank

    @property
    def per_rank_batch(self) -> int:
        return self.train_input.batch_size

    def sample_order(self, epochs: int) -> str:
        """A digest of every global batch of `epochs` epochs, in order: the same on 1 or N ranks (`plan.global_batches`)."""
        spec, digest = self.train_input, hashlib.sha256()
        for epoch in range(epochs):
            digest.update(plan.global_batches(len(self.train), spec.global_batch, epoch, spec.seed, spec.shuffle,
                                              spec.layout.slots).tobytes())
        return digest.hexdigest()[:16]


def checked_classes(data_dir: str, skip_bad_images: bool, dist, collectives) -> Tuple[Dict[str, int], Sequence[str]]:
    """Check the tree (each rank decodes a 1/N slice once, cached): the class map and the files every rank leaves out.

    All ranks leave out the same files, so the class map and the shards agree everywhere.
    """
    from msdist.data import shared_check
    excluded = shared_check.shared_exclusions(data_dir, skip_bad_images, dist.rank, collectives)
    return pipeline.class_map(data_dir), excluded


def load_data(run: run_plan.RunPlan, dist, collectives, rt) -> Data:
    """Check the tree, list both splits, plan the epoch; log the run's shape. Completes the run plan with what only
    this rank knows (its rank id, the class folders, its cores), once."""
    source, global_batch = run.input, run.batch.global_batch
    with alike_on_every_rank():  # every rank checks the same tree (each decodes a slice, all agree)
        classes, excluded = checked_classes(source.data_dir, source.skip_bad_images, dist, collectives)
        train_split = pipeline.list_split(source.data_dir, pipeline.TRAIN_SPLIT, classes, exclude=excluded)
        steps = plan.steps_per_epoch(len(train_split), global_batch)
        if steps == 0:
            raise DataError(f"{len(train_split)} training images cannot fill one global batch of {global_batch}; "
                            "lower --batch_size")
        test_split = pipeline.list_split(source.data_dir, pipeline.TEST_SPLIT, classes, exclude=excluded)
    outputs = source.classes(classes)
    layout = run.batch.layout(dist.world_size, dist.rank)
    spec = source.train_input(layout, outputs, rt.threads_per_rank)
    # Evaluation's per-rank batch: one slot's, the same on every rank (a rank's own share varies when uneven).
    data = Data(classes, train_split, test_split, excluded, outputs, spec, steps, run.batch.eval_batch)
    _logger.info("world size %d (%s, %s) | global batch %d = %d per rank | %d classes | %d train / %d test images"
                 " | %d steps/epoch (%d left over) | %s", dist.world_size, dist.device_target,
                 dist.backend or "standalone", global_batch, data.per_rank_batch, len(classes), len(train_split),
                 len(test_split), steps, len(train_split) - steps * global_batch, rt.summary())
    layout_line = run.batch.describe(layout)
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


def _convention(run: run_plan.RunPlan, rank: int, source) -> str:
    """How the network pads (models.CONVENTIONS): as the checkpoint --resume restores was built, else as the
    --pretrained weights (`source`) were trained, else MindSpore's."""
    from msdist.run import checkpoint_model
    resumed = checkpoint_model.resume_meta(run.resume.path, run.checkpoints.directory, run.checkpoints.prefix, rank)
    if resumed:
        return checkpoint_model.meta_convention(resumed)
    return DEFAULT_CONVENTION if source is None else source.convention


def build_model(run: run_plan.RunPlan, dist, data: Data, rt) -> Model:
    """Network (SyncBN, AMP), LR schedule, optimizer, gradient reducer, and the compiled train step."""
    import mindspore as ms

    from msdist.engine import ema, loss_scale, optim, precision, reducers, step
    from msdist.run import weights
    plan, recipe, layout = run.step, run.model, data.train_input.layout
    precision.warn_if_no_speedup(recipe.amp_level, dist.device_target)
    _logger.info("precision: %s", plan.describe_precision())
    with alike_on_every_rank():  # every rank reads the same file
        source = weights.read(recipe.pretrained) if recipe.pretrained else None
    convention = _convention(run, dist.rank, source)
    net = step.build_network(recipe.name, data.num_classes, recipe.zero_init_last_bn, recipe.sync_bn,
                             dist.world_size, convention, plan.bn_stats)
    if source is not None:  # before resume, which overrides it
        with alike_on_every_rank():
            weights.load_pretrained(net, source, recipe.name)
    if recipe.freeze_backbone:
        weights.freeze_backbone(net)
    net = step.mixed_precision(net, plan.amp_level, plan.amp_dtype)
    lrs = run.schedule.lr.every_step(data.steps_per_epoch)
    optimizer = optim.create_optimizer(net.trainable_params(), lrs, recipe.momentum, recipe.weight_decay,
                                       recipe.backbone_lr_scale, weights.HEAD_PREFIX)
    gradient_buckets = step.bucket_gradients(net, plan.fusion, dist.world_size)
    reducer = reducers.create_reducer(plan.grad_compression, optimizer.parameters, dist.world_size,
                                      topk_ratio=plan.topk_ratio, threshold=plan.threshold,
                                      error_feedback=plan.error_feedback, buckets=gradient_buckets)
    scaler = loss_scale.LossScaler(plan.loss_scale, dist.world_size, rank=dist.rank)
    # batch_size stays the global batch of one optimizer step; accumulation splits each rank's share.
    micro_batch, size = plan.micro_batch, data.train_input.image_size
    soft_labels = data.train_input.regularization.soft_labels
    # This rank runs each slot's micro-batches for every slot it owns (more than one when the job shrank).
    accum_steps = layout.micro_steps(plan.accum_steps)
    pixels = data.train_input.pixels_out   # uint8 batches, normalized in the step's graph
    train_step = step.TrainStep(net, step.create_loss(soft_labels), optimizer, scaler, reducer, accum_steps,
                                layout.gradient_scale(plan.accum_steps), len(layout.owned), plan.jit_level,
                                (pipeline.MEAN, pipeline.STD) if pixels else None)
    _logger.info("input: %s", data.train_input.describe_images())
    _logger.info("gradients: %s in %d bucket(s), last layers first (%s MB) | %d micro-batch(es) of %d per rank per "
                 "optimizer step", plan.grad_compression, len(gradient_buckets),
                 "/".join(f"{b.nbytes / 2**20:.1f}" for b in gradient_buckets), accum_steps, micro_batch)
    train_step.set_train(True)
    compile_start = time.perf_counter()
    with runtime.compile_cache_scope(rt):  # compiled ahead of the first batch, so a restart can load it
        train_step.compile(ms.Tensor(shape=(micro_batch, 3, size, size), dtype=ms.uint8 if pixels else ms.float32),
                           step.label_placeholder(micro_batch, data.num_classes, soft_labels))
    compile_seconds = time.perf_counter() - compile_start
    _logger.info("train step compiled in %.1f s", compile_seconds)
    runtime.release_compile_memory()
    averaged = ema.create(net, recipe.ema_decay)  # after --pretrained, so the average starts from those weights
    return Model(net, optimizer, reducer, scaler, averaged, train_step, lrs, compile_seconds, convention)
