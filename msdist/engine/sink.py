"""One optimizer step as one Cell, what a sunk call (`--sink_size K` on GPU, run/feed.py) repeats K times.

A sunk call runs a single Cell's graph per step, its inputs taken from the device's data queue (MindSpore's
`_DataWrapper`, mindspore/train/dataset_helper.py:87-121, calls `network(*get_next())`). msdist's step is the train
step's graph followed by the EMA's (`step.TrainStep`, `ema.EMA`), two launches from Python; `SunkStep` makes them one
graph, in the same order, so K sunk steps compute what K host-fed steps do. A step that accumulates micro-batches
stays several launches (`TrainStep.train_on`): run/chunks.py resolves K to 1 for it, and no `SunkStep` is made.
"""
from typing import Optional

from mindspore import JitConfig, nn, ops


class SunkStep(nn.Cell):
    """`train_step(images, labels)`, then `ema()` when there is one; returns the step's loss.

    The train step also adds its loss to `LossAccumulator`'s total on the device, so the loop reads the chunk's
    losses at log steps as it does step by step.
    """

    def __init__(self, train_step: nn.Cell, ema: Optional[nn.Cell]):
        super().__init__(auto_prefix=False)   # the step's and the EMA's Parameter names stay as they are
        self.train_step = train_step
        self.ema = ema

    def construct(self, images, labels):
        loss = self.train_step(images, labels)
        if self.ema is not None:
            loss = ops.depend(loss, self.ema())   # after the update, as the host-fed loop calls it
        return loss


def sunk_step(train_step, ema, device_target: str, sink_size: int, jit_level: str) -> Optional[SunkStep]:
    """The Cell sunk calls run, on GPU with K > 1; None where every step is a host call (CPU has no data sink:
    DatasetHelper refuses sink mode there, mindspore/train/dataset_helper.py:372-384).

    `jit_level` is the train step's (`jit.resolve_jit_level`): the sunk graph is compiled as the outer Cell's, and
    `_DataWrapper` takes its compile level from the Cell it wraps (`Cell._get_attr_from_cell`, nn/cell.py:3910-3915).
    """
    if device_target != "GPU" or sink_size == 1:
        return None
    step = SunkStep(train_step, ema)
    step.set_jit_config(JitConfig(jit_level=jit_level))
    return step
