"""The network and the compiled train step (plain, or accumulating micro-batches)."""
from typing import List, Optional, Sequence, Tuple

import numpy as np
from mindspore import JitConfig, Parameter, ParameterTuple, Tensor, nn, ops
from mindspore.common import dtype as mstype

from models import DEFAULT_CONVENTION
from msdist.engine import bn_stats, buckets, loss_scale, momentum
from msdist.engine.loss import SparseCrossEntropy


class ScaledUpdate(nn.Cell):
    """Loss-scaled gradients in, one optimizer step out: reduction, unscale, overflow check, update.

    Unchecked (a fixed scale under float32, `loss_scale.LossScaler.checked`): reduce, unscale, update;
    nothing else. Checked: a step whose gradients overflow on any rank is skipped on every rank, decided on the
    device (`momentum.Momentum.step_unless`: the update is masked, no flag goes to the host; weights and moments
    stay as they were, and the step counter still advances, so the learning rate follows the data step as the
    logs do). A dynamic scale then halves; a fixed one records the step and skips every later step
    too, until the host stops the run (`loss_scale.check_finite`); a fixed scale also counts the loss.

    The verdict comes from the reduced gradients: a sum over ranks holds any rank's inf or NaN, so every
    rank reads the same verdict without a collective of its own. A flag all-reduced BEFORE the exchange
    would depend on every gradient, so no bucket (`buckets.plan_buckets`) could leave before backward ended.
    Only reducers with rank-local state (`guards_state`: the top-K residuals) still get the verdict first,
    because a skipped step must leave their residuals as they were.

    Args:
        optimizer: a `momentum.Momentum` whose own `loss_scale` is 1 (unscaling happens here).
        reducer: cell mapping the gradient tuple to its cross-rank mean (`reducers.create_reducer`); None on
            a single rank. A reducer with `reduces_scaled = True` gets the gradients still scaled (a float16
            exchange, where the scale keeps small values from flushing to zero).
        scaler: the `loss_scale.LossScaler` the gradients were scaled by.
    """

    def __init__(self, optimizer, reducer, scaler):
        super().__init__(auto_prefix=False)
        self.optimizer = optimizer
        self.reducer = reducer
        self.scaler = scaler
        self.reduces_scaled = bool(getattr(reducer, "reduces_scaled", False))
        self.guards_state = bool(getattr(reducer, "guards_state", False))

    def _reduce(self, grads, skip):
        if self.reducer is None:
            return grads
        if self.guards_state:
            return self.reducer(grads, skip)
        return self.reducer(grads)

    def _verdict_first(self, grads, loss):
        """(unscaled reduced gradients, overflow, per-rank counts): flag all-reduced before the exchange."""
        by_rank = self.scaler.not_finite_by_rank(grads, None if self.scaler.dynamic else loss)
        overflow = by_rank.sum() > 0
        # Zeroed, so no inf reaches the exchange or the residuals.
        grads = momentum.zeroed_if(overflow, grads)
        return self._reduce(self.scaler.unscale(grads), overflow), overflow, by_rank

    def _verdict_from_sums(self, grads, loss):
        """(unscaled reduced gradients, overflow, per-rank counts or None): each bucket leaves on its own."""
        if self.reduces_scaled:
            reduced = self.scaler.unscale(self._reduce(grads, None))
        else:
            reduced = self._reduce(self.scaler.unscale(grads), None)
        if self.scaler.dynamic:
            # The sums carry any rank's inf or NaN, and a float16 exchange's own overflow.
            return reduced, self.scaler.overflow(reduced, across_ranks=False), None
        # Fixed: each rank's count of its gradients and its loss (the error line names the ranks; the sums carry
        # no loss). This AllReduce reads every local gradient, but no bucket waits for it: only the update does.
        by_rank = self.scaler.not_finite_by_rank(grads, loss)
        overflow = by_rank.sum() > 0
        if self.reduces_scaled:  # a float16 exchange can overflow by itself
            overflow = ops.logical_or(overflow, self.scaler.overflow(reduced, across_ranks=False))
        return reduced, overflow, by_rank

    def construct(self, grads, loss):
        if not self.scaler.checked:
            return self.optimizer(self._reduce(self.scaler.unscale(grads), None))
        if self.guards_state:
            grads, overflow, by_rank = self._verdict_first(grads, loss)
        else:
            grads, overflow, by_rank = self._verdict_from_sums(grads, loss)
        skip = self.scaler.update(overflow, by_rank, self.optimizer.global_step)
        # Masked on the device (engine/momentum.py), not `if not skip:`, whose flag would travel to the host.
        return ops.depend(skip, self.optimizer.step_unless(grads, skip))


class _RunEveryStep(nn.Cell):
    """A cell launched every step, whose launch skips MindSpore's per-run compile check while its inputs keep the
    shapes and dtypes of the last compile.

    `Cell.__call__` compiles before every run (mindspore/nn/cell.py:1800, in `compile_and_run`). On a cache hit
    that check still sets `compile_phase` on every sub-cell, recursively (mindspore/graph/api.py:2331-2332, the
    setter at nn/cell.py:520-527): ~190 us a step for ResNet-18's 77 cells on this host, and ResNet-50's step
    has 160. The graph a run executes is the one `arguments_key` names (graph/api.py:2450-2452 through
    `_real_phase`, 144-146), which only a compile sets (graph/api.py:2323), so skipping a compile whose inputs
    match the last one runs the same graph.
    """

    _compiled_for = None   # (shape, dtype) of each input at the last compile

    def compile(self, *args):
        signature = tuple((arg.shape, arg.dtype) for arg in args)
        if signature != self._compiled_for:
            super().compile(*args)
            self._compiled_for = signature


class _ApplyAccumulated(_RunEveryStep):
    """Scale the accumulated gradients and losses (`scale`: the mean over micro-batches), reduce the gradients over
    ranks once, step the optimizer, clear the buffers; the scaled loss."""

    def __init__(self, accumulated: ParameterTuple, loss_sum: Parameter, loss_total: Parameter, update: ScaledUpdate,
                 scale: float):
        super().__init__(auto_prefix=False)
        self.accumulated = accumulated
        self.loss_sum = loss_sum
        self.loss_total = loss_total
        self.update = update
        self.scale = scale
        self.hyper_map = ops.HyperMap()

    def construct(self):
        grads = self.hyper_map(ops.partial(_scaled_cast, self.scale, mstype.float32), self.accumulated)
        loss = self.loss_sum * self.scale
        done = self.update(grads, loss)
        # Auto-monad keeps side effects in program order: the buffers are read above, cleared here.
        loss = ops.depend(loss, self.hyper_map(_clear, self.accumulated))
        loss = ops.depend(ops.depend(loss, _clear_buffer(self.loss_sum)), done)
        return ops.depend(loss, ops.assign_add(self.loss_total, loss))


class _MicroBatches(_RunEveryStep):
    """A batch split into equal micro-batches on the device, in one compiled launch (no copy through the host)."""

    def __init__(self, parts: int):
        super().__init__(auto_prefix=False)
        self.parts = parts

    def construct(self, images, labels):
        return ops.split(images, images.shape[0] // self.parts), ops.split(labels, labels.shape[0] // self.parts)


_scaled_cast = ops.MultitypeFuncGraph("scaled_cast")


@_scaled_cast.register("Number", "TypeType", "Tensor")
def _scale_then_cast(scale, dtype, grad):
    return ops.cast(grad * scale, dtype)


_clear = ops.MultitypeFuncGraph("clear")


@_clear.register("Tensor")
def _clear_buffer(buffer):
    return ops.assign(buffer, ops.zeros_like(buffer))


class TrainStep(_RunEveryStep):
    """Forward, backward with the loss scale, gradient reduction over ranks, optimizer update.

    With `accum_steps` > 1 one optimizer step covers that many micro-batches and one gradient
    reduction: calling the cell runs one micro-batch (forward, backward, gradients added to float32
    buffers) and returns its loss, and a compiled apply step scales the buffers by `grad_scale`, reduces
    them over ranks, updates the weights and clears the buffers. Only the apply step has a collective
    (without SyncBatchNorm), so ranks running different numbers of micro-batches stay in step. The buffers
    hold partial sums between micro-batches only, so checkpoints (taken between optimizer steps) skip them.
    `train_on` runs one optimizer step either way.

    Args:
        net: the model.
        loss_fn: loss cell (logits, labels) -> scalar mean over the (micro-)batch.
        optimizer: with `loss_scale` 1 (`optim.create_optimizer`).
        scaler: `loss_scale.LossScaler`, fixed or dynamic; a dynamic scale changes only in the update.
        reducer: cell mapping the gradient tuple to its cross-rank mean (`reducers.create_reducer`); None on
            a single rank.
        accum_steps: micro-batches per optimizer step on this rank.
        grad_scale: what the summed micro-batch gradients and losses are multiplied by before the mean over ranks;
            None = 1 / accum_steps, their mean. A rank owning k of a job's S batch slots (`plan.BatchLayout`) passes
            world_size / (S x accum per slot), so the mean over ranks is every micro-batch's mean; a scale other
            than 1 accumulates even a single micro-batch.
        slots_owned: the batch slots the micro-batches belong to, in equal consecutive groups; each slot after the
            first has its own BatchNorm running statistics, swapped in for its micro-batches (`slot_stats`).
        jit_level: MindSpore's compile level for the step's graphs (`jit.resolve_jit_level`); "" = MindSpore's own.
        normalize: (mean, std) per channel: the images arrive as uint8 pixels and are normalized here, on the device,
            as the host would have (`(x - mean) / std` in float32); None: they arrive normalized.
    """

    def __init__(self, net, loss_fn, optimizer, scaler, reducer=None, accum_steps: int = 1,
                 grad_scale: Optional[float] = None, slots_owned: int = 1, jit_level: str = "",
                 normalize: Optional[Tuple[Sequence[float], Sequence[float]]] = None):
        super().__init__(auto_prefix=False)
        self.mean, self.std = (None, None) if normalize is None else \
            (Tensor(np.asarray(v, np.float32).reshape(1, -1, 1, 1)) for v in normalize)
        self.net_with_loss = nn.WithLossCell(net, loss_fn)
        self.weights = optimizer.parameters
        self.grad = ops.GradOperation(get_by_list=True, sens_param=True)
        self.scaler = scaler
        self.accum_steps = accum_steps
        grad_scale = 1.0 / accum_steps if grad_scale is None else grad_scale
        self.accumulates = accum_steps > 1 or grad_scale != 1.0
        self.slot_stats = bn_stats.SlotStatistics(net, slots_owned)
        self.steps_per_slot = accum_steps // slots_owned
        update = ScaledUpdate(optimizer, reducer, scaler)
        # Unchecked (float32, fixed scale): no step checks, so the log steps read whether the weights are finite.
        self.finite_weights = None if scaler.checked else loss_scale.FiniteWeights(self.weights)
        self.loss_total = Parameter(Tensor(0.0, mstype.float32), name="loss_total", requires_grad=False)
        self.losses = LossAccumulator(self.loss_total)
        if not self.accumulates:
            self.update = update
        else:
            self.accumulated = ParameterTuple([Parameter(Tensor(np.zeros(p.shape, np.float32)), name=f"accum.{p.name}",
                                                         requires_grad=False) for p in self.weights])
            self.loss_sum = Parameter(Tensor(0.0, mstype.float32), name="accum.loss", requires_grad=False)
            self.hyper_map = ops.HyperMap()
            self.apply_step = _ApplyAccumulated(self.accumulated, self.loss_sum, self.loss_total, update, grad_scale)
            self.micro_batches = _MicroBatches(accum_steps)
        if jit_level:
            # Cell.set_jit_config, the public per-graph setting (set_context(jit_config=...) is deprecated in 2.10,
            # mindspore/context.py:1411); each compiled cell reads its own (nn/cell.py:1783).
            for cell in [self] + ([self.apply_step, self.micro_batches] if self.accumulates else []):
                cell.set_jit_config(JitConfig(jit_level=jit_level))

    def construct(self, images, labels):
        if self.mean is not None:
            images = (ops.cast(images, mstype.float32) - self.mean) / self.std
        loss = self.net_with_loss(images, labels)
        grads = self.grad(self.net_with_loss, self.weights)(images, labels, self.scaler.sens(loss))
        if not self.accumulates:
            loss = ops.depend(loss, self.update(grads, loss))
            return ops.depend(loss, ops.assign_add(self.loss_total, ops.cast(loss, mstype.float32)))
        loss = ops.depend(loss, ops.assign_add(self.loss_sum, ops.cast(loss, mstype.float32)))
        return ops.depend(loss, self.hyper_map(ops.assign_add, self.accumulated, grads))

    def compile(self, images, labels):
        """Compile the step for these (micro-)batch shapes, and the apply step when accumulating."""
        super().compile(images, labels)
        if self.accumulates:
            self.apply_step.compile()

    def train_on(self, images, labels):
        """One optimizer step on this rank's batch (split into `accum_steps` micro-batches on the device); the
        mean loss, a device Tensor, also added to `losses` on the device."""
        self.losses.step_done()
        if not self.accumulates:
            return self(images, labels)
        micro = list(zip(*self.micro_batches(images, labels)))
        for slot in range(len(micro) // self.steps_per_slot):
            self.slot_stats.swap(slot)
            for micro_images, micro_labels in micro[slot * self.steps_per_slot:(slot + 1) * self.steps_per_slot]:
                self(micro_images, micro_labels)
            self.slot_stats.swap(slot)  # the network's own (its first slot's) back
        return self.apply_step()


def create_loss(soft_labels: bool):
    """Training cross-entropy: on class indices, or on float class distributions (mixup, cutmix, smoothing).

    Both are finite for any finite logits (engine/loss.py says why the class-index one is msdist's own).
    """
    if soft_labels:
        return nn.SoftmaxCrossEntropyWithLogits(sparse=False, reduction="mean")
    return SparseCrossEntropy()


def label_placeholder(batch: int, num_classes: int, soft_labels: bool):
    """The label input the train step compiles for: int32 (batch,) or float32 (batch, classes)."""
    import mindspore as ms
    if soft_labels:
        return ms.Tensor(shape=(batch, num_classes), dtype=ms.float32)
    return ms.Tensor(shape=(batch,), dtype=ms.int32)


def build_network(model: str, num_classes: int, zero_init_last_bn: bool, sync_bn: bool, world_size: int,
                  convention: str = DEFAULT_CONVENTION, bn_stats: str = "float64"):
    """The model from the registry, with cross-rank BatchNorm swapped in when asked.

    Args:
        convention: how its parameter-free layers pad (models.CONVENTIONS), after the weights it will hold.
        bn_stats: sync_bn's statistics precision (`precision.bn_stats_precision` of the device).
    """
    from models import create_model
    net = create_model(model, num_classes, zero_init_last_bn=zero_init_last_bn, convention=convention)
    if sync_bn:
        from msdist.engine.sync_bn import convert_sync_batchnorm
        net = convert_sync_batchnorm(net, world_size, bn_stats)
    return net


def mixed_precision(net, amp_level: str, amp_dtype: str):
    """Cast the network for a resolved `amp_level` O2/O3 in `amp_dtype` (float16/bfloat16); O0 returns it.

    O2 is MindSpore's own O2 (`amp.custom_mixed_precision` with its black list, the code path
    `auto_mixed_precision(net, "O2")` takes) with msdist's SyncBatchNorm added to the list, so every
    BatchNorm computes its statistics in float32.
    """
    if amp_level == "O0":
        return net
    import mindspore as ms
    dtype = getattr(ms, amp_dtype)
    if amp_level == "O2":
        from msdist.engine.sync_bn import SyncBatchNorm2d
        return ms.amp.custom_mixed_precision(net, black_list=ms.amp.get_black_list() + [SyncBatchNorm2d], dtype=dtype)
    return ms.amp.auto_mixed_precision(net, amp_level, dtype=dtype)


def bucket_gradients(net, split_after: Optional[Sequence[int]], world_size: int) -> List[buckets.Bucket]:
    """Cut the gradients into all-reduce buckets (`--allreduce_fusion`) and tag each parameter with its bucket.

    Each trainable parameter's `comm_fusion` becomes its bucket's number in send order (1 = the last
    layers'), so MindSpore's reducer fuses each bucket's AllReduce ops (nn/wrap/grad_reducer.py:67-95,
    `_init_allreduce_operators_by_parameters`: one op per parameter carrying its `comm_fusion`; the backend
    fuses equal ids, and `buckets.fusion_config` keeps each bucket one op). `split_after` indices count in network
    order: MindSpore's own `all_reduce_fusion_config` counts in the optimizer's order, which is group by group
    (nn/optim/optimizer.py:612-617) unless `order_params` restores it, as `optim.param_groups` does.

    Args:
        split_after: None = `auto` (DEFAULT_BUCKET_BYTES); [] = one bucket; else cut after these indices.
        world_size: on one rank nothing is reduced: no tags.

    Raises:
        ConfigError: an index at or past the model's trainable parameter count.
    """
    plan = buckets.plan(buckets.parameter_sizes(net), split_after)
    if world_size > 1:
        params = {p.name: p for p in net.trainable_params()}
        for number, bucket in enumerate(plan, start=1):
            for name in bucket.names:
                params[name].comm_fusion = number
        _enable_fusion(buckets.fusion_config(plan))
    return plan


def _enable_fusion(threshold_units: int) -> None:
    """Let the backend fuse each bucket's AllReduce ops (`buckets.fusion_config` as the split threshold).

    GPU always runs MindSpore's AllReduceFusion pass; CPU only once `enable_all_reduce_fusion` is set
    (plugin/device/cpu/hal/hardware/cpu_device_context.cc, CPUKernelExecutor::OptimizeGraph), which a
    `comm_fusion` setting does (parallel/_auto_parallel_context.py:1261). In data-parallel mode the pass
    cuts a fused group again past the threshold (backend/common/pass/communication_op_fusion.cc,
    GetAllReduceSplitSegment), which it reads in 256 KB units: `buckets.fusion_config` sets it past the largest
    bucket, so each bucket leaves as one op, the messages `msdist.plan_scale` forecasts.
    """
    import mindspore as ms
    ms.set_auto_parallel_context(comm_fusion={"allreduce": {"mode": "size", "config": threshold_units}})


class LossAccumulator:
    """Step losses summed on the device by the train step itself (one AssignAdd inside its graph, no launch of
    its own), read to the host only when asked (at log steps).

    Reading a device value waits for every step queued before it, so reading each step's loss would
    make the host wait for the device every step instead of queueing the next one.
    """

    def __init__(self, total: Parameter):
        self._total = total
        self._steps = 0

    def step_done(self, steps: int = 1) -> None:
        """Count optimizer steps (a sunk chunk's K), whose losses their graph has added to the total; no host sync."""
        self._steps += steps

    def read(self) -> float:
        """Mean of the losses since the last read; blocks until they are computed. Restarts the sum."""
        mean = float(self._total.asnumpy()) / self._steps
        self._total.set_data(Tensor(0.0, mstype.float32))
        self._steps = 0
        return mean
