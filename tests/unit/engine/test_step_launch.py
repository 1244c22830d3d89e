"""The step's launch (msdist/engine/step.py `_RunEveryStep`): MindSpore's per-run compile check, which walks every
sub-cell, runs only when the inputs' shapes or dtypes change, and skipping it changes no result."""
import numpy as np
import pytest

from msdist.engine import precision


def _train_step(accum_steps: int):
    import mindspore as ms
    from msdist.engine import loss_scale, optim, step

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    ms.set_seed(3)
    net = step.build_network("convnet_tiny", 4, False, False, 1)
    optimizer = optim.create_optimizer(net.trainable_params(), np.full(8, 0.05, np.float32), 0.9, 1e-4)
    scaler = loss_scale.LossScaler(precision.loss_scale_plan("dynamic", "O0", "float16", "none"), 1)
    return step.TrainStep(net, step.create_loss(False), optimizer, scaler, accum_steps=accum_steps), net


def _batches(sizes):
    import mindspore as ms
    rng = np.random.default_rng(5)
    return [(ms.Tensor(rng.random((n, 3, 32, 32), dtype=np.float32)), ms.Tensor(rng.integers(0, 4, n).astype(np.int32)))
            for n in sizes]


@pytest.mark.parametrize("accum_steps", [1, 2])
def test_the_compile_check_runs_only_when_the_batch_shape_changes(monkeypatch, accum_steps):
    from mindspore import nn
    train, _ = _train_step(accum_steps)
    checks = []
    compile_check = nn.Cell.compile

    def counted(cell, *args, **kwargs):
        checks.append(type(cell).__name__)
        return compile_check(cell, *args, **kwargs)
    monkeypatch.setattr(nn.Cell, "compile", counted)
    batches = _batches([8, 8, 8, 4, 4, 8])
    counts = []
    for images, labels in batches:
        train.train_on(images, labels)
        counts.append(len(checks))
    # Compiled at the first batch, again at each change of shape; accumulating, the split and the micro-step change
    # shape together, and the input-free apply step compiles once.
    per_change = 2 if accum_steps > 1 else 1
    first = per_change + (accum_steps > 1)
    assert counts == [first, first, first, first + per_change, first + per_change, first + 2 * per_change]


@pytest.mark.parametrize("accum_steps", [1, 2])
def test_skipping_the_check_gives_the_losses_and_weights_of_checking_every_run(accum_steps):
    from msdist.engine import step
    skipping, skipping_net = _train_step(accum_steps)
    checking, checking_net = _train_step(accum_steps)
    for images, labels in _batches([8, 8, 4, 8]):
        for _, cell in checking.cells_and_names():  # MindSpore's check before every run, as before the skip
            if isinstance(cell, step._RunEveryStep):
                cell._compiled_for = None
        assert float(skipping.train_on(images, labels).asnumpy()) == float(checking.train_on(images, labels).asnumpy())
    for a, b in zip(skipping_net.trainable_params(), checking_net.trainable_params()):
        assert np.array_equal(a.asnumpy(), b.asnumpy()), a.name
