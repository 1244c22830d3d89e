"""Gradient communication: how the ranks' gradients become one update (the reducers).

`grad_compression` picks the reducer that `create_reducer` builds:

- none: MindSpore's fused float32 all-reduce (`default_reducer`), untouched.
- fp16: float16 buckets of the flattened gradients, one `ops.AllReduce` each: 2 bytes per element on
  the wire (measured: benchmarks/grad_comm.py).
- topk: each rank sends the `topk_ratio` largest-magnitude elements of every gradient tensor as
  (index, value) pairs through AllGather; every rank scatter-adds the ranks' pairs into a dense
  tensor, one rank's chunk after the other (a fixed order of additions, so replicas stay
  bit-identical), and divides by the world size (the mean).
- threshold: like topk, but only elements whose magnitude exceeds `threshold` are sent. Graph mode
  needs static shapes, so the exchange buffer keeps its topk size: the top-K candidates below the
  threshold travel as zeros (padding) and stay in the residual.

With error feedback (the default) topk and threshold keep a residual per parameter: what a rank did
not send this step is added to its next gradient (Seide et al. 2014; Lin et al. 2018, "Deep
Gradient Compression"). Residuals are rank-local state, declared by `state_parameters` under
RESIDUAL_PREFIX and saved in each rank's checkpoint, so a resumed run continues exactly.

The train step (`step.ScaledUpdate`) divides the loss scale out before the reducer, so thresholds
and residuals are in plain gradient units whatever the (dynamic) scale does; only the float16
exchange gets the gradients still scaled (`reduces_scaled`), which keeps small values above float16's
underflow.
"""
from typing import List, Optional, Sequence

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

from msdist.base.errors import ConfigError
from msdist.engine.buckets import Bucket, plan_buckets, sizes_of

COMPRESSIONS = ("none", "fp16", "topk", "threshold")
RESIDUAL_PREFIX = "residual."


def kept_elements(size: int, ratio: float) -> int:
    """Elements a sparse reducer sends for a tensor of `size` elements: `ratio` of them, at least one."""
    return max(1, min(size, int(size * ratio)))


class Fp16BucketAllReduce(nn.Cell):
    """Mean over ranks carried in float16: gradients flattened into float16 buckets, one AllReduce each.

    MindSpore's `nn.DistributedGradReducer` casts float16 gradients back to float32 before its
    all-reduce (mindspore/nn/wrap/grad_reducer.py), so it would send float32. Here each bucket (the
    run's `buckets.Bucket`s, the same as the float32 reducer's: contiguous in network order, sent last
    layers first) is divided by the world size, cast to float16, concatenated, summed with
    `ops.AllReduce` and split back, so the wire carries 2 bytes per element. Dividing first keeps the sum in range when the single gradients
    fit. The gradients arrive loss-scaled (`reduces_scaled`), which lifts small values above float16's
    underflow; an element that overflows float16 makes the step an overflow step (dynamic loss scale).
    """

    reduces_scaled = True  # step.ScaledUpdate hands over the gradients still loss-scaled

    def __init__(self, params, world_size: int, buckets: Sequence[Bucket]):
        super().__init__(auto_prefix=False)
        self.inv_world = 1.0 / world_size
        self.shapes = [tuple(p.shape) for p in params]
        self.sizes = [int(np.prod(p.shape)) for p in params]
        self.runs = tuple((b.first, b.last + 1) for b in buckets)  # send order
        # Where each gradient lands in the send-ordered results: the output is in parameter order.
        sent = [i for start, end in self.runs for i in range(start, end)]
        self.position = tuple(sent.index(i) for i in range(len(params)))
        self.all_reduce = ops.AllReduce()

    def construct(self, grads):
        sent = ()
        for start, end in self.runs:
            flat = ()
            for i in range(start, end):
                flat = flat + (ops.cast(grads[i] * self.inv_world, ms.float16).reshape(-1),)
            summed = self.all_reduce(ops.concat(flat))
            offset = 0
            for i in range(start, end):
                part = summed[offset:offset + self.sizes[i]]
                sent = sent + (ops.cast(part, ms.float32).reshape(self.shapes[i]),)
                offset = offset + self.sizes[i]
        reduced = ()
        for i in range(len(self.position)):
            reduced = reduced + (sent[self.position[i]],)
        return reduced


class _SparseTensorExchange(nn.Cell):
    """One gradient tensor: pick elements, exchange (index, value) pairs, return the dense mean."""

    def __init__(self, param: Parameter, keep: int, world_size: int, threshold: Optional[float],
                 error_feedback: bool):
        super().__init__(auto_prefix=False)
        self.keep = keep
        self.world_size = world_size
        self.inv_world = 1.0 / world_size
        self.threshold = threshold
        self.top_k = ops.TopK(sorted=False)
        self.all_gather = ops.AllGather()
        self.residual = None
        if error_feedback:
            self.residual = Parameter(Tensor(np.zeros(param.shape, np.float32)), name=RESIDUAL_PREFIX + param.name,
                                      requires_grad=False)

    def _combine(self, dense, index, values):
        """Add every rank's (index, value) pairs into `dense`, one rank after the other, then take the mean.

        Ranks often pick the same index. One scatter over all ranks' pairs would add colliding values
        in whatever order the kernel runs them (GPU tensor_scatter_add uses atomics), so replicas
        could round differently and drift apart. Within one rank's chunk the top-K indices are
        distinct, so each scatter touches every element at most once, and the sum's order is the rank
        order on every rank.
        """
        for r in range(self.world_size):
            dense = ops.tensor_scatter_add(dense, index[r], values[r])
        return dense * self.inv_world

    def construct(self, grad, skip=None):
        flat = grad.reshape(-1)
        if self.residual is not None:
            flat = flat + self.residual.reshape(-1)
        _, index = self.top_k(ops.abs(flat), self.keep)
        values = ops.gather(flat, index, 0)
        if self.threshold is not None:
            values = ops.select(ops.abs(values) > self.threshold, values, ops.zeros_like(values))
        dense = self._combine(ops.zeros_like(flat), self.all_gather(index).reshape(self.world_size, -1, 1),
                              self.all_gather(values).reshape(self.world_size, -1))
        if self.residual is not None:
            sent = ops.tensor_scatter_update(ops.zeros_like(flat), index.reshape(-1, 1), values)
            kept = flat - sent
            if skip is not None:  # a skipped (overflow) step leaves the residual as it was
                kept = ops.select(ops.broadcast_to(skip, kept.shape), self.residual.reshape(-1), kept)
            dense = ops.depend(dense, ops.assign(self.residual, kept.reshape(grad.shape)))
        return dense.reshape(grad.shape)


class SparseAllGather(nn.Cell):
    """Top-K or threshold sparsification with optional error feedback, one exchange per tensor.

    Args:
        params: the trainable parameters, in gradient order.
        world_size: number of ranks.
        topk_ratio: fraction of each tensor's elements sent (the exchange buffer size).
        threshold: magnitude an element must exceed to be sent; None sends the top-K as is.
        error_feedback: keep per-parameter residuals of what was not sent.
    """

    def __init__(self, params, world_size: int, topk_ratio: float, threshold: Optional[float] = None,
                 error_feedback: bool = True):
        super().__init__(auto_prefix=False)
        self.exchanges = nn.CellList([
            _SparseTensorExchange(p, kept_elements(int(np.prod(p.shape)), topk_ratio), world_size, threshold,
                                  error_feedback) for p in params], auto_prefix=False)

    guards_state = True  # step.ScaledUpdate passes the skip flag: residuals stay put on a skipped step

    def construct(self, grads, skip=None):
        reduced = ()
        for i in range(len(self.exchanges)):
            reduced = reduced + (self.exchanges[i](grads[i], skip),)
        return reduced

    def state_parameters(self) -> List[Parameter]:
        """The error-feedback residuals (`residual.<parameter name>`): rank-local state an exact resume needs."""
        return [e.residual for e in self.exchanges if e.residual is not None]


def create_reducer(compression: str, params, world_size: int, *, topk_ratio: float = 0.01,
                   threshold: float = 1e-3, error_feedback: bool = True, buckets: Sequence[Bucket] = None):
    """The cell that turns each rank's gradients into their cross-rank mean; None on one rank.

    Args:
        compression: one of COMPRESSIONS; "none" is MindSpore's own `nn.DistributedGradReducer`.
        params: the optimizer's parameters, in gradient order.
        world_size: number of ranks.
        topk_ratio: topk/threshold: fraction of each tensor sent.
        threshold: threshold: gradient magnitude to exceed.
        error_feedback: topk/threshold: keep residuals of what was not sent.
        buckets: none/fp16: the gradient buckets in send order (`step.bucket_gradients`, which also tags the
            parameters the float32 reducer reads); fp16 plans its own by bytes when not given.
    """
    if compression not in COMPRESSIONS:
        raise ConfigError(f"grad_compression {compression!r} is not one of {', '.join(COMPRESSIONS)}")
    if world_size == 1:
        return None  # nothing crosses a link, so there is nothing to compress
    if compression == "none":
        return default_reducer(params, world_size)
    if compression == "fp16":
        return Fp16BucketAllReduce(params, world_size, buckets or plan_buckets(sizes_of(params)))
    cutoff = threshold if compression == "threshold" else None
    return SparseAllGather(params, world_size, topk_ratio, cutoff, error_feedback)


def state_parameters(reducer) -> List[Parameter]:
    """What `reducer` (from `create_reducer`, None included) saves in checkpoints: only SparseAllGather has state."""
    return reducer.state_parameters() if isinstance(reducer, SparseAllGather) else []


def default_reducer(params, world_size: int):
    """MindSpore's own fused data-parallel all-reduce (mean); None when there is nothing to reduce."""
    if world_size == 1:
        return None
    return nn.DistributedGradReducer(params, mean=True, degree=world_size)
