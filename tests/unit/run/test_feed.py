"""The step primitive's host path gives today's batches; MindSpore's GetNext timeout is named as an input stall."""
import numpy as np
import pytest

from msdist.data import pipeline, plan
from msdist.run import feed

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
