"""The overflow decision stays on the device (issue 40 item 2, msdist/engine/momentum.py): a checked step masks
the update instead of branching on the flag. Without an overflow the weights and moments are bit for bit what
nn.Momentum's own step gives; an overflowing step leaves them as they were, advances the schedule and halves
the scale; and the compiled step holds no control flow whose condition would be read back to the host."""
import glob
import os

import numpy as np
import pytest

from msdist.engine import precision

DYNAMIC_FROM_ONE = precision.LossScalePlan(True, 1.0)             # checked, masked update
UNCHECKED = precision.LossScalePlan(False, 1.0, checked=False)    # calls nn.Momentum's construct itself


def _train_step(plan, backbone_lr_scale: float, scaler_class=None):
    import mindspore as ms
    from msdist.engine import loss_scale, optim, step

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    ms.set_seed(7)
    net = step.build_network("convnet_tiny", 4, False, False, 1)
    lrs = np.linspace(0.05, 0.02, 8).astype(np.float32)
    optimizer = optim.create_optimizer(net.trainable_params(), lrs, 0.9, 1e-3, backbone_lr_scale, "fc.")
    scaler = (scaler_class or loss_scale.LossScaler)(plan, 1)
    return step.TrainStep(net, step.create_loss(False), optimizer, scaler), optimizer, scaler


def _batches(count: int):
    import mindspore as ms
    rng = np.random.default_rng(11)
    return [(ms.Tensor(rng.random((4, 3, 32, 32), dtype=np.float32)), ms.Tensor(np.array([0, 1, 2, 3], np.int32)))
            for _ in range(count)]


def _state(optimizer):
    return {p.name: p.asnumpy().copy() for p in list(optimizer.parameters) + list(optimizer.moments)}


@pytest.mark.slow  # compiles and trains two networks per case
@pytest.mark.parametrize("backbone_lr_scale", [1.0, 0.5])   # one learning rate, and one per parameter group
def test_without_overflow_the_masked_update_is_bitwise_nn_momentum(backbone_lr_scale):
    batches = _batches(3)
    states = []
    for plan in (DYNAMIC_FROM_ONE, UNCHECKED):
        train, optimizer, _ = _train_step(plan, backbone_lr_scale)
        for images, labels in batches:
            train.train_on(images, labels)
        states.append(_state(optimizer))
        assert int(optimizer.global_step.asnumpy()[0]) == 3
    masked, plain = states
    assert masked.keys() == plain.keys()
    assert not [name for name in masked if not np.array_equal(masked[name], plain[name])]


def test_an_overflowing_step_leaves_weights_and_moments_alone_and_lowers_the_scale():
    import functools
    from overflow import OverflowOnce
    train, optimizer, scaler = _train_step(precision.LossScalePlan(True, 2.0 ** 10), 0.5,
                                           functools.partial(OverflowOnce, step=2))
    first, second, third = _batches(3)
    train.train_on(*first)
    before = _state(optimizer)
    train.train_on(*second)                                      # its backward seed is inf
    assert not [name for name, value in _state(optimizer).items() if not np.array_equal(value, before[name])]
    assert int(optimizer.global_step.asnumpy()[0]) == 2          # the schedule still moved
    assert float(scaler.value.asnumpy()) == 2.0 ** 9
    assert int(scaler.last_overflow_iter.asnumpy()) == 2 and int(scaler.cur_iter.asnumpy()) == 3
    train.train_on(*third)
    after = _state(optimizer)
    assert all(np.isfinite(value).all() for value in after.values())
    assert [name for name in after if not np.array_equal(after[name], before[name])]


def test_the_checked_step_compiles_without_control_flow(tmp_path):
    """MindSpore's saved graphs of the compiled step hold no Switch: nothing is read back to decide the update."""
    import mindspore as ms
    train, _, _ = _train_step(DYNAMIC_FROM_ONE, 1.0)
    images, labels = _batches(1)[0]
    ms.set_context(save_graphs=1, save_graphs_path=str(tmp_path))
    try:
        train.compile(images, labels)
    finally:
        ms.set_context(save_graphs=0)
    # The graph it runs, after every pass (early passes still show the Switch of library code's constant `if`s).
    [executed] = glob.glob(os.path.join(str(tmp_path), "[0-9]*_execute_*.ir"))
    with open(executed, encoding="utf-8", errors="replace") as f:
        assert "Switch" not in f.read()   # `if not overflow:` put two there
