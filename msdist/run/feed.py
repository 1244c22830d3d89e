"""The step primitive under the chunk scheduler (run/chunks.py): how a chunk of optimizer steps reaches the device.

Both devices feed the step through MindSpore's public `DatasetHelper` (mindspore/train/dataset_helper.py:322):
* `HostFeed`, everywhere: `DatasetHelper(dataset, dataset_sink_mode=False)` over one segment's dataset (on CPU the
  epoch's, `pipeline.build_train_dataset`), the batches iterated on the host and one compiled step call per batch,
  the next batch fetched while the step runs (data/prefetch.py). CPU has no data sink, so this is CPU's only path;
  on GPU it runs the chunks shorter than K.
* `SunkFeed`, GPU only: `DatasetHelper(dataset, dataset_sink_mode=True, sink_size=K)` and
  `connect_network_with_dataset`: the batches go to a device queue, and one call runs K steps in C++.

One sunk dataset, helper and network per run, not per epoch: MindSpore caches the `_DataWrapper`, so the compiled
sunk graph, on the dataset object (connect_network_with_dataset, dataset_helper.py:303-311, `__sink_network__`), and
a graph's compile key holds its Cell's create_time and id (mindspore/graph/api.py:144-146, 2326-2340), so a new
dataset is a new graph build, minutes for ResNet-50 on GPU. The run's dataset (`pipeline.build_span_dataset`)
holds the batches of every K-long chunk of the run, across its epochs, in order (`chunks.sunk_spans`), read in one
pass: `_DatasetIter` sends it once (`_send_data(dataset, epoch_num=1)`, dataset_helper.py:40-45, 570-588) without
an end-of-epoch marker (`send_epoch_end` is False for sink_size > 0, mindspore/train/_utils.py:82), so no
`continue_send` is due between epochs, and each call takes the next K batches.

MindSpore fixes a sunk graph's step count when it builds the graph: `_exec_datagraph` hands `sink_size` to
`init_dataset` (mindspore/train/_utils.py:75-104), which sets the iteration count the graph scheduler's loop-count
actor is built with (ccsrc/runtime/graph_scheduler/graph_scheduler.cc, GetLoopCount reads
ConfigManager::iter_num()); it does so only for a dataset not yet sent (`__transfer_dataset__`, dataset_helper.py:
570-594), so a later helper with another sink_size would not change it. So every call runs exactly K steps, and the
shorter chunks (`chunks.segments`) run from the host, each segment from its own dataset, which gives the same batches
and weights.
"""
import re
import time
from typing import Iterable, Optional

from msdist.base.errors import DataError
from msdist.data import pipeline, prefetch
from msdist.run import chunks


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
    """GPU only: the run's sunk batches in the device's data queue; `run_chunk` runs the next K steps of `step_cell`
    in one call.

    Args:
        batches: the run's sunk dataset (`pipeline.build_span_dataset` over `chunks.sunk_spans`): a whole number of
            K-step chunks, every one the run will sink, in order.
        step_cell: one optimizer step as one Cell (`sink.SunkStep`), called with (images, labels).
        k: steps per call.
    """

    sunk = True

    def __init__(self, batches: pipeline.Batches, step_cell, k: int):
        from mindspore import DatasetHelper, connect_network_with_dataset
        # dataset_helper.py:372-386: in GRAPH_MODE on GPU, sink mode is `_DatasetIterMSLoopSink`, which sends the
        # dataset to a device queue (`_exec_datagraph(dataset, sink_size)`, then `_send_data`, lines 570-588);
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
        """At the run's end, or its early stop (--max_steps is in the spans; an agreed stop, a preemption, an
        error leave batches unsent): stop the send thread and free the queue, as Model.train ends its sinking
        (model.py:1189-1190)."""
        self._helper.stop_send()
        self._helper.release()


def sunk_batches(split: pipeline.Split, spec: pipeline.TrainInput, run: Iterable[chunks.Chunk],
                 k: int) -> Optional[pipeline.Batches]:
    """The run's sunk dataset: the batches of the K-long chunks of `run` (`chunks.run_chunks`, from the resumed
    step), across its epochs, in order (`chunks.sunk_spans`); None when no chunk is K long."""
    spans = chunks.sunk_spans(run, k)
    return pipeline.build_span_dataset(split, spec, spans) if spans else None


def open_sunk_run(split: pipeline.Split, spec: pipeline.TrainInput, run: Iterable[chunks.Chunk], step_cell,
                  k: int) -> Optional[SunkFeed]:
    """GPU, K > 1: the run's one sunk feed (`sunk_batches`); None when no chunk is K long."""
    batches = sunk_batches(split, spec, run, k)
    return None if batches is None else SunkFeed(batches, step_cell, k)


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
