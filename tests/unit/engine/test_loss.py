"""The training loss (msdist/engine/loss.py) inside a real train step, against float64 log-sum-exp.

The network is one Dense layer fed an identity batch, so its weights are the logits: each batch puts a
sample's true class a set margin below its top logit (the other samples are ordinary) and runs one
`step.TrainStep` with SGD (momentum buffer = the step's gradient) and a fixed loss scale of 1024, as
configs/resnet18_fruits360.yaml trains. MindSpore 2.10's fused sparse kernel read inf from a margin of
87 on (issue 34); the gradient must stay the one it computed wherever its loss was finite.
"""
import numpy as np
import pytest

CLASSES = 10
MARGINS = (50, 87, 88, 200)


def _logits(margin: float, batch: int = 4, seed: int = 0):
    """(logits, labels): sample 0's true class `margin` below its top logit; the others ordinary."""
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((batch, CLASSES)).astype(np.float32) * 3
    labels = rng.integers(0, CLASSES, batch).astype(np.int32)
    labels[0] = 3
    logits[0] = rng.standard_normal(CLASSES).astype(np.float32)
    logits[0, 3] = logits[0].max() - margin
    return logits, labels


def _reference(logits: np.ndarray, targets: np.ndarray):
    """Mean cross-entropy and its gradient in float64, through log-sum-exp; targets are distributions."""
    z = logits.astype(np.float64)
    top = z.max(axis=1, keepdims=True)
    lse = np.log(np.exp(z - top).sum(axis=1)) + top[:, 0]
    softmax = np.exp(z - lse[:, None])
    return float(np.mean(lse - (targets * z).sum(axis=1))), (softmax - targets) / len(z)


def _train_step(loss_fn, logits: np.ndarray, labels: np.ndarray):
    """One real TrainStep whose logits are `logits`: (the step's loss, its gradient of the logits)."""
    import mindspore as ms
    from mindspore import nn
    from msdist.engine import optim, precision, step
    from msdist.engine.loss_scale import LossScaler

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    batch = len(logits)
    net = nn.Dense(batch, CLASSES, weight_init=ms.Tensor(logits.T.copy()), bias_init="zeros")  # identity in: logits out
    optimizer = optim.create_optimizer(net.trainable_params(), np.full(2, 0.1, np.float32), 0.9, 0.0)
    scaler = LossScaler(precision.LossScalePlan(dynamic=False, initial=1024.0), world_size=1)
    train = step.TrainStep(net, loss_fn, optimizer, scaler)
    train.set_train(True)
    loss = float(train.train_on(ms.Tensor(np.eye(batch, dtype=np.float32)), ms.Tensor(labels)).asnumpy())
    return loss, optimizer.moments[0].asnumpy().T  # the weight's first momentum buffer is its gradient: the logits'


def _relative_gap(got: np.ndarray, expected: np.ndarray) -> float:
    return float(np.abs(got - expected).max() / np.abs(expected).max())


@pytest.mark.parametrize("margin", MARGINS)
def test_sparse_loss_is_log_sum_exp_with_todays_gradient(margin):
    from mindspore import nn
    from msdist.engine import step

    logits, labels = _logits(margin)
    expected_loss, expected_grad = _reference(logits, np.eye(CLASSES)[labels])
    got_loss, got_grad = _train_step(step.create_loss(soft_labels=False), logits, labels)
    assert got_loss == pytest.approx(expected_loss, rel=1e-6)
    assert _relative_gap(got_grad, expected_grad) < 1e-6
    # MindSpore's fused kernel, as training used it before: where its loss is finite, the same gradient.
    fused_loss, fused_grad = _train_step(nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean"), logits,
                                         labels)
    if margin == 50:
        assert np.isfinite(fused_loss)
    if np.isfinite(fused_loss):
        assert _relative_gap(got_grad, fused_grad) <= 1e-6


def _smoothed(labels: np.ndarray):
    from msdist.data import augment
    return augment.soft_labels(labels, CLASSES, 0.1)


def _mixup(labels: np.ndarray):
    from msdist.data import augment
    images = np.zeros((len(labels), 3, 8, 8), np.float32)
    targets = augment.soft_labels(labels, CLASSES, 0.0)
    return augment.mix_batch(images, images[::-1], targets, targets[::-1], 0.7)[1]


def _cutmix(labels: np.ndarray):
    from msdist.data import augment
    images = np.zeros((len(labels), 3, 8, 8), np.float32)
    targets = augment.soft_labels(labels, CLASSES, 0.1)
    return augment.mix_batch(images, images[::-1], targets, targets[::-1], 0.0, box=(0.25, 0.25, 0.75, 0.5))[1]


@pytest.mark.parametrize("margin", MARGINS)
@pytest.mark.parametrize("targets_of", [_smoothed, _mixup, _cutmix], ids=["label_smoothing", "mixup", "cutmix"])
def test_soft_label_loss_is_log_sum_exp(margin, targets_of):
    """Label smoothing, mixup and cutmix targets from msdist's own augment functions, through the soft-label
    loss training builds for them."""
    from msdist.engine import step

    logits, labels = _logits(margin)
    targets = targets_of(labels)
    expected_loss, expected_grad = _reference(logits, targets.astype(np.float64))
    got_loss, got_grad = _train_step(step.create_loss(soft_labels=True), logits, targets)
    assert got_loss == pytest.approx(expected_loss, rel=1e-6)
    assert _relative_gap(got_grad, expected_grad) < 1e-6
