"""The loss scale inside the compiled train step: fixed, or dynamic with a cross-rank overflow check.

Dynamic scaling follows MindSpore's `nn.DynamicLossScaleUpdateCell` (mindspore/nn/wrap/loss_scale.py):
on a step whose gradients hold an inf or NaN the scale is divided by `precision.SCALE_FACTOR` (never
below 1) and the step is skipped; after `precision.SCALE_WINDOW` steps since the last overflow or
increase it is multiplied by the factor. The overflow flag is summed over the ranks first
(MindSpore's TrainOneStepWithLossScaleCell does the same), so every rank skips the same steps and
keeps the same scale. The scale and both counters are Parameters under STATE_PREFIX, declared by
`LossScaler.state_parameters` and saved in checkpoints, so a resumed run continues with the scale it had.

A fixed scale (other than 1, which is no scaling) has no such rule, so an inf or NaN there is an
error: the step whose gradients (and so the loss: softmax cross-entropy's gradient is finite
exactly where the logits are) hold one is skipped in the graph like an overflow step, and so is
every step after it, while the step number and the ranks where it happened stay in two sticky
Parameters. The host reads them only where it syncs anyway - at log steps - and before it writes
weights (`check_finite`), so the run stops with one line naming the step and the rank, and no
weights that saw the inf are ever written.
"""
from typing import List

import numpy as np
from mindspore import Parameter, Tensor, nn, ops
import mindspore as ms

from msdist.base.errors import NonFiniteError, alike_on_every_rank
from msdist.engine import precision

STATE_PREFIX = "loss_scale."

_not_finite = ops.MultitypeFuncGraph("not_finite")


@_not_finite.register("Tensor")
def _count_not_finite(grad):
    return 1.0 - ops.cast(ops.isfinite(grad).all(), ms.float32)


class LossScaler(nn.Cell):
    """The loss scale of one train step and its update rule.

    Args:
        plan: fixed or dynamic, and the starting scale (`precision.loss_scale_plan`).
        world_size: ranks whose overflow flags are combined.
        scale_window: clean steps before the scale grows.
        rank: this rank, whose slot it fills in the per-rank overflow counts.
    """

    def __init__(self, plan: precision.LossScalePlan, world_size: int, scale_window: int = precision.SCALE_WINDOW,
                 rank: int = 0):
        super().__init__(auto_prefix=False)
        self.dynamic = plan.dynamic
        # A fixed scale of 1 is no scaling (float32 gradients: `auto` on CPU): it keeps the step without the
        # overflow check, its AllReduce and its control flow, as before.
        self.checked = plan.dynamic or plan.initial != 1.0
        self.scale_window = scale_window
        self.value = Parameter(Tensor(plan.initial, ms.float32), name=STATE_PREFIX + "value", requires_grad=False)
        self.cur_iter = Parameter(Tensor(1, ms.int32), name=STATE_PREFIX + "cur_iter", requires_grad=False)
        self.last_overflow_iter = Parameter(Tensor(0, ms.int32), name=STATE_PREFIX + "last_overflow_iter",
                                            requires_grad=False)
        # Fixed scale: the first (1-based) step whose gradients were not finite, 0 before one, and the ranks
        # where they were not. Not saved: a run that sets them stops before it writes anything.
        self.bad_step = Parameter(Tensor([0], ms.int32), name="loss_scale_bad_step", requires_grad=False)
        self.bad_ranks = Parameter(Tensor(np.zeros(world_size, np.float32)), name="loss_scale_bad_ranks",
                                   requires_grad=False)
        self.this_rank = Tensor(np.eye(world_size, dtype=np.float32)[rank])  # one-hot: this rank's slot
        self.all_reduce = ops.AllReduce() if world_size > 1 else None
        self.hyper_map = ops.HyperMap()

    def state_parameters(self) -> List[Parameter]:
        """The scale and its counters: what a checkpoint must hold for an exact resume."""
        return [self.value, self.cur_iter, self.last_overflow_iter]

    def sens(self, loss):
        """The backward seed: the scale, shaped and typed like the loss."""
        return ops.fill(loss.dtype, loss.shape, 1.0) * ops.cast(self.value, loss.dtype)

    def unscale(self, grads):
        inv = ops.reciprocal(self.value)
        return self.hyper_map(ops.partial(_times, inv), grads)

    def not_finite_by_rank(self, grads, across_ranks: bool = True):
        """Per rank, how many gradient tensors hold an inf or NaN: a (world_size,) vector, this rank's own
        count in its slot, and (across_ranks) every rank's after one AllReduce."""
        by_rank = self.this_rank * ops.addn(self.hyper_map(_not_finite, grads))
        if across_ranks and self.all_reduce is not None:
            by_rank = self.all_reduce(by_rank)
        return by_rank

    def overflow(self, grads, across_ranks: bool = True):
        """Whether any gradient element is inf or NaN, on this rank or (across_ranks) on any rank."""
        return self.not_finite_by_rank(grads, across_ranks).sum() > 0

    def update(self, overflow, by_rank=None, global_step=None):
        """After the gradients are checked: whether this step must leave the weights alone.

        Dynamic: one step of nn.DynamicLossScaleUpdateCell's rule, skipping an overflow step. Fixed: a
        non-finite step is recorded (`bad_step`, `bad_ranks`, sticky) and it and every later step skipped.

        Args:
            overflow: any rank's gradients (or their exchange) hold an inf or NaN.
            by_rank: `not_finite_by_rank` across ranks (fixed scale).
            global_step: the optimizer's step counter before this step (fixed scale).
        """
        if not self.dynamic:
            recorded = self.bad_step.sum() > 0
            stopped = ops.logical_or(overflow, recorded)
            first = ops.logical_and(overflow, ops.logical_not(recorded))
            step = ops.assign(self.bad_step, ops.select(ops.broadcast_to(first, self.bad_step.shape), global_step + 1,
                                                        self.bad_step))
            ranks = ops.assign(self.bad_ranks, ops.select(ops.broadcast_to(first, by_rank.shape), by_rank,
                                                          self.bad_ranks))
            return ops.depend(ops.depend(stopped, step), ranks)
        factor = precision.SCALE_FACTOR
        halved = ops.select(overflow, ops.maximum(self.value / factor, ops.ones_like(self.value)), self.value)
        grow = (self.cur_iter - self.last_overflow_iter) >= self.scale_window
        restart = ops.logical_or(overflow, grow)
        last = ops.assign(self.last_overflow_iter, ops.select(restart, self.cur_iter, self.last_overflow_iter))
        scaled = ops.select(ops.logical_and(grow, ops.logical_not(overflow)), halved * factor, halved)
        overflow = ops.depend(overflow, last)
        overflow = ops.depend(overflow, ops.assign(self.value, scaled))
        return ops.depend(overflow, ops.assign_add(self.cur_iter, ops.ones_like(self.cur_iter)))


_times = ops.MultitypeFuncGraph("times")


@_times.register("Tensor", "Tensor")
def _times_tensor(scalar, grad):
    return grad * ops.cast(scalar, grad.dtype)


def check_finite(scaler: LossScaler) -> None:
    """Stop a fixed-scale run whose gradients held an inf or NaN: call where the host waits for the device
    anyway (log steps) and before any weights are written. Reads two small Parameters; free when dynamic.

    Raises:
        NonFiniteError: naming the first such step and the ranks where it happened.
    """
    if scaler.dynamic or not scaler.checked:
        return
    step = int(scaler.bad_step.asnumpy()[0])
    if step == 0:
        return
    ranks = [str(r) for r, count in enumerate(scaler.bad_ranks.asnumpy()) if count > 0]
    where = f"rank {', '.join(ranks)}" if ranks else "the float16 gradient exchange"
    # Every rank reads the same all-reduced record, so one rank per host reports it (cli.cli_main).
    with alike_on_every_rank():
        raise NonFiniteError(f"step {step}: the loss or gradients are not finite (inf/NaN) on {where} with the fixed "
                             f"loss scale {float(scaler.value.asnumpy()):g}; training stopped before writing weights. "
                             "Use --loss_scale dynamic (it skips such steps), a smaller scale, or look at the data and "
                             "the learning rate")
