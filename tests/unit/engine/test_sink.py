"""The Cell a sunk call repeats (engine/sink.py): the train step and the EMA as one graph compute what the host-fed
loop's two calls compute, bitwise (run here on CPU, called directly; on GPU MindSpore's _DataWrapper calls it)."""
import numpy as np
import pytest

from msdist.engine import ema, loss_scale, optim, precision, sink, step


def _step_and_ema(accum_steps=1):
    import mindspore as ms
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    ms.set_seed(3)
    net = step.build_network("convnet_tiny", 4, False, False, 1)
    optimizer = optim.create_optimizer(net.trainable_params(), np.full(8, 0.05, np.float32), 0.9, 1e-4)
    scaler = loss_scale.LossScaler(precision.loss_scale_plan("dynamic", "O0", "float16", "none"), 1)
    train = step.TrainStep(net, step.create_loss(False), optimizer, scaler, accum_steps=accum_steps)
    return train, ema.create(net, 0.9), net


def _batches():
    import mindspore as ms
    rng = np.random.default_rng(5)
    return [(ms.Tensor(rng.random((4, 3, 32, 32), dtype=np.float32)), ms.Tensor(rng.integers(0, 4, 4).astype(np.int32)))
            for _ in range(3)]


def _state(train, average):
    return [p.asnumpy().copy() for p in list(train.weights) + list(average.state_parameters())] + \
        [train.loss_total.asnumpy().copy()]


@pytest.mark.slow  # compiles and trains two networks
@pytest.mark.parametrize("accum_steps", [1, 2])
def test_one_cell_gives_the_weights_ema_and_losses_of_the_host_calls(accum_steps):
    """With accumulation the host makes 4 launches a step (split, 2 micro-batches, apply) and the EMA a fifth; the
    sunk Cell makes them one graph."""
    train, average, _ = _step_and_ema(accum_steps)
    for images, labels in _batches():
        train.train_on(images, labels)
        average()
    want = _state(train, average)

    train, average, _ = _step_and_ema(accum_steps)
    sunk = sink.SunkStep(train, average)
    for images, labels in _batches():
        sunk(images, labels)
    got = _state(train, average)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.tobytes() == w.tobytes()


def test_only_a_gpu_with_k_above_one_gets_a_sunk_step():
    train, average, _ = _step_and_ema()
    assert sink.sunk_step(train, average, "CPU", 8, "O0") is None
    assert sink.sunk_step(train, average, "GPU", 1, "O1") is None
    sunk = sink.sunk_step(train, None, "GPU", 8, "O1")   # built only: no GPU runs it here
    assert isinstance(sunk, sink.SunkStep) and sunk.jit_config_dict["jit_level"] == "O1"
