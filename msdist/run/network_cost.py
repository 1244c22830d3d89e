"""The real network's gradients as the forecast needs them: sizes, buckets and each parameter's backward cost.

The parameter list and the buckets (each one AllReduce op: `buckets.fusion_config`) come from `engine.buckets`,
the functions the training step uses, on the network `models.create_model` builds; so `msdist.plan_scale` and
training cannot disagree about what is sent or in which order. A parameter's share of backward time is its
layer's share of the forward multiply-adds, counted from one forward pass at the run's image size (PyNative,
forward hooks on every Conv2d and Dense).
"""
import contextlib
import os
from typing import Dict, List

from msdist.engine import buckets
from msdist.run.config import fusion_split
from msdist.run.forecast import Gradients


def layer_multiply_adds(net, image_size: int) -> Dict[str, float]:
    """Parameter name -> forward multiply-adds per image of the layer it weighs (Conv2d, Dense); one forward pass."""
    import numpy as np
    import mindspore as ms
    from mindspore import nn

    found: Dict[str, float] = {}

    def count(cell, _args, output):
        spatial = int(np.prod(output.shape[2:])) if isinstance(cell, nn.Conv2d) else 1
        found[cell.weight.name] = float(int(np.prod(cell.weight.shape)) * spatial)

    handles = [cell.register_forward_hook(count) for _, cell in net.cells_and_names()
               if isinstance(cell, (nn.Conv2d, nn.Dense))]
    previous = ms.get_context("mode")
    ms.set_context(mode=ms.PYNATIVE_MODE)  # hooks run in PyNative only
    try:
        net.set_train(False)
        with _quiet_stderr():
            net(ms.Tensor(np.zeros((1, 3, image_size, image_size), np.float32)))
    finally:
        ms.set_context(mode=previous)
        for handle in handles:
            handle.remove()
    return found


@contextlib.contextmanager
def _quiet_stderr():
    """Silence file descriptor 2 for a while: MindSpore 2.10's first PyNative op prints a harmless traceback
    ("A module that was compiled using NumPy 1.x cannot be run in NumPy 2") and computes on. Exceptions still
    propagate; only the print goes."""
    saved = os.dup(2)
    with open(os.devnull, "w", encoding="utf-8") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def network_gradients(model: str, num_classes: int, image_size: int, allreduce_fusion: str) -> Gradients:
    """Sizes (forward order), buckets (send order) and backward costs of `model`, built on CPU, not trained."""
    from models import create_model
    net = create_model(model, num_classes)
    sizes = buckets.parameter_sizes(net)
    macs = layer_multiply_adds(net, image_size)
    costs: List[float] = [macs.get(name, 0.0) for name, _ in sizes]  # BatchNorm and biases: next to nothing
    return Gradients(buckets.plan(sizes, fusion_split(allreduce_fusion)), sizes, costs)
