"""The network and the compiled train step (plain, or accumulating micro-batches)."""
import numpy as np
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops
from mindspore.common import dtype as mstype

from models import DEFAULT_CONVENTION
from msdist.base.errors import ConfigError
from msdist.engine.loss import SparseCrossEntropy


class ScaledUpdate(nn.Cell):
    """Loss-scaled gradients in, one optimizer step out: overflow check, reduction, unscale, update.

    A step whose gradients overflow on any rank is skipped on every rank: the gradients are zeroed
    before the collectives (so no inf reaches them or the error-feedback residuals), the optimizer
    does not run (its step counter still advances, so the learning rate follows the data step as the
    logs do). A dynamic scale then halves; a fixed one records the step and skips every later step
    too, until the host stops the run (`loss_scale.check_finite`). A fixed scale of 1 (no scaling)
    adds no check.

    Args:
        optimizer: its own `loss_scale` must be 1 (unscaling happens here).
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
        self.hyper_map = ops.HyperMap()

    def _reduce(self, grads, skip):
        if self.reducer is None:
            return grads
        if self.guards_state:
            return self.reducer(grads, skip)
        return self.reducer(grads)

    def construct(self, grads):
        if not self.scaler.checked:
            return self.optimizer(self._reduce(self.scaler.unscale(grads), None))
        by_rank = self.scaler.not_finite_by_rank(grads)
        overflow = by_rank.sum() > 0
        grads = self.hyper_map(ops.partial(_zero_if, overflow), grads)
        if self.reduces_scaled:
            grads = self.scaler.unscale(self._reduce(grads, overflow))
            # A float16 exchange can overflow by itself; its result is the same on every rank.
            overflow = ops.logical_or(overflow, self.scaler.overflow(grads, across_ranks=False))
        else:
            grads = self._reduce(self.scaler.unscale(grads), overflow)
        overflow = self.scaler.update(overflow, by_rank, self.optimizer.global_step)
        # A skipped step still moves the schedule's position (the optimizer moves it when it runs).
        overflow = ops.depend(overflow, ops.assign_add(self.optimizer.global_step,
                                                       ops.cast(overflow, self.optimizer.global_step.dtype)))
        if not overflow:
            self.optimizer(grads)
        return overflow


_zero_if = ops.MultitypeFuncGraph("zero_if")


@_zero_if.register("Tensor", "Tensor")
def _zero_if_flag(flag, grad):
    return ops.select(ops.broadcast_to(flag, grad.shape), ops.zeros_like(grad), grad)


class _ApplyAccumulated(nn.Cell):
    """Average the accumulated gradients, reduce them over ranks once, step the optimizer, clear."""

    def __init__(self, accumulated: ParameterTuple, update: ScaledUpdate, accum_steps: int):
        super().__init__(auto_prefix=False)
        self.accumulated = accumulated
        self.update = update
        self.inv_steps = 1.0 / accum_steps
        self.hyper_map = ops.HyperMap()

    def construct(self):
        grads = self.hyper_map(ops.partial(_scaled_cast, self.inv_steps, mstype.float32), self.accumulated)
        done = self.update(grads)
        # Auto-monad keeps side effects in program order: the buffers are read above, cleared here.
        return ops.depend(done, self.hyper_map(_clear, self.accumulated))


_scaled_cast = ops.MultitypeFuncGraph("scaled_cast")


@_scaled_cast.register("Number", "TypeType", "Tensor")
def _scale_then_cast(scale, dtype, grad):
    return ops.cast(grad * scale, dtype)


_clear = ops.MultitypeFuncGraph("clear")


@_clear.register("Tensor")
def _clear_buffer(buffer):
    return ops.assign(buffer, ops.zeros_like(buffer))


class TrainStep(nn.Cell):
    """Forward, backward with the loss scale, gradient reduction over ranks, optimizer update.

    With `accum_steps` > 1 one optimizer step covers that many micro-batches and one gradient
    reduction: calling the cell runs one micro-batch (forward, backward, gradients added to float32
    buffers) and returns its loss, and a compiled apply step averages the buffers, reduces them over
    ranks, updates the weights and clears the buffers. The buffers hold partial sums between
    micro-batches only, so checkpoints (taken between optimizer steps) skip them. `train_on` runs one
    optimizer step either way.

    Args:
        net: the model.
        loss_fn: loss cell (logits, labels) -> scalar mean over the (micro-)batch.
        optimizer: with `loss_scale` 1 (`optim.create_optimizer`).
        scaler: `loss_scale.LossScaler`, fixed or dynamic; a dynamic scale changes only in the update.
        reducer: cell mapping the gradient tuple to its cross-rank mean (`reducers.create_reducer`); None on
            a single rank.
        accum_steps: micro-batches per optimizer step.
    """

    def __init__(self, net, loss_fn, optimizer, scaler, reducer=None, accum_steps: int = 1):
        super().__init__(auto_prefix=False)
        self.net_with_loss = nn.WithLossCell(net, loss_fn)
        self.weights = optimizer.parameters
        self.grad = ops.GradOperation(get_by_list=True, sens_param=True)
        self.scaler = scaler
        self.accum_steps = accum_steps
        update = ScaledUpdate(optimizer, reducer, scaler)
        if accum_steps == 1:
            self.update = update
        else:
            self.accumulated = ParameterTuple([Parameter(Tensor(np.zeros(p.shape, np.float32)), name=f"accum.{p.name}",
                                                         requires_grad=False) for p in self.weights])
            self.hyper_map = ops.HyperMap()
            self.apply_step = _ApplyAccumulated(self.accumulated, update, accum_steps)

    def construct(self, images, labels):
        loss = self.net_with_loss(images, labels)
        grads = self.grad(self.net_with_loss, self.weights)(images, labels, self.scaler.sens(loss))
        if self.accum_steps == 1:
            return ops.depend(loss, self.update(grads))
        return ops.depend(loss, self.hyper_map(ops.assign_add, self.accumulated, grads))

    def compile(self, images, labels):
        """Compile the step for these (micro-)batch shapes, and the apply step when accumulating."""
        super().compile(images, labels)
        if self.accum_steps > 1:
            self.apply_step.compile()

    def train_on(self, images, labels):
        """One optimizer step on this rank's batch (split into `accum_steps` micro-batches); the mean loss."""
        if self.accum_steps == 1:
            return self(images, labels)
        losses = [self(Tensor(x), Tensor(y)) for x, y in zip(np.split(images.asnumpy(), self.accum_steps),
                                                               np.split(labels.asnumpy(), self.accum_steps))]
        self.apply_step()
        return sum(losses[1:], losses[0]) * (1.0 / self.accum_steps)


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
                  convention: str = DEFAULT_CONVENTION):
    """The model from the registry, with cross-rank BatchNorm swapped in when asked.

    Args:
        convention: how its parameter-free layers pad (models.CONVENTIONS), after the weights it will hold.
    """
    from models import create_model
    net = create_model(model, num_classes, zero_init_last_bn=zero_init_last_bn, convention=convention)
    if sync_bn:
        from msdist.engine.sync_bn import convert_sync_batchnorm
        net = convert_sync_batchnorm(net, world_size)
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


def split_allreduce_fusion(indices, num_params: int, world_size: int) -> None:
    """Split MindSpore's fused gradient all-reduce after these parameter indices (`--allreduce_fusion`).

    MindSpore's model zoo trains ResNet-50 on GPU with [85, 160]: the gradients of the last layers
    (computed first) are reduced while backward still runs through the first ones.

    Raises:
        ConfigError: an index at or past the model's trainable parameter count.
    """
    if not indices or world_size == 1:
        return
    if indices[-1] >= num_params:
        raise ConfigError(f"--allreduce_fusion index {indices[-1]} is past the model's last trainable parameter "
                          f"(it has {num_params}); use indices below {num_params}")
    import mindspore as ms
    ms.set_auto_parallel_context(all_reduce_fusion_config=list(indices))


class _Add(nn.Cell):
    def construct(self, a, b):
        return a + b


class LossAccumulator:
    """Step losses summed on the device, read to the host only when asked (at log steps).

    Reading a device value waits for every step queued before it, so reading each step's loss would
    make the host wait for the device every step instead of queueing the next one.
    """

    def __init__(self):
        self._sum = None
        self._steps = 0
        self._add = _Add()  # a compiled graph: launched like the train step, without an eager-mode op

    def add(self, loss) -> None:
        """Add one step's loss (a device Tensor); no host sync."""
        self._sum = loss if self._sum is None else self._add(self._sum, loss)
        self._steps += 1

    def read(self) -> float:
        """Mean of the losses added since the last read; blocks until they are computed."""
        mean = float(self._sum.asnumpy()) / self._steps
        self._sum, self._steps = None, 0
        return mean
