"""Cross-rank BatchNorm for CPU (mccl) and GPU (nccl) in GRAPH_MODE, and one model per job without it.

MindSpore's `nn.SyncBatchNorm` runs on Ascend only. With a small per-rank batch, plain BatchNorm
normalizes every rank over its own few samples, so N ranks train a different model than one card
with the same global batch. `SyncBatchNorm2d` normalizes over the global batch instead, with the
same two collectives as PyTorch's SyncBatchNorm:

- forward: one AllGather of each rank's [mean, M2] per channel (M2 = sum of squared deviations
  from the rank's own mean), combined by Chan's formula in the same order on every rank: no
  E[x^2] - E[x]^2 cancellation, and bitwise-identical statistics everywhere;
- backward (explicit, not derived by autodiff): one AllReduce of [sum(dy), sum(dy * x_hat)], then
  the element-wise BatchNorm gradient with the global means of both sums.

Every rank's batch has the same shape (one graph serves all ranks, and msdist's loader drops the
remainder), so the global count is a number known when the graph is built, not a collective's payload.

On CPU the cost of the layer is in its per-channel reductions and full-size temporaries, so:
every per-channel affine map of a full-size tensor (centring x, forming dx) goes through MindSpore's
fused inference BatchNorm kernel, one output tensor; the backward's sums run as matrix products
(`_channel_sums`, `_channel_dots`); and the statistics (`_GlobalMoments`) are computed apart from
the normalization (`_SyncNormalize`), whose backward reads its inputs only, so the step keeps no
more activations than with nn.BatchNorm2d. The forward statistics keep ReduceSum: computed as
matrix products they round differently, and on ResNet-18 with 4 ranks that moved one pre-activation
across a ReLU (a 4e-2 gap instead of 3e-6). ResNet-50, 100 px, batch 16, one process: 2.10 s/step vs
1.51 for nn.BatchNorm2d (2.54 before).

The layer's memory is its graph size: MindSpore 2.10 keeps 100-200 KB of resident memory per graph
node on CPU, whatever the node computes. So constants are tensors built once, the count is static,
and each running average is one Lerp: a third fewer nodes than a direct transcription, and ResNet-50
with 2 ranks peaks at 1744 MB per rank instead of 2005 (nn.BatchNorm2d: 1303; docs/performance.md).

Without sync_bn, `unify_bn_stats` makes the per-rank running statistics one model (`--dist_bn`).
"""
import logging

import mindspore as ms
import numpy as np
from mindspore import Parameter, nn, ops

_logger = logging.getLogger(__name__)
_STAT_AXES = (0, 2, 3)
DIST_BN_MODES = ("reduce", "broadcast", "none")


# The backward's per-channel reductions of NCHW tensors as matrix products: each (sample, channel)
# plane is a contiguous row, so these run as GEMV/batched dot kernels. ReduceSum over axes (0, 2, 3) is 2-3x
# slower on CPU (ResNet-50 layer3, batch 8: 7 ms vs 2 ms for a sum, 10 ms vs 4 ms for sum(dy * x)).
# On GPU they stay full float32: MindSpore leaves TF32 off for MatMul unless matmul_allow_tf32 is set.
def _channel_sums(t):
    """sum over N, H, W of t, per channel."""
    n, c, h, w = t.shape
    rows = ops.matmul(t.reshape((n * c, h * w)), ops.ones((h * w, 1), t.dtype))
    return rows.reshape((n, c)).sum(axis=0)


def _channel_dots(t, u):
    """sum over N, H, W of t * u, per channel."""
    n, c, h, w = t.shape
    return ops.bmm(t.reshape((n * c, 1, h * w)), u.reshape((n * c, h * w, 1))).reshape((n, c)).sum(axis=0)


def _per_rank_count(t):
    """Values per channel in this rank's NCHW batch: N * H * W, a number when the graph is built."""
    return t.shape[0] * t.shape[2] * t.shape[3]


class _BatchNormMath(nn.Cell):
    """What both halves of SyncBatchNorm2d share: eps, MindSpore's fused inference BatchNorm kernel,
    and float32 always (auto_mixed_precision O3 flags every cell float16, but a float16 sum of squares
    over the global batch overflows).

    The per-channel constants are built here once, not by ops in the graph: on CPU every graph node
    costs MindSpore ~100-200 KB of resident memory whatever its size, so the layer's memory is its
    node count (docs/performance.md).
    """

    def __init__(self, eps: float, channels: int):
        super().__init__()
        self.eps = eps
        self.normalize = ops.BatchNorm(is_training=False, epsilon=eps)
        self.zero = ms.Tensor(np.zeros(channels, np.float32))
        self.unit = ms.Tensor(np.full(channels, 1.0 - eps, np.float32))  # the kernel divides by sqrt(unit + eps) = 1

    def add_flags_recursive(self, **flags):
        if flags.get("fp16") or flags.get("bf16"):
            flags = dict(flags, fp16=False, bf16=False, fp32=True)
        return super().add_flags_recursive(**flags)

    def affine(self, t, scale, shift, centre):
        """scale * (t - centre) + shift per channel, in the fused kernel: one output tensor (see the
        module docstring)."""
        return self.normalize(t, scale, shift, centre, self.unit)[0]


class _GlobalMoments(_BatchNormMath):
    """x -> (mean, biased var) per channel over the batch of all ranks. Not differentiated:
    `_SyncNormalize.bprop` carries the gradient through the statistics.

    Every rank's batch has the same shape (one compiled graph for all ranks; msdist's loader drops
    the remainder), so the global count is known when the graph is built.
    """

    def __init__(self, eps: float, channels: int, world_size: int):
        super().__init__(eps, channels)
        self.one = ms.Tensor(np.ones(channels, np.float32))
        self.world_size = world_size
        self.gather = ops.AllGather() if world_size > 1 else None

    def construct(self, x):
        n_local = _per_rank_count(x)
        # ReduceSum, not _channel_sums: the forward statistics' rounding decides which pre-activations
        # near zero pass the next ReLU; the matrix-product sum flipped one on ResNet-18 with 4 ranks.
        mean_local = x.mean(axis=_STAT_AXES)
        # Two-pass: the sum of squares of the centred values, no E[x^2] - E[x]^2 cancellation.
        m2_local = ops.square(self.affine(x, self.one, self.zero, mean_local)).sum(axis=_STAT_AXES)
        if self.gather is None:
            return mean_local, m2_local / n_local
        count = n_local * self.world_size
        means, m2s = ops.unstack(self.gather(ops.stack((mean_local, m2_local))).reshape((self.world_size, 2, -1)),
                                 axis=1)  # rank-major, same order everywhere
        mean = (means * n_local).sum(axis=0) / count
        # Chan et al.: M2 = sum of the ranks' M2 + sum of n_r * (mean_r - mean)^2, both terms >= 0.
        m2 = m2s.sum(axis=0) + (ops.square(means - mean) * n_local).sum(axis=0)
        return mean, m2 / count


class _SyncNormalize(_BatchNormMath):
    """(x, gamma, beta, global mean, global var) -> y, with the gradient of BatchNorm over all ranks.

    Holds no Parameters: a custom `bprop` returns gradients for its inputs only, so gamma and beta
    come in as inputs and their gradients go out through the ordinary data-parallel reducer. The
    bprop reads its inputs, never `out`, so y is not kept alive until the backward pass (the next
    layer keeps what it needs, as with nn.BatchNorm2d).
    """

    def __init__(self, eps: float, channels: int, world_size: int):
        super().__init__(eps, channels)
        self.world_size = world_size
        self.all_reduce = ops.AllReduce() if world_size > 1 else None

    def construct(self, x, gamma, beta, mean, var):
        return self.normalize(x, gamma, beta, mean, var)[0]

    def bprop(self, x, gamma, beta, mean, var, out, dy):  # pylint: disable=unused-argument
        invstd = ops.rsqrt(var + self.eps)
        sum_dy = _channel_sums(dy)
        # sum(dy * x_hat) = invstd * (sum(dy * x) - mean * sum(dy)): no full-size temporary at all.
        sum_dy_xhat = invstd * (_channel_dots(dy, x) - mean * sum_dy)
        sums = ops.stack((sum_dy, sum_dy_xhat))
        if self.all_reduce is not None:
            sums = self.all_reduce(sums)
        count = _per_rank_count(x) * self.world_size
        minus_mean_dy, minus_mean_dy_xhat = ops.unstack(sums / -count)
        # dx = gamma * invstd * (dy - mean_dy - x_hat * mean_dy_xhat)
        #    = a * dy + [a * invstd * -mean_dy_xhat] * (x - mean) + [a * -mean_dy], two fused affine maps.
        a = gamma * invstd
        dx = self.affine(dy, a, self.zero, self.zero) + self.affine(x, a * invstd * minus_mean_dy_xhat,
                                                                    a * minus_mean_dy, mean)
        # This rank's share of dgamma/dbeta: the data-parallel reducer averages them like any gradient.
        # The statistics get none: their effect on x's gradient is already in dx.
        return dx, sum_dy_xhat, sum_dy, self.zero, self.zero


class SyncBatchNorm2d(nn.BatchNorm2d):
    """BatchNorm over the batch of all ranks (NCHW), a drop-in for `nn.BatchNorm2d`.

    Takes over the Parameters of an existing BatchNorm2d (same names), so checkpoints stay
    interchangeable with the plain model. Running statistics use the unbiased global variance,
    as `nn.BatchNorm2d` does, and are identical on every rank. Statistics are float32 whatever the
    input dtype; under `auto_mixed_precision` O2 the layer stays float32 like `nn.BatchNorm2d`.

    Args:
        bn: the BatchNorm2d whose parameters and hyper-parameters are taken over.
        world_size: number of ranks normalized over (1 = this process only: the same math, no
            collectives; used as the element-wise control of MindSpore's fused BatchNorm).
    """

    def __init__(self, bn: nn.BatchNorm2d, world_size: int):  # pylint: disable=super-init-not-called
        # A BatchNorm2d by type, so MindSpore's AMP black list (isinstance) keeps it float32 at O2;
        # nn.BatchNorm2d.__init__ is skipped because it would create Parameters that bn already holds.
        nn.Cell.__init__(self, auto_prefix=False)  # pylint: disable=non-parent-init-called
        self.gamma: Parameter = bn.gamma
        self.beta: Parameter = bn.beta
        self.moving_mean: Parameter = bn.moving_mean
        self.moving_variance: Parameter = bn.moving_variance
        self.num_features = int(bn.num_features)
        self.eps = float(bn.eps)
        self.momentum = float(bn.momentum)  # as nn.BatchNorm2d stores it: the weight of the new batch statistic
        self.world_size = world_size
        self.moments = _GlobalMoments(self.eps, self.num_features, world_size)
        self.sync_normalize = _SyncNormalize(self.eps, self.num_features, world_size)
        self.inference = ops.BatchNorm(is_training=False, epsilon=self.eps)

    def construct(self, x):
        if not self.training:
            return self.inference(x, self.gamma, self.beta, self.moving_mean, self.moving_variance)[0]
        x32 = ops.cast(x, ms.float32)
        # Autodiff must not enter the statistics: the normalization's bprop already carries their
        # gradient, and differentiating them would add the AllGather's backward, one more collective.
        mean, var = ops.stop_gradient(self.moments(x32))
        y = self.sync_normalize(x32, ops.cast(self.gamma, ms.float32), ops.cast(self.beta, ms.float32), mean, var)
        count = _per_rank_count(x) * self.world_size
        unbiased = var * (count / max(count - 1, 1))
        # Side effects: MindSpore's auto-monad runs both assignments in order without a Depend on y.
        ops.assign(self.moving_mean, ops.lerp(self.moving_mean, mean, self.momentum))
        ops.assign(self.moving_variance, ops.lerp(self.moving_variance, unbiased, self.momentum))
        return ops.cast(y, x.dtype)


def convert_sync_batchnorm(net: nn.Cell, world_size: int) -> nn.Cell:
    """Replace every `nn.BatchNorm2d` in `net` with `SyncBatchNorm2d`, in place.

    With one rank there is nothing to synchronize: the model keeps MindSpore's fused BatchNorm,
    which is exactly plain BatchNorm.
    """
    if world_size == 1:
        return net
    replaced = replace_batchnorm(net, world_size)
    _logger.info("sync_bn: %d BatchNorm layers now normalize over all %d ranks", replaced, world_size)
    return net


def replace_batchnorm(net: nn.Cell, world_size: int) -> int:
    """Swap every plain `nn.BatchNorm2d` in `net` for a `SyncBatchNorm2d` over `world_size` ranks.

    `world_size=1` gives msdist's element-wise BatchNorm on one process: the control that measures
    how far two correct single-card BatchNorm implementations drift apart.

    Returns:
        How many layers were replaced.
    """
    replaced = 0
    for _, cell in net.cells_and_names():
        for child_name, child in list(cell.name_cells().items()):
            if type(child) is nn.BatchNorm2d:  # pylint: disable=unidiomatic-typecheck  # not SyncBatchNorm2d
                # Cell has no public "replace child" API; swap the entry and refresh the
                # SequentialCell's cached list, which its construct() iterates.
                cell._cells[child_name] = SyncBatchNorm2d(child, world_size)  # pylint: disable=protected-access
                if hasattr(cell, "cell_list"):
                    cell.cell_list = list(cell._cells.values())  # pylint: disable=protected-access
                replaced += 1
    return replaced
