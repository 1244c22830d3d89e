"""The step primitive: its host path gives today's batches, the run's one sunk dataset holds exactly the batches of its
sunk chunks, and MindSpore's GetNext timeout is named as an input stall."""
import numpy as np
import pytest

from msdist.data import pipeline, plan
from msdist.data.augment import Regularization
from msdist.run import chunks, feed
from msdist.run.chunks import Limits

# The GPU GetNext kernel's message in MindSpore 2.10 (ccsrc/plugin/device/gpu/kernel/data/dataset_iterator_kernel.cc),
# as a sunk call raises it, C++ trace after it.
GETNEXT_TIMEOUT = ("For 'GetNext', get data timeout. Queue name: 4c8d0410-8075-11ed-ac18-0242ac110006\n\n"
                   "----------------------------------------------------\n- C++ Call Stack: (For framework developers)")


def test_getnext_timeout_is_an_input_stall_with_the_rank_and_the_wait():
    line = feed.input_stall(GETNEXT_TIMEOUT, rank=3, data_wait_s=1900.4, global_step=370)
    assert line.startswith("rank 3 stuck in data wait at step 370 for 1900 s (input stall")
    assert "4c8d0410-8075-11ed-ac18-0242ac110006" in line and "--num_workers" in line
    assert "\n" not in line


def test_the_data_queue_peek_timeout_is_one_too():
    message = "Getnext gets peek data time out, that most likely caused by data processing being too slow"
    assert "input stall" in feed.input_stall(message, 0, 5.0, 1)


def test_other_errors_are_not_input_stalls():
    assert feed.input_stall("For 'Conv2D', the input shape is wrong", 0, 1.0, 1) is None


@pytest.mark.parametrize("rank", [0, 1])
def test_host_feed_yields_the_batches_of_the_tuple_iterator_from_any_resume_point(data_dir, rank):
    split = pipeline.list_split(data_dir, "Training", pipeline.class_map(data_dir))
    spec = pipeline.TrainInput(image_size=32, global_batch=8, seed=5, shuffle=True, augment=True, padding=2,
                               workers=2, layout=plan.BatchLayout(2, 2, rank), device_normalizes=True)
    for skip in (0, 3):
        want = list(pipeline.build_train_dataset(split, spec, epoch=1, skip_steps=skip).create_tuple_iterator(
            num_epochs=1))
        source = feed.HostFeed(pipeline.build_train_dataset(split, spec, epoch=1, skip_steps=skip))
        got = [source.next_batch() for _ in want]
        source.close()
        assert len(got) == len(want) > 1
        for (images, labels), (want_images, want_labels) in zip(got, want):
            assert images.asnumpy().tobytes() == want_images.asnumpy().tobytes()
            np.testing.assert_array_equal(labels.asnumpy(), want_labels.asnumpy())


def _segment_sunk_batches(split, spec, at, steps_per_epoch, epochs, k, limits):
    """What the sunk chunks took before one dataset spanned the run: the loop's per-epoch segments
    (`chunks.segments`), each sunk one its own dataset from its first step, `take(steps)` of it (run/feed.py then)."""
    got = []
    while at < epochs * steps_per_epoch:
        epoch, step = divmod(at, steps_per_epoch)
        lengths = list(chunks.epoch_lengths(at, step, steps_per_epoch, k, limits))
        for sunk, part in chunks.segments(lengths, k, sinks=True):
            if sunk:
                data = pipeline.build_train_dataset(split, spec, epoch, skip_steps=step).dataset.take(sum(part))
                got += list(data.create_tuple_iterator(num_epochs=1, output_numpy=True))
            at, step = at + sum(part), step + sum(part)
        if step < steps_per_epoch:
            break
    return got


SPAN_CASES = {
    # name: (global batch (12 steps an epoch at 16), K, Limits, resumed at global step, epochs, slots, rank, augment,
    #        options); uint8 batches wherever no option computes in float (`TrainInput.pixels_out`)
    "epoch_tails": (16, 5, Limits(), 0, 3, 1, 0, True, {}),
    "log_and_save_edges_mid_epoch_resume": (16, 4, Limits(log_every=6, save_every_steps=10), 7, 3, 2, 1, True,
                                            dict(color_jitter=0.4, mixup=0.4, label_smoothing=0.1)),
    "max_steps_resized_crop_cutmix": (16, 3, Limits(log_every=4, max_steps=29), 14, 4, 2, 0, True,
                                      dict(train_crop="random_resized", cutmix=1.0)),
    "short_epochs": (32, 2, Limits(log_every=5), 3, 3, 1, 0, True, {}),
    "no_augmentation_the_cpp_chain": (16, 4, Limits(log_every=6), 2, 2, 1, 0, False, {}),
}


@pytest.mark.parametrize("case", SPAN_CASES)
def test_the_run_spanning_sunk_dataset_holds_the_per_segment_datasets_batches_bitwise(data_dir, case):
    """On GPU the run's sunk chunks take their batches from one dataset (one sunk graph per run); CPU has no data
    sink, so the dataset is iterated on the host: every batch, images and labels, is bit for bit the batch the sunk
    chunks' per-segment datasets gave, in order, across epochs, from a mid-epoch resume, with augmentation on."""
    global_batch, k, limits, at, epochs, slots, rank, augment, options = SPAN_CASES[case]
    split = pipeline.list_split(data_dir, "Training", pipeline.class_map(data_dir))
    reg = Regularization(num_classes=len(split.classes), **options)
    spec = pipeline.TrainInput(image_size=24, global_batch=global_batch, seed=3, shuffle=True, augment=augment,
                               padding=2, workers=2, layout=plan.BatchLayout(slots, slots, rank), regularization=reg,
                               device_normalizes=True)
    steps_per_epoch = plan.steps_per_epoch(len(split), global_batch)
    want = _segment_sunk_batches(split, spec, at, steps_per_epoch, epochs, k, limits)
    run = chunks.run_chunks(at, steps_per_epoch, epochs, k, limits)
    got = list(feed.sunk_batches(split, spec, run, k).dataset.create_tuple_iterator(num_epochs=1, output_numpy=True))
    assert len(got) == len(want) and len(want) % k == 0 and len(want) > 2 * k
    for (images, labels), (want_images, want_labels) in zip(got, want):
        assert images.dtype == want_images.dtype and images.tobytes() == want_images.tobytes()
        assert labels.dtype == want_labels.dtype and labels.tobytes() == want_labels.tobytes()


def test_no_sunk_dataset_when_no_chunk_is_k_long(data_dir):
    split = pipeline.list_split(data_dir, "Training", pipeline.class_map(data_dir))
    spec = pipeline.TrainInput(image_size=24, global_batch=16, seed=3, shuffle=True, augment=True, padding=2,
                               workers=1)
    # log_every 3 cuts every K = 4 chunk short: nothing to sink, no sunk graph at all.
    assert feed.sunk_batches(split, spec, chunks.run_chunks(0, 12, 2, 4, Limits(log_every=3)), 4) is None
