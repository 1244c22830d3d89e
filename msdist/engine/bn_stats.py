"""BatchNorm running statistics: made one model over the ranks (`--dist_bn`), and kept per batch slot.

Without sync_bn every rank's running mean and variance follow its own images. `unify_bn_stats` makes them
one model before an evaluation or a checkpoint.

A job that changed its world size keeps its batch layout (`data/plan.BatchLayout`): a rank may train the
slots of several of the original job's ranks, one after the other, as micro-batches of one step. Without
SyncBatchNorm each original rank kept its own running mean and variance, updated by its own images only;
one set updated by every slot in turn would weigh them differently (two updates per step instead of one).
So the rank keeps one set per slot it owns: the network holds its first slot's (what it evaluates and
saves, as the original rank of that slot did), and every other slot's is swapped in for that slot's
micro-batches and out again, in compiled graphs queued like the steps (no wait for the device).

`--dist_bn` makes them one model with every slot's (`unify_bn_stats`), so after an
epoch-end checkpoint every slot starts again from the same statistics, exactly as in the original job. The
other slots' sets are not written to checkpoints (like the accumulation buffers): a resume from a save in
the middle of an epoch starts them from the network's.
"""
from typing import List, Sequence

import numpy as np
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops


def bn_running_stats(net) -> list:
    """The BatchNorm running means and variances of `net`, in network order."""
    return [p for p in net.get_parameters() if p.name.rsplit(".", 1)[-1] in ("moving_mean", "moving_variance")]


def unify_bn_stats(net, collectives, mode: str, other_slots: Sequence = (), slots: int = 0) -> None:
    """Make the ranks' BatchNorm running statistics one model (`--dist_bn`), in place.

    Without sync_bn every rank's running mean/variance follow its own shard. Before an evaluation
    or a checkpoint they become one model: "reduce" = the mean over ranks, "broadcast" = rank 0's,
    "none" = left per rank. The values travel exactly (float64 through `Collectives.gather`) and
    every rank computes the same float64 mean in the same order, so the result is bitwise equal on
    every rank.

    Args:
        other_slots: a rank that trains several batch slots: the statistics of its slots after the first (the
            network's; `SlotStatistics.others`), each parallel to `bn_running_stats(net)`; set to the result too.
        slots: the job's batch slots (0 = one per rank): "reduce" is the mean over slots, "broadcast" slot 0's.
    """
    if mode == "none" or collectives.world_size == 1 and not other_slots:
        return
    stats = bn_running_stats(net)
    if not stats:
        return
    local = _flat(stats)
    if mode == "reduce":  # this rank's slots summed: the mean over ranks when it has one (sum / n is numpy's mean)
        local = sum((_flat(other) for other in other_slots), local)
    ranks = collectives.gather(local)
    unified = ranks.sum(axis=0) / (slots or collectives.world_size) if mode == "reduce" else ranks[0]
    for params in [stats, *other_slots]:
        offset = 0
        for p in params:
            p.set_data(Tensor(unified[offset:offset + p.size].reshape(p.shape).astype(np.float32)))
            offset += p.size


def _flat(params) -> np.ndarray:
    """The values of `params` as one float64 vector, exactly (float32 widens without rounding)."""
    return np.concatenate([p.asnumpy().astype(np.float64).ravel() for p in params])


_held = ops.MultitypeFuncGraph("held")


@_held.register("Tensor")
def _held_value(value):
    # A new tensor, not a view of the Parameter that the next assign overwrites.
    return value + 0


class _Swap(nn.Cell):
    """Exchange the values of two parallel tuples of Parameters."""

    def __init__(self, live: ParameterTuple, stored: ParameterTuple):
        super().__init__(auto_prefix=False)
        self.live, self.stored = live, stored
        self.hyper_map = ops.HyperMap()

    def construct(self):
        # Auto-monad keeps side effects in program order: `held` is read before `live` is overwritten.
        held = self.hyper_map(_held, self.live)
        done = self.hyper_map(ops.assign, self.live, self.stored)
        return ops.depend(self.hyper_map(ops.assign, self.stored, held), done)


class SlotStatistics:
    """The running statistics of the slots after a rank's first, each swapped into the network around its
    micro-batches (`swap`). Not a Cell: its Parameters are no part of the train step or its checkpoints.

    Args:
        net: the model; its running statistics (`bn_running_stats`) are the first slot's.
        slots_owned: how many slots this rank trains (1: nothing to keep, nothing to swap).
    """

    def __init__(self, net: nn.Cell, slots_owned: int):
        live = self._live = ParameterTuple(bn_running_stats(net))
        self.others: List[ParameterTuple] = [
            ParameterTuple([Parameter(Tensor(p.asnumpy()), name=f"slot{j}.{p.name}", requires_grad=False)
                            for p in live]) for j in range(1, slots_owned)]
        self._swaps = [_Swap(live, stored) for stored in self.others]

    @property
    def several(self) -> bool:
        """Whether this rank owns several slots (statistics to swap between their micro-batches)."""
        return bool(self.others)

    def swap(self, slot: int) -> None:
        """Exchange the network's statistics with those of this rank's `slot`-th slot (0: the network's own,
        nothing to do). Called before that slot's micro-batches and again after them."""
        if slot:
            self._swaps[slot - 1]()

    def restart(self) -> None:
        """Every other slot's statistics from the network's, as after an epoch-end `--dist_bn` (after a resume)."""
        for stored in self.others:
            for live, other in zip(self._live, stored):
                other.set_data(Tensor(live.asnumpy()))
