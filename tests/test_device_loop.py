"""The train loop without per-step host syncs, and the CPU-only start-up skipped on GPU.

- The loss stays on the device between log steps (`engine.LossAccumulator`); the log line's loss is
  the mean since the previous log step, and the epoch loss weights each window by its steps.
- The compute time of a log line is the window's wall time minus its data waits (`StepTimer.take_window`),
  measured across the blocking loss read, so launches that return early cannot make it look fast.
"""
import time

import numpy as np

from msdist import monitor


def test_loss_accumulator_reads_the_mean_since_the_last_read():
    import mindspore as ms
    from msdist.engine import LossAccumulator

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    losses = LossAccumulator()
    for value in (1.0, 2.0, 6.0):
        losses.add(ms.Tensor(np.float32(value)))
    assert losses.read() == 3.0
    losses.add(ms.Tensor(np.float32(5.0)))
    assert losses.read() == 5.0


def test_epoch_loss_weights_each_window_by_its_steps():
    progress = monitor.Progress(epochs=1, steps_per_epoch=4, global_batch=8, log_every=3)
    progress.start_epoch(0)
    for step, loss in ((1, None), (2, None), (3, 2.0), (4, 6.0)):  # read at step 3 (log) and 4 (epoch end)
        progress.step(step, step, loss, 0.1, 0.01, 0.0)
    assert progress.epoch_loss() == (3 * 2.0 + 6.0) / 4


def test_window_compute_time_includes_the_blocking_read():
    timer = monitor.StepTimer(images_per_step=8)
    for _ in range(3):
        timer.data_ready()
        timer.step_done()  # launches return at once
    timer.data_ready()
    time.sleep(0.2)  # the blocking read at the log step waits for the queued steps
    timer.step_done()
    compute, data = timer.take_window()
    assert compute >= 0.2 / 4 and data < 0.05
    assert timer.take_window() == (0.0, 0.0)
