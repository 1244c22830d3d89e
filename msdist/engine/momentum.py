"""SGD with momentum whose step a device flag can skip, with no branch in the graph.

`if not overflow: optimizer(grads)` in a GRAPH_MODE cell compiles to control flow whose condition the
runtime reads back to the host in the middle of the step (a condition-switch actor): every kernel after it
waits for that copy. `Momentum.step_unless` instead always launches the same ApplyMomentum kernels and
makes them leave the state alone when `skip` is set: momentum 1, learning rate 0 and a zero gradient give
`accum * 1 + 0 = accum` and `weight - 0 * accum = weight`, exactly (both finite; only a zero's sign could
change). When `skip` is not set every input is the value nn.Momentum itself would pass, through the same
kernel, so the result is bit for bit nn.Momentum's. Weight decay is applied before the zeroing, as
nn.Momentum applies it, so a skipped step does not decay either.

The step counter (the learning-rate schedule's position) advances on every step, skipped or not, as the
log lines count data steps.
"""
from mindspore import Tensor, nn, ops
from mindspore.common import dtype as mstype

_zero_if = ops.MultitypeFuncGraph("zero_if")


@_zero_if.register("Tensor", "Tensor")
def _zero_if_flag(flag, value):
    return ops.select(ops.broadcast_to(flag, value.shape), ops.zeros_like(value), value)


def zeroed_if(flag, tensors):
    """Each of `tensors` replaced by zeros where the scalar bool `flag` is set (inf/NaN never pass)."""
    return ops.HyperMap()(ops.partial(_zero_if, flag), tensors)


_apply = ops.MultitypeFuncGraph("apply_momentum")


@_apply.register("Function", "Tensor", "Tensor", "Tensor", "Tensor", "Tensor")
def _apply_one(opt, momentum, lr, gradient, weight, moment):
    return ops.depend(True, opt(weight, moment, lr, gradient, momentum))


class Momentum(nn.Momentum):
    """nn.Momentum (its construct, parameters and state names unchanged) plus `step_unless`.

    Built only from nn.Optimizer's public hooks for user-defined optimizers (`decay_weight`,
    `gradients_centralization`, `scale_grad`, `get_lr`) and the public `ops.ApplyMomentum`.
    """

    def __init__(self, params, learning_rate, momentum: float, use_nesterov: bool = False):
        super().__init__(params, learning_rate, momentum, use_nesterov=use_nesterov)
        self.apply_momentum = ops.ApplyMomentum(use_nesterov=use_nesterov)
        self.one_step = Tensor([1], mstype.int32)
        self.hyper_map = ops.HyperMap()

    def step_unless(self, gradients, skip):
        """One optimizer step that changes no weight and no moment where the scalar bool `skip` is set."""
        # Zeroed before the weight decay as well: a select between the exchange's mean and the decay's AddN keeps
        # MindSpore's AdjustAllReduceMulAdd (frontend/optimizer/irpass/arithmetic_simplify.h: AddN(Mul(AllReduce(X),
        # Y), Z) -> Mul(AllReduce(AddN(Z, X)), Y)) from sending every decayed gradient through a second AllReduce
        # beside the one the overflow check reads, and keeps the sums what the step computed before.
        gradients = self.decay_weight(zeroed_if(skip, gradients))
        gradients = self.gradients_centralization(gradients)
        gradients = zeroed_if(skip, self.scale_grad(gradients))   # the decay adds weight x decay to a zero gradient
        lr = self.get_lr()
        advanced = ops.assign_add(self.global_step, self.one_step)
        momentum = ops.depend(ops.select(skip, ops.ones_like(self.momentum), self.momentum), advanced)
        if self.is_group_lr:  # one learning rate per parameter
            lr = self.hyper_map(ops.partial(_zero_if, skip), lr)
            return self.hyper_map(ops.partial(_apply, self.apply_momentum, momentum), lr, gradients, self.params,
                                  self.moments)
        lr = _zero_if_flag(skip, lr)
        return self.hyper_map(ops.partial(_apply, self.apply_momentum, momentum, lr), gradients, self.params,
                              self.moments)
