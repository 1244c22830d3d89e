"""The loss scale inside the compiled train step: fixed, or dynamic with an overflow check.

Dynamic scaling follows MindSpore's `nn.DynamicLossScaleUpdateCell` (mindspore/nn/wrap/loss_scale.py):
on a step whose gradients hold an inf or NaN the scale is divided by `precision.SCALE_FACTOR` (never
below 1) and the step is skipped; after `precision.SCALE_WINDOW` steps since the last overflow or
increase it is multiplied by the factor. Every rank takes the same decision, so every rank skips the
same steps and keeps the same scale: the train step (`step.ScaledUpdate`) reads it from the
all-reduced gradients, which carry any rank's inf or NaN. The scale and both counters are Parameters
under STATE_PREFIX, declared by `LossScaler.state_parameters` and saved in checkpoints, so a resumed
run continues with the scale it had.

A fixed scale has no such rule, so an inf or NaN there is an error. Where float16 carries the
gradients (`precision.LossScalePlan.checked`) every step checks them AND the loss: a loss can be
non-finite while its gradients are not (MindSpore 2.10's CPU SparseSoftmaxCrossEntropyWithLogits takes
-log(softmax[label]) without log-sum-exp: a true-class logit 88 below the top one gives an inf loss and
a finite softmax-minus-one-hot gradient; msdist's own loss, engine/loss.py, no longer does, but the check
does not rest on any one loss), so checking the gradients alone would let an inf loss pass. A non-finite step is skipped in the graph, and so is every step after it, while the step number
and the ranks where it happened stay in two sticky Parameters. Under float32 no scale can overflow,
so no step pays for a check: instead `check_finite` reads, at the log steps where the host waits for
the device anyway, the window's mean loss and whether the weights are all finite (a non-finite
gradient reaches them). On every path the host reads the verdict at log steps and before it writes
weights, and the run stops with one line naming the step, so no weights that saw an inf are written.
"""
import math
from typing import List, Optional

import numpy as np
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops
import mindspore as ms

from msdist.base.errors import NonFiniteError, alike_on_every_rank
from msdist.engine import precision

STATE_PREFIX = "loss_scale."

_not_finite = ops.MultitypeFuncGraph("not_finite")


@_not_finite.register("Tensor")
def _count_not_finite(tensor):
    return 1.0 - ops.cast(ops.isfinite(tensor).all(), ms.float32)


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
        # Unchecked (a fixed scale under float32): the step has no overflow check, no AllReduce for it and no
        # control flow; `check_finite` catches an inf or NaN at the log steps instead.
        self.checked = plan.checked or plan.dynamic
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

    def not_finite_by_rank(self, grads, loss=None, across_ranks: bool = True):
        """Per rank, how many gradient tensors (and the loss, if given) hold an inf or NaN: a (world_size,)
        vector, this rank's own count in its slot, and (across_ranks) every rank's after one AllReduce."""
        count = ops.addn(self.hyper_map(_not_finite, grads))
        if loss is not None:
            count = count + _count_not_finite(loss)
        by_rank = self.this_rank * count
        if across_ranks and self.all_reduce is not None:
            by_rank = self.all_reduce(by_rank)
        return by_rank

    def overflow(self, grads, across_ranks: bool = True):
        """Whether any gradient element is inf or NaN, on this rank or (across_ranks) on any rank."""
        return self.not_finite_by_rank(grads, across_ranks=across_ranks).sum() > 0

    def update(self, overflow, by_rank=None, global_step=None):
        """After the gradients are checked: whether this step must leave the weights alone.

        Dynamic: one step of nn.DynamicLossScaleUpdateCell's rule, skipping an overflow step. Fixed: a
        non-finite step is recorded (`bad_step`, `bad_ranks`, sticky) and it and every later step skipped.

        Args:
            overflow: any rank's gradients (or their exchange) hold an inf or NaN, or (fixed) its loss does.
            by_rank: `not_finite_by_rank` of the gradients and the loss, across ranks (fixed scale).
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


class FiniteWeights(nn.Cell):
    """Whether these Parameters hold an inf or NaN (1.0) or not (0.0): run at log steps only (where the host
    syncs anyway) on the unchecked path, where a non-finite gradient would reach the weights unseen.

    One ReduceSum per tensor and one scalar check: a sum holding an inf or NaN is not finite (inf - inf is
    NaN), and a single read pass costs a fraction of IsFinite, which writes a mask as large as the weights.
    Finite weights whose sum overflows float32 (|w| ~ 1e31) would read as non-finite: a diverged run anyway.
    """

    def __init__(self, params):
        super().__init__(auto_prefix=False)
        self.params = ParameterTuple(params)
        self.hyper_map = ops.HyperMap()

    def construct(self):
        return _count_not_finite(ops.addn(self.hyper_map(_sum_of, self.params)))


_sum_of = ops.MultitypeFuncGraph("sum_of")


@_sum_of.register("Tensor")
def _tensor_sum(tensor):
    return ops.cast(tensor, ms.float32).sum()


def check_finite(scaler: LossScaler, weights: Optional[FiniteWeights] = None, loss: Optional[float] = None,
                 step: int = 0) -> None:
    """Stop a run that met an inf or NaN: call where the host waits for the device anyway (log steps, with the
    window's mean `loss` over all ranks, the same on every rank) and before any weights are written.

    Checked fixed scale: reads the sticky record the step keeps (the first bad step and its ranks). Unchecked
    (float32): counts the non-finite `weights` (a non-finite gradient lands there). Every path: the loss.

    Raises:
        NonFiniteError: naming the step (or the last step of the window) and, where known, the ranks.
    """
    if scaler.checked and not scaler.dynamic:
        _check_record(scaler)
    if loss is not None and not math.isfinite(loss):
        _stop(f"step {step}: the mean training loss since the last log line is {loss} (not finite)", scaler)
    if weights is not None and float(weights().asnumpy()) > 0:
        _stop(f"step {step}: the weights hold an inf or NaN, so the gradients of a step since the last check were "
              "not finite", scaler)


def _check_record(scaler: LossScaler) -> None:
    step = int(scaler.bad_step.asnumpy()[0])
    if step == 0:
        return
    ranks = [str(r) for r, count in enumerate(scaler.bad_ranks.asnumpy()) if count > 0]
    where = f"rank {', '.join(ranks)}" if ranks else "the float16 gradient exchange"
    _stop(f"step {step}: the loss or gradients are not finite (inf/NaN) on {where}", scaler)


def _stop(what: str, scaler: LossScaler) -> None:
    scale = f"the fixed loss scale {float(scaler.value.asnumpy()):g}" if not scaler.dynamic else "a dynamic loss scale"
    # Every rank reads the same all-reduced record or cross-rank loss, so one rank per host reports it (cli.cli_main).
    with alike_on_every_rank():
        raise NonFiniteError(f"{what} with {scale}; training stopped before writing weights. Use --loss_scale dynamic "
                             "(it skips overflowing steps), a smaller scale or learning rate, or look at the data")
