"""Cross-rank BatchNorm for CPU (mccl) and GPU (nccl) in GRAPH_MODE.

MindSpore's `nn.SyncBatchNorm` runs on Ascend only. With a small per-rank batch, plain BatchNorm
normalizes every rank over its own few samples, so N ranks train a different model than one card
with the same global batch. `SyncBatchNorm2d` normalizes over the global batch instead: one
AllReduce of [sum, sum of squares, count] per layer in the forward pass. AllReduce's own backward
(an AllReduce of the incoming gradient) carries the cross-rank terms of the gradient, so with the
data-parallel mean of gradients the update equals the single-card one.
"""
import logging

import mindspore as ms
from mindspore import Parameter, nn, ops

_logger = logging.getLogger(__name__)


class SyncBatchNorm2d(nn.Cell):
    """BatchNorm over the batch of all ranks (NCHW), a drop-in for `nn.BatchNorm2d`.

    Takes over the Parameters of an existing BatchNorm2d (same names), so checkpoints stay
    interchangeable with the plain model. Running statistics use the unbiased global variance,
    as `nn.BatchNorm2d` does, and are identical on every rank.

    Args:
        bn: the BatchNorm2d whose parameters and hyper-parameters are taken over.
    """

    def __init__(self, bn: nn.BatchNorm2d):
        super().__init__(auto_prefix=False)
        self.gamma: Parameter = bn.gamma
        self.beta: Parameter = bn.beta
        self.moving_mean: Parameter = bn.moving_mean
        self.moving_variance: Parameter = bn.moving_variance
        self.eps = float(bn.eps)
        # nn.BatchNorm2d stores 1 - momentum (the weight of the new batch statistic); keep the old value's.
        self.momentum = 1.0 - float(bn.momentum)
        self.all_reduce = ops.AllReduce()
        self.channels = int(bn.num_features)

    def construct(self, x):
        if not self.training:
            return self._normalize(x, self.moving_mean, self.moving_variance)
        n_local = ops.cast(ops.size(x) // self.channels, ms.float32)
        local = ops.concat((x.sum(axis=(0, 2, 3)), (x * x).sum(axis=(0, 2, 3)), n_local.reshape((1,))))
        total = self.all_reduce(local)
        count = total[2 * self.channels]
        mean = total[:self.channels] / count
        var = ops.maximum(total[self.channels:2 * self.channels] / count - mean * mean, 0.0)
        unbiased = ops.stop_gradient(var * count / ops.maximum(count - 1.0, 1.0))
        new_mean = self.momentum * self.moving_mean + (1.0 - self.momentum) * ops.stop_gradient(mean)
        new_var = self.momentum * self.moving_variance + (1.0 - self.momentum) * unbiased
        out = self._normalize(x, mean, var)
        out = ops.depend(out, ops.assign(self.moving_mean, new_mean))
        return ops.depend(out, ops.assign(self.moving_variance, new_var))

    def _normalize(self, x, mean, var):
        scale = self.gamma * ops.rsqrt(var + self.eps)
        shift = self.beta - mean * scale
        return x * scale.reshape((1, -1, 1, 1)) + shift.reshape((1, -1, 1, 1))


def convert_sync_batchnorm(net: nn.Cell, world_size: int) -> nn.Cell:
    """Replace every `nn.BatchNorm2d` in `net` with `SyncBatchNorm2d`, in place.

    With one rank there is nothing to synchronize: the model keeps MindSpore's fused BatchNorm,
    which is exactly plain BatchNorm.
    """
    if world_size == 1:
        return net
    replaced = 0
    for _, cell in net.cells_and_names():
        for child_name, child in list(cell.name_cells().items()):
            if isinstance(child, nn.BatchNorm2d):
                # Cell has no public "replace child" API; swap the entry and refresh the
                # SequentialCell's cached list, which its construct() iterates.
                cell._cells[child_name] = SyncBatchNorm2d(child)  # pylint: disable=protected-access
                if hasattr(cell, "cell_list"):
                    cell.cell_list = list(cell._cells.values())  # pylint: disable=protected-access
                replaced += 1
    _logger.info("sync_bn: %d BatchNorm layers now normalize over all %d ranks", replaced, world_size)
    return net
