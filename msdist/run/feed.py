"""The step primitive under the chunk scheduler (run/chunks.py): how a chunk of optimizer steps reaches the device.

One MindData dataset per epoch (`pipeline.build_train_dataset`) feeds both devices through MindSpore's public
`DatasetHelper` (mindspore/train/dataset_helper.py:322):
* `HostFeed`, everywhere: `DatasetHelper(dataset, dataset_sink_mode=False)`, the batches iterated on the host and
  one compiled step call per batch, the next batch fetched while the step runs (data/prefetch.py). CPU has no data
  sink, so this is CPU's only path; on GPU it runs the chunks shorter than K.
* `SunkFeed`, GPU only: `DatasetHelper(dataset, dataset_sink_mode=True, sink_size=K)` and
  `connect_network_with_dataset`: the batches go to a device queue, and one call runs K steps in C++.

MindSpore fixes a sunk graph's step count when it builds the graph: `_exec_datagraph` hands `sink_size` to
`init_dataset` (mindspore/train/_utils.py:75-104), which sets the iteration count the graph scheduler's loop-count
actor is built with (ccsrc/runtime/graph_scheduler/graph_scheduler.cc, GetLoopCount reads
ConfigManager::iter_num()). So every call of one sunk network runs exactly K steps: the K-long chunks of an epoch are
sunk, and the shorter ones around them (`chunks.segments`) run from the host, which gives the same batches and
weights. Each segment has its own dataset, built from the segment's first step (`pipeline.build_train_dataset`'s
`skip_steps`, exact as a mid-epoch resume is).
"""
import re
import time
from typing import Optional

from msdist.base.errors import DataError
from msdist.data import pipeline, prefetch


class HostFeed:
    """A segment's batches from the host (on CPU, the epoch's): the loop calls the step once per `next_batch`."""

    sunk = False

    def __init__(self, batches: pipeline.Batches):
        from mindspore import DatasetHelper
        # Non-sink: DatasetHelper iterates `dataset.create_tuple_iterator(num_epochs=1)` (dataset_helper.py:697-713),
        # the very iterator the loop used before, so the batches are the same, in the same order; `rows` names the
        # file of a read failure.
        helper = DatasetHelper(batches.dataset, dataset_sink_mode=False)
        self._batches = prefetch.one_ahead(batches.rows(iter(helper)))

    def next_batch(self):
        """(images, labels) of the next step, in order; blocks until the pipeline has it."""
        return next(self._batches)

    def close(self) -> None:
        self._batches.close()


class SunkFeed:
    """GPU only: a segment's batches in the device's data queue; `run_chunk` runs K steps of `step_cell` in one call.

    Args:
        batches: the segment's MindData dataset, a whole number of K-step chunks long.
        step_cell: one optimizer step as one Cell (`sink.SunkStep`), called with (images, labels).
        k: steps per call.
    """

    sunk = True

    def __init__(self, batches: pipeline.Batches, step_cell, k: int):
        from mindspore import DatasetHelper, connect_network_with_dataset
        # dataset_helper.py:372-386: in GRAPH_MODE on GPU, sink mode is `_DatasetIterMSLoopSink`, which sends the
        # dataset to a device queue (`_exec_datagraph(dataset, sink_size)`, then `_send_data`, lines 580-588);
        # connect_network_with_dataset (lines 216-319) wraps `step_cell` in `_DataWrapper`, whose graph takes its
        # inputs from the queue with GetNext (lines 87-121). Model.train(dataset_sink_mode=True) calls the wrapped
        # network once per sink (mindspore/train/model.py:1145-1166); this does the same per chunk.
        self._batches = batches
        self._helper = DatasetHelper(batches.dataset, dataset_sink_mode=True, sink_size=k)
        self._network = connect_network_with_dataset(step_cell, self._helper)

    def run_chunk(self, rank: int, global_step: int):
        """K optimizer steps from `global_step`; returns the last step's loss (a device Tensor).

        Raises:
            DataError: an unreadable image, named (the pipeline decodes in the queue's send thread, and its error
                reaches this call); or MindSpore's GetNext timed out (`input_stall`): the input pipeline fell behind.
        """
        began = time.perf_counter()
        try:
            return self._network()
        except RuntimeError as e:
            line = input_stall(str(e), rank, time.perf_counter() - began, global_step)
            error = self._batches.unreadable(str(e)) or (DataError(line) if line else None)
            if error is None:
                raise
            raise error from None

    def close(self) -> None:
        # Model.train ends its sinking the same way (model.py:1182-1183).
        self._helper.stop_send()
        self._helper.release()


def open_feed(batches: pipeline.Batches, steps: int, sunk_step, sink_size: int):
    """A segment's feed (`chunks.segments`): its first `steps` batches of `batches`, sunk when there is a
    `sunk_step` (`sink.sunk_step`, GPU, K > 1), else from the host."""
    if sunk_step is None:
        return HostFeed(batches)
    # Exactly the segment's batches in the queue: its chunks consume them all.
    return SunkFeed(pipeline.Batches(batches.dataset.take(steps), batches.files), sunk_step, sink_size)


# MindSpore 2.10's GPU GetNext kernel, when the queue stays empty past `op_timeout` (set_context; 0 waits forever):
# `MS_LOG(EXCEPTION) << "For '" << kernel_name_ << "', get data timeout. Queue name: " << queue_name_`
# (ccsrc/plugin/device/gpu/kernel/data/dataset_iterator_kernel.cc, DatasetIteratorKernelMod::ReadDevice; the string
# is in lib/plugin/libmindspore_gpu.so.11.6), and the data queue's peek (runtime/hardware_abstract/data_queue/
# data_queue_mgr.cc: "Getnext gets peek data time out, that most likely caused by data processing being too slow").
_GETNEXT_TIMEOUT = re.compile(r"get data timeout\. Queue name: (\S+)|Getnext gets peek data time out")


def input_stall(message: str, rank: int, data_wait_s: float, global_step: int) -> Optional[str]:
    """msdist's stall line for MindSpore's GetNext timeout in `message` (a sunk chunk waited for the input pipeline
    longer than MindSpore allows); None for any other error.

    `rank 1 stuck in data wait at step 370 for 1900 s (input stall: MindSpore's GetNext timed out on ...)`
    """
    found = _GETNEXT_TIMEOUT.search(message)
    if found is None:
        return None
    queue = f" {found.group(1)}" if found.group(1) else ""
    return (f"rank {rank} stuck in data wait at step {global_step} for {data_wait_s:.0f} s (input stall: MindSpore's "
            f"GetNext timed out on the device's data queue{queue}; the input pipeline is slower than the steps: "
            f"more --num_workers, or python -m msdist.data bench)")
