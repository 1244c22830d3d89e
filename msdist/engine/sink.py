"""One optimizer step as one Cell, what a sunk call (`--sink_size K` on GPU, run/feed.py) repeats K times.

A sunk call runs a single Cell's graph per step, its inputs taken from the device's data queue (MindSpore's
`_DataWrapper`, mindspore/train/dataset_helper.py:87-121, calls `network(*get_next())`). msdist's step is the train
step's graph followed by the EMA's (`step.TrainStep`, `ema.EMA`), two launches from Python; `SunkStep` makes them one
graph, in the same order, so K sunk steps compute what K host-fed steps do. A step that accumulates micro-batches
(`--grad_accum_steps`) is, from the host, one launch to split the batch, one per micro-batch and one to apply the
sum (`TrainStep.train_on`); `SunkStep` unrolls the same calls, in the same order, inside its graph. Only a rank that
owns several batch slots (an elastic job below MAX nodes) stays host-fed: its BatchNorm statistics are swapped from
the host between slots, and run/chunks.py resolves K to 1 for it.
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
        self.parts = train_step.accum_steps if train_step.accumulates else 0   # micro-batches per step; 0: none

    def construct(self, images, labels):
        # `parts` is a Python constant: the graph is built with one branch, no condition is left to run.
        loss = self._accumulated(images, labels) if self.parts else self.train_step(images, labels)
        if self.ema is not None:
            loss = ops.depend(loss, self.ema())   # after the update, as the host-fed loop calls it
        return loss

    def _accumulated(self, images, labels):
        """`TrainStep.train_on` of a rank with one batch slot: the micro-batches' steps add their gradients to the
        step's buffers, then its apply step reduces, updates and clears them (auto-monad keeps these writes and
        reads of the same Parameters in program order)."""
        micro_images = ops.split(images, images.shape[0] // self.parts)
        micro_labels = ops.split(labels, labels.shape[0] // self.parts)
        for i in range(self.parts):
            self.train_step(micro_images[i], micro_labels[i])
        return self.train_step.apply_step()


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
