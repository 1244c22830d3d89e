"""models/resnet.py: every registered ResNet's forward shape, and zero-initialised last BatchNorm."""
import numpy as np
import pytest


# Compiling the deeper ResNets takes seconds each on 2 cores: they are slow, the fast subset keeps two depths.
@pytest.mark.parametrize("name", ["resnet_tiny", "resnet18", *(pytest.param(name, marks=pytest.mark.slow)
                                                          for name in ("resnet34", "resnet50", "resnet101"))])
def test_model_forward_shape(name):
    import mindspore as ms
    from models import create_model, list_models
    assert name in list_models()
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    net = create_model(name, num_classes=5)
    net.set_train(False)
    out = net(ms.Tensor(np.random.default_rng(0).random((2, 3, 32, 32), dtype=np.float32))).asnumpy()
    assert out.shape == (2, 5) and np.isfinite(out).all()


def test_zero_init_last_bn():
    from models import create_model
    net = create_model("resnet50", 3, zero_init_last_bn=True)
    gammas = {p.name: p.asnumpy() for p in net.get_parameters() if p.name.endswith("bn3.gamma")}
    assert len(gammas) == 16 and all(np.all(g == 0) for g in gammas.values())
