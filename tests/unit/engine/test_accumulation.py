"""Gradient accumulation splits each batch on the device (#32 item 6, msdist/engine/step.py): no
asnumpy()/Tensor(...) round trip through the host per optimizer step, and the same losses and weights
as splitting on the host, the way it was done before."""
import numpy as np

from msdist.engine import precision

STEPS, ACCUM = 3, 2


def _accumulating_step():
    import mindspore as ms
    from mindspore import nn
    from msdist.engine import loss_scale, optim, step

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    ms.set_seed(3)
    net = step.build_network("convnet_tiny", 4, False, False, 1)
    optimizer = optim.create_optimizer(net.trainable_params(), np.full(STEPS, 0.05, np.float32), 0.9, 1e-4)
    scaler = loss_scale.LossScaler(precision.loss_scale_plan("dynamic", "O0", "float16", "none"), 1)
    train = step.TrainStep(net, nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean"), optimizer, scaler,
                           accum_steps=ACCUM)
    return train, net


def _batches():
    import mindspore as ms
    rng = np.random.default_rng(5)
    return [(ms.Tensor(rng.random((8, 3, 32, 32), dtype=np.float32)),
             ms.Tensor(rng.integers(0, 4, 8).astype(np.int32))) for _ in range(STEPS)]


def _split_through_the_host(train, images, labels):
    """`TrainStep.train_on` as it was: a device-to-host copy, numpy, a host-to-device copy, and the mean of the
    micro-batch losses taken outside the graph."""
    import mindspore as ms
    losses = [train(ms.Tensor(x), ms.Tensor(y)) for x, y in zip(np.split(images.asnumpy(), ACCUM),
                                                                np.split(labels.asnumpy(), ACCUM))]
    train.apply_step()
    return sum(losses[1:], losses[0]) * (1.0 / ACCUM)


def test_accumulation_never_copies_a_batch_through_the_host(monkeypatch):
    import mindspore as ms
    train, _ = _accumulating_step()
    batches = _batches()
    train.train_on(*batches[0])  # compiling reads constants to the host: the graphs are built here

    def refuse(*_args, **_kwargs):
        raise AssertionError("a batch went through the host (asnumpy / np.split)")
    monkeypatch.setattr(ms.Tensor, "asnumpy", refuse)
    monkeypatch.setattr(np, "split", refuse)
    losses = [train.train_on(images, labels) for images, labels in batches[1:]]
    monkeypatch.undo()
    assert all(np.isfinite(float(loss.asnumpy())) for loss in losses)


def test_device_split_gives_the_losses_and_weights_of_the_host_split():
    device_step, device_net = _accumulating_step()
    host_step, host_net = _accumulating_step()
    for images, labels in _batches():
        on_device = float(device_step.train_on(images, labels).asnumpy())
        through_host = float(_split_through_the_host(host_step, images, labels).asnumpy())
        assert on_device == through_host
    for a, b in zip(device_net.trainable_params(), host_net.trainable_params()):
        assert np.array_equal(a.asnumpy(), b.asnumpy()), a.name
