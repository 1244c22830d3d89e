"""uint8 to the device (issue 40 item 3): a batch that is still integer pixels (resize, crop, flip) leaves the pipeline
as uint8 and the train step normalizes it in its graph; the images, the loss and the weights equal the host-normalized
path's; colour jitter and mixing keep float32; the plan line says which and the bytes per step."""
from dataclasses import replace

import numpy as np
import pytest

from msdist.data import pipeline
from msdist.data.augment import Regularization, normalize


def _spec(**kwargs):
    return pipeline.TrainInput(image_size=32, global_batch=4, seed=3, shuffle=True, augment=True, padding=4, workers=1,
                               **kwargs)


def _first_batch(data_dir, spec):
    split = pipeline.list_split(data_dir, pipeline.TRAIN_SPLIT, pipeline.class_map(data_dir))
    images, labels = next(pipeline.build_train_dataset(split, spec, epoch=0).create_tuple_iterator(
        num_epochs=1, output_numpy=True))
    return images, labels


@pytest.mark.parametrize("augment, train_crop", [(True, "resize"), (True, "random_resized"), (False, "resize")])
def test_pixels_out_are_the_host_paths_images_before_normalizing(data_dir, augment, train_crop):
    reg = Regularization(train_crop=train_crop)
    host = _spec(regularization=reg)
    device = replace(host, device_normalizes=True)
    host, device = replace(host, augment=augment), replace(device, augment=augment)
    assert device.pixels_out and not host.pixels_out
    pixels, labels = _first_batch(data_dir, device)
    floats, host_labels = _first_batch(data_dir, host)
    assert pixels.dtype == np.uint8 and floats.dtype == np.float32 and pixels.shape == floats.shape
    np.testing.assert_array_equal(labels, host_labels)
    np.testing.assert_array_equal(normalize(pixels, pipeline.MEAN, pipeline.STD), floats)


@pytest.mark.parametrize("reg", [Regularization(color_jitter=0.4), Regularization(mixup=0.2, num_classes=4)])
def test_colour_jitter_and_mixing_keep_float32_and_say_why(data_dir, reg):
    spec = _spec(regularization=reg, device_normalizes=True)
    assert not spec.pixels_out
    images, _ = _first_batch(data_dir, spec)
    assert images.dtype == np.float32
    why = "colour jitter" if reg.color_jitter else "mixup/cutmix"
    assert spec.describe_images() == f"float32, normalized on the host ({why} computes in float): 0.0 MiB per step"


def test_the_plan_line_gives_the_bytes_per_step():
    spec = pipeline.TrainInput(image_size=224, global_batch=256, seed=1, shuffle=True, augment=True, padding=4,
                               workers=1, device_normalizes=True)
    assert spec.describe_images() == "uint8 pixels, normalized in the train step's graph: 36.8 MiB per step"
    assert replace(spec, device_normalizes=False).describe_images() == (
        "float32, normalized on the host (its consumer takes normalized images): 147.0 MiB per step")


@pytest.mark.parametrize("accum_steps", [1, 2])
def test_the_step_normalizing_uint8_trains_as_the_host_normalized_batch(data_dir, accum_steps):
    """The same batches through both paths: losses and weights bit for bit equal on CPU (the graph's cast, subtract
    and divide are the host's float32 operations)."""
    import mindspore as ms
    from msdist.engine import loss_scale, optim, precision, step
    pixels, labels = _first_batch(data_dir, _spec(device_normalizes=True))
    floats = normalize(pixels, pipeline.MEAN, pipeline.STD)
    results = []
    for images, norm in ((floats, None), (pixels, (pipeline.MEAN, pipeline.STD))):
        ms.set_context(mode=ms.GRAPH_MODE)
        ms.set_seed(2)
        net = step.build_network("convnet_tiny", 4, False, False, 1)
        optimizer = optim.create_optimizer(net.trainable_params(), np.full(4, 0.05, np.float32), 0.9, 1e-4)
        scaler = loss_scale.LossScaler(precision.loss_scale_plan("auto", "O0", "float16", "none"), 1)
        train = step.TrainStep(net, step.create_loss(False), optimizer, scaler, accum_steps=accum_steps,
                               normalize=norm)
        losses = [float(train.train_on(ms.Tensor(images), ms.Tensor(labels)).asnumpy()) for _ in range(3)]
        results.append((losses, [p.asnumpy() for p in net.trainable_params()]))
    (host_losses, host_weights), (device_losses, device_weights) = results
    np.testing.assert_array_equal(device_losses, host_losses)
    for host_w, device_w in zip(host_weights, device_weights):
        np.testing.assert_array_equal(device_w, host_w)
