"""engine/reducers.py and engine/step.py: fp16 buckets, the once-per-step reduction of accumulation, and the
BatchNorm-free test model (tests/convnet.py) the exactness runs rely on."""
import numpy as np


def test_accumulation_reduces_only_in_the_once_per_step_apply():
    """The micro-step cannot reach the reducer: only `apply_step`, run once per `train_on`, holds it.

    (Reducing every micro-batch would give the same weights, so the run above cannot tell; and
    running `apply_step` per micro-batch would step the optimizer k times, which it does catch.)
    """
    from mindspore import nn
    from msdist.engine import loss_scale, optim, precision, step

    class Identity(nn.Cell):
        def construct(self, grads):
            return grads

    net = step.build_network("convnet_tiny", 4, False, False, 1)
    optimizer = optim.create_optimizer(net.trainable_params(), np.full(4, 0.01, np.float32), 0.9, 0.0)
    reducer = Identity()
    scaler = loss_scale.LossScaler(precision.LossScalePlan(False, 1024.0), 1)
    accumulating = step.TrainStep(net, nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean"), optimizer,
                                  scaler, reducer, accum_steps=4)
    assert [name for name, cell in accumulating.cells_and_names() if cell is reducer] == ["apply_step.update.reducer"]


def test_sparse_reducers_send_at_least_one_element_per_tensor():
    from msdist.engine.reducers import kept_elements
    assert [kept_elements(n, 0.01) for n in (1000, 10, 1)] == [10, 1, 1]


def test_convnet_tiny_has_no_batchnorm():
    import mindspore as ms
    from mindspore import nn
    from models import create_model
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    net = create_model("convnet_tiny", 4, zero_init_last_bn=True)
    assert not any(isinstance(c, (nn.BatchNorm2d, nn.BatchNorm1d)) for _, c in net.cells_and_names())
    out = net(ms.Tensor(np.random.default_rng(0).random((2, 3, 32, 32), dtype=np.float32))).asnumpy()
    assert out.shape == (2, 4) and np.isfinite(out).all()
