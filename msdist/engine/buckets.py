"""Gradient buckets: which parameters' gradients cross the ranks together, and in which order.

Backward produces gradients from the last layer to the first, so a bucket can be sent as soon as
every gradient in it exists. Buckets therefore hold parameters contiguous in network (forward)
order and are sent last layers first, as PyTorch DDP's 25 MB buckets are: the first bucket leaves
while backward still runs through the first layers.

MindSpore-free (duck-typed on `net.trainable_params()`), so `msdist.plan_scale` and the tests can
plan buckets without loading MindSpore. `allreduce_fusion: auto` cuts by DEFAULT_BUCKET_BYTES.
"""
import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from msdist.base.errors import ConfigError

DEFAULT_BUCKET_BYTES = 25 * 2**20  # like DDP's 25 MB buckets; allreduce_fusion: auto
FLOAT32_BYTES = 4
# MindSpore's AllReduce fusion pass reads comm_fusion's "config" (MB, its docs say) in units of 262144 bytes:
# backend/common/pass/communication_op_fusion.cc, kDefaultThresholdMb2Byte = 262144 (GetAllReduceSplitSegment).
BACKEND_THRESHOLD_UNIT = 262144


@dataclass(frozen=True)
class Bucket:
    names: Tuple[str, ...]  # parameter names, network (forward) order
    nbytes: int             # gradient bytes as sent (float32 sizes; a reducer may send fewer)
    first: int              # index of names[0] in the forward-order parameter list
    last: int               # index of names[-1]


def _elements(shape) -> int:
    count = 1
    for dim in shape:
        count *= int(dim)
    return count


def parameter_sizes(net) -> List[Tuple[str, int]]:
    """(name, float32 gradient bytes) of `net.trainable_params()`, in network (forward) order.

    MindSpore lists a Cell's parameters in the order its attributes were set (`Cell.parameters_and_names`
    walks `_params` then `_cells`, both insertion-ordered dicts), which msdist's models write in forward order.
    """
    return sizes_of(net.trainable_params())


def sizes_of(params) -> List[Tuple[str, int]]:
    """(name, float32 gradient bytes) of each parameter (anything with `name` and `shape`), in the given order."""
    return [(p.name, _elements(p.shape) * FLOAT32_BYTES) for p in params]


def plan_buckets(sizes: Sequence[Tuple[str, int]], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> List[Bucket]:
    """Cut the forward-order parameters into contiguous buckets of at most `bucket_bytes`, in SEND order.

    Filled from the last parameter backwards (the order backward produces gradients), so the first bucket
    holds the last layers. A parameter larger than `bucket_bytes` gets a bucket of its own.
    """
    buckets, end, filled = [], len(sizes), 0
    for i in range(len(sizes) - 1, -1, -1):
        nbytes = sizes[i][1]
        if i < end - 1 and filled + nbytes > bucket_bytes:
            buckets.append(_bucket(sizes, i + 1, end))
            end, filled = i + 1, 0
        filled += nbytes
    if sizes:
        buckets.append(_bucket(sizes, 0, end))
    return buckets


def cut_after(sizes: Sequence[Tuple[str, int]], indices: Sequence[int]) -> List[Bucket]:
    """Buckets ending after each of the increasing forward-order `indices` (`--allreduce_fusion 85,160`), in SEND
    order; no indices = one bucket."""
    bounds = [0] + [i + 1 for i in indices if i + 1 < len(sizes)] + [len(sizes)]
    return [_bucket(sizes, start, end) for start, end in reversed(list(zip(bounds, bounds[1:]))) if end > start]


def plan(sizes: Sequence[Tuple[str, int]], split_after: Optional[Sequence[int]]) -> List[Bucket]:
    """The run's buckets in SEND order, as `--allreduce_fusion` asks: None = auto (by bytes), [] = one bucket,
    else cut after these forward-order indices. The training step and `msdist.plan_scale` both call this.

    Raises:
        ConfigError: an index at or past the model's trainable parameter count.
    """
    if split_after is None:
        return plan_buckets(sizes)
    if split_after and split_after[-1] >= len(sizes):
        raise ConfigError(f"--allreduce_fusion index {split_after[-1]} is past the model's last trainable "
                          f"parameter (it has {len(sizes)}); use indices below {len(sizes)}, or auto")
    return cut_after(sizes, split_after)


def fusion_config(plan: Sequence[Bucket]) -> int:
    """The comm_fusion "config" the training step sets, so that each bucket leaves as one AllReduce op.

    In data-parallel mode MindSpore's fusion pass fuses equal `comm_fusion` ids, then cuts a fused group once a
    parameter would take it past "config" x BACKEND_THRESHOLD_UNIT bytes (communication_op_fusion.cc,
    GetAllReduceSplitSegment). One unit above the largest bucket never cuts. Counted in MB, as MindSpore's docs
    say, it cut ResNet-18's two buckets into six ops (the saved IR): the bug this unit fixes.
    """
    return math.ceil(max(b.nbytes for b in plan) / BACKEND_THRESHOLD_UNIT) + 1


def _bucket(sizes: Sequence[Tuple[str, int]], start: int, end: int) -> Bucket:
    """The bucket of parameters [start, end) of the forward-order list."""
    run = sizes[start:end]
    return Bucket(tuple(name for name, _ in run), sum(nbytes for _, nbytes in run), start, end - 1)
