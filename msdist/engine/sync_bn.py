"""Cross-rank BatchNorm for CPU (mccl) and GPU (nccl) in GRAPH_MODE, and one model per job without it.

MindSpore's `nn.SyncBatchNorm` runs on Ascend only. With a small per-rank batch, plain BatchNorm
normalizes every rank over its own few samples, so N ranks train a different model than one card
with the same global batch. `SyncBatchNorm2d` normalizes over the global batch instead, with the
same two collectives as PyTorch's SyncBatchNorm:

- forward: one AllGather of each rank's [mean, M2] per channel (M2 = sum of squared deviations
  from the rank's own mean), combined by Chan's formula in the same order on every rank: no
  E[x^2] - E[x]^2 cancellation, and bitwise-identical statistics everywhere;
- backward (explicit, not derived by autodiff): MindSpore's BatchNorm gradient kernel with the global
  statistics held constant gives gamma * invstd * dy and this rank's sum(dy), sum(dy * x_hat) in one
  pass; one AllReduce of the two sums; one affine map of x adds the terms of their global means.
  The same sums over the world size are the job's gradients of gamma and beta, so the data-parallel
  reducer leaves them out (`layerwise_parallel`) instead of averaging them a second time.

Every rank's batch has the same shape (one graph serves all ranks, and msdist's loader drops the
remainder), so the global count is a number known when the graph is built, not a collective's payload.

The statistics come in two precisions (`STATS_PRECISIONS`, chosen by `precision.bn_stats_precision`):

- float64 (CPU): the forward sums are float64 matrix products (`_exact_channel_sums`: the same
  correctly rounded sums as MindSpore's ReduceSum, several times faster), which keeps the 1-vs-N
  equivalence of docs/equivalence.md bit-close;
- float32 (GPU, where float64 runs at 1/32 to 1/64 of the float32 rate on consumer cards): float32
  sums in the corrected two-pass form (`_float32_moments`: the mean, then the sums of the centred
  values and of their squares, which correct the mean and give M2 without cancellation), merged
  across ranks by the same Chan formula. Tested on CPU against a float64 reference.

On CPU the layer's cost is in its per-channel reductions and full-size temporaries, so every per-channel affine map of a full-size tensor
goes through MindSpore's fused inference BatchNorm kernel, one output tensor; and the statistics
(`_GlobalMoments`) are computed apart from the normalization (`_SyncNormalize`), whose backward reads
its inputs only, so the step keeps no more activations than with nn.BatchNorm2d.

The layer's memory is its graph size: MindSpore 2.10 keeps 100-200 KB of resident memory per graph
node on CPU, whatever the node computes. So constants are tensors built once, the count is static,
each running average is one Lerp and the backward is one gradient kernel plus one affine map
(docs/performance.md has the figures).

Without sync_bn, `unify_bn_stats` makes the per-rank running statistics one model (`--dist_bn`).
"""
import logging

import mindspore as ms
import numpy as np
from mindspore import Parameter, nn, ops
from mindspore.ops.operations._grad_ops import BatchNormGrad  # nn.BatchNorm2d's backward kernel

_logger = logging.getLogger(__name__)
DIST_BN_MODES = ("reduce", "broadcast", "none")
STATS_PRECISIONS = ("float64", "float32")


def _exact_channel_sums(t):
    """sum over N, H, W of a float32 NCHW tensor, per channel, correctly rounded to float32.

    MindSpore's CPU ReduceSum accumulates float32 in double, one element at a time through a strided
    iterator. A float64 matrix product against a ones vector gives the same sums, bitwise on the
    ResNet-50 layer shapes measured (and unit-tested), 2-6x faster (layer1 at 100 px: 3.4 ms vs 11.6).
    The rounding of the forward statistics decides which pre-activations near zero pass the next
    ReLU: a float32 matrix product differs in the last bits, and on ResNet-18 with 4 ranks that
    flipped one decision (a 4e-2 gap instead of 3e-6, docs/equivalence.md). Float64 also gives GPU
    the same correctly rounded statistics, where a float32 reduction would round its own way.
    """
    n, c, h, w = t.shape
    rows = ops.matmul(ops.cast(t, ms.float64).reshape((n * c, h * w)), ops.ones((h * w, 1), ms.float64))
    return ops.cast(rows.reshape((n, c)).sum(axis=0), ms.float32)


def _float32_moments(t, affine, one, zero):
    """(mean, M2) per channel of a float32 NCHW tensor with float32 sums only, by the corrected two-pass
    algorithm (Chan, Golub & LeVeque 1983): a first mean, then the sums of the centred values d and of d^2.
    sum(d) corrects the first mean's rounding, and M2 = sum(d^2) - sum(d)^2 / n has no E[x^2] - E[x]^2
    cancellation however far the mean lies from zero."""
    n = _per_rank_count(t)
    rough = t.sum(axis=(0, 2, 3)) / n
    centred = affine(t, one, zero, rough)
    residual = centred.sum(axis=(0, 2, 3))
    m2 = ops.square(centred).sum(axis=(0, 2, 3)) - ops.square(residual) / n
    return rough + residual / n, ops.maximum(m2, zero)


def _per_rank_count(t):
    """Values per channel in this rank's NCHW batch: N * H * W, a number when the graph is built."""
    return t.shape[0] * t.shape[2] * t.shape[3]


def _global_count(t, world_size: int):
    """Values per channel over all ranks' batches: every rank's batch has t's shape."""
    return _per_rank_count(t) * world_size


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

    def __init__(self, eps: float, channels: int, world_size: int, stats: str = "float64"):
        super().__init__(eps, channels)
        self.one = ms.Tensor(np.ones(channels, np.float32))
        self.world_size = world_size
        self.gather = ops.AllGather() if world_size > 1 else None
        self.exact = stats == "float64"

    def construct(self, x):
        n_local = _per_rank_count(x)
        if self.exact:
            mean_local = _exact_channel_sums(x) / n_local
            # Two-pass: the sum of squares of the centred values, no E[x^2] - E[x]^2 cancellation.
            m2_local = _exact_channel_sums(ops.square(self.affine(x, self.one, self.zero, mean_local)))
        else:
            mean_local, m2_local = _float32_moments(x, self.affine, self.one, self.zero)
        if self.gather is None:
            return mean_local, m2_local / n_local
        count = _global_count(x, self.world_size)
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
        # Inference mode on purpose: the training-mode kernel would read what a training forward saved,
        # which differs by backend (cuDNN: inverse std and a reserve space; oneDNN: the variance), and this
        # layer's forward is not one. In inference mode both read (mean, variance), as MindSpore's own
        # bprop passes them (ccsrc: batch_norm_grad_gpu_kernel.cc CalBatchNormGrad; oneDNN global stats).
        self.constant_stats_grad = BatchNormGrad(is_training=False, epsilon=eps)

    def construct(self, x, gamma, beta, mean, var):
        return self.normalize(x, gamma, beta, mean, var)[0]

    def bprop(self, x, gamma, beta, mean, var, out, dy):  # pylint: disable=unused-argument
        # MindSpore's BatchNorm gradient kernel in inference mode (statistics held constant) gives
        # gamma * invstd * dy and this rank's sum(dy * x_hat), sum(dy) in one pass over dy and x.
        dy_scaled, sum_dy_xhat, sum_dy = self.constant_stats_grad(dy, x, gamma, mean, var, var)
        sums = ops.stack((sum_dy, sum_dy_xhat))
        if self.all_reduce is not None:
            sums = self.all_reduce(sums)
        count = _global_count(x, self.world_size)
        minus_mean_dy, minus_mean_dy_xhat = ops.unstack(sums / -count)
        # dx = gamma * invstd * (dy - mean_dy - x_hat * mean_dy_xhat)
        #    = dy_scaled + [a * invstd * -mean_dy_xhat] * (x - mean) + [a * -mean_dy], a = gamma * invstd.
        invstd = ops.rsqrt(var + self.eps)
        a = gamma * invstd
        dx = dy_scaled + self.affine(x, a * invstd * minus_mean_dy_xhat, a * minus_mean_dy, mean)
        # dgamma and dbeta: the all-reduced sums divided by the number of ranks are already the job's mean
        # gradient, identical on every rank, so the data-parallel reducer skips them (SyncBatchNorm2d marks them).
        # The statistics get none: their effect on x's gradient is already in dx.
        d_beta, d_gamma = ops.unstack(sums / self.world_size)
        return dx, d_gamma, d_beta, self.zero, self.zero


class SyncBatchNorm2d(nn.BatchNorm2d):
    """BatchNorm over the batch of all ranks (NCHW), a drop-in for `nn.BatchNorm2d`.

    Takes over the Parameters of an existing BatchNorm2d (same names), so checkpoints stay
    interchangeable with the plain model. Running statistics use the unbiased global variance,
    as `nn.BatchNorm2d` does, and are identical on every rank. Statistics are float32 whatever the
    input dtype; under `auto_mixed_precision` O2 the layer stays float32 like `nn.BatchNorm2d`.

    Args:
        bn: the BatchNorm2d whose parameters and hyper-parameters are taken over.
        world_size: number of ranks normalized over (1 = this process only: the same statistics, no
            collectives; the control that measures how MindSpore's fused BatchNorm rounds differently).
        stats: the statistics' precision, one of STATS_PRECISIONS (`precision.bn_stats_precision`).
    """

    def __init__(self, bn: nn.BatchNorm2d, world_size: int, stats: str = "float64"):  # pylint: disable=super-init-not-called
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
        if world_size > 1:
            # The backward returns their gradients already averaged over ranks (module docstring); MindSpore's
            # reducer skips layerwise_parallel parameters. msdist's compressed reducers average them again, which
            # leaves identical values as they are.
            self.gamma.layerwise_parallel = self.beta.layerwise_parallel = True
        self.moments = _GlobalMoments(self.eps, self.num_features, world_size, stats)
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
        count = _global_count(x, self.world_size)
        unbiased = var * (count / max(count - 1, 1))
        # Side effects: MindSpore's auto-monad runs both assignments in order without a Depend on y.
        ops.assign(self.moving_mean, ops.lerp(self.moving_mean, mean, self.momentum))
        ops.assign(self.moving_variance, ops.lerp(self.moving_variance, unbiased, self.momentum))
        return ops.cast(y, x.dtype)


def convert_sync_batchnorm(net: nn.Cell, world_size: int, stats: str = "float64") -> nn.Cell:
    """Replace every `nn.BatchNorm2d` in `net` with `SyncBatchNorm2d` (statistics in `stats`), in place.

    With one rank there is nothing to synchronize: the model keeps MindSpore's fused BatchNorm,
    which is exactly plain BatchNorm.
    """
    if world_size == 1:
        return net
    replaced = replace_batchnorm(net, world_size, stats)
    _logger.info("sync_bn: %d BatchNorm layers now normalize over all %d ranks (%s statistics)", replaced,
                 world_size, stats)
    return net


def replace_batchnorm(net: nn.Cell, world_size: int, stats: str = "float64") -> int:
    """Swap every plain `nn.BatchNorm2d` in `net` for a `SyncBatchNorm2d` over `world_size` ranks.

    `world_size=1` gives msdist's BatchNorm math on one process: the control that measures how far
    two correct single-card BatchNorm implementations drift apart.

    Returns:
        How many layers were replaced.
    """
    replaced = 0
    for _, cell in net.cells_and_names():
        for child_name, child in list(cell.name_cells().items()):
            if type(child) is nn.BatchNorm2d:  # pylint: disable=unidiomatic-typecheck  # not SyncBatchNorm2d
                # Cell has no public "replace child" API; swap the entry and refresh the
                # SequentialCell's cached list, which its construct() iterates.
                cell._cells[child_name] = SyncBatchNorm2d(child, world_size, stats)  # pylint: disable=protected-access
                if hasattr(cell, "cell_list"):
                    cell.cell_list = list(cell._cells.values())  # pylint: disable=protected-access
                replaced += 1
    return replaced
