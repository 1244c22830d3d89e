"""SyncBatchNorm's float32 statistics (#32 item 7, msdist/engine/sync_bn.py): the GPU path, selectable
on CPU, against a float64 reference on real ResNet-18 activations. The float64 CPU path and the 1-vs-N
equivalence it carries are tested in tests/test_equivalence.py."""
import numpy as np
import pytest

TOLERANCE = 1e-6  # #32: relative error of the BatchNorm outputs, float32 statistics vs float64


def _resnet18_bn_inputs():
    """The input of the first BatchNorm of the stem and of each stage of a ResNet-18 (He init) on 32 random
    images of 56 px: 1568 to 25088 values per channel."""
    import mindspore as ms
    from models import create_model
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    ms.set_seed(0)
    net = create_model("resnet18", 10)
    net.set_train(False)
    images = ms.Tensor(np.random.default_rng(0).normal(size=(32, 3, 56, 56)).astype(np.float32))
    inputs = [net.stem[0](images)]
    h = net.stem(images)
    for stage in net.stages:
        inputs.append(stage[0].conv1(h))
        h = stage(h)
    return [x.asnumpy() for x in inputs]


def _float64_reference(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray, eps: float) -> np.ndarray:
    x64 = x.astype(np.float64)
    mean = x64.mean(axis=(0, 2, 3), keepdims=True)
    var = ((x64 - mean) ** 2).mean(axis=(0, 2, 3), keepdims=True)
    return (x64 - mean) / np.sqrt(var + eps) * gamma.reshape(1, -1, 1, 1) + beta.reshape(1, -1, 1, 1)


def _sync_bn(channels: int, stats: str):
    import mindspore as ms
    from mindspore import nn
    from msdist.engine.sync_bn import SyncBatchNorm2d
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    rng = np.random.default_rng(channels)
    bn = nn.BatchNorm2d(channels, momentum=0.9)
    bn.gamma.set_data(ms.Tensor(rng.uniform(0.5, 2.0, channels).astype(np.float32)))
    bn.beta.set_data(ms.Tensor(rng.normal(size=channels).astype(np.float32)))
    layer = SyncBatchNorm2d(bn, world_size=1, stats=stats)
    layer.set_train(True)
    return layer


@pytest.fixture(scope="module")
def activations():
    return _resnet18_bn_inputs()


@pytest.mark.slow  # a full-size ResNet-18 forward for its activations
def test_float32_statistics_match_float64_on_resnet18_activations(activations):
    import mindspore as ms
    for x in activations:
        layer = _sync_bn(x.shape[1], "float32")
        got = layer(ms.Tensor(x)).asnumpy().astype(np.float64)
        want = _float64_reference(x, layer.gamma.asnumpy(), layer.beta.asnumpy(), layer.eps)
        gap = np.abs(got - want).max() / np.abs(want).max()
        assert gap <= TOLERANCE, f"{x.shape}: float32 statistics off by {gap:.2e} of the output range"


@pytest.mark.slow  # the same activations
def test_float32_statistics_stay_exact_when_the_mean_lies_far_from_zero(activations):
    """Every activation shifted by 1000 (mean/std ~ 2000), where E[x^2] - E[x]^2 in float32 loses every digit of
    the variance: the corrected two-pass sums keep it to 1e-6, and the mean within the float32 rounding of
    the mean itself (which also bounds the float64 path's outputs here)."""
    import mindspore as ms
    for x in activations:
        x = (x + np.float32(1e3)).astype(np.float32)
        mean, var = (v.asnumpy().astype(np.float64) for v in _sync_bn(x.shape[1], "float32").moments(ms.Tensor(x)))
        x64 = x.astype(np.float64)
        want_mean, want_var = x64.mean(axis=(0, 2, 3)), x64.var(axis=(0, 2, 3))
        assert (np.abs(var - want_var) / want_var).max() <= TOLERANCE
        assert (np.abs(mean - want_mean) <= 2 * np.spacing(want_mean.astype(np.float32))).all()


def test_statistics_precision_is_float32_on_gpu_and_float64_on_cpu():
    from msdist.engine import precision, sync_bn
    assert [precision.bn_stats_precision(d) for d in ("GPU", "CPU")] == ["float32", "float64"]
    assert {precision.bn_stats_precision(d) for d in ("GPU", "CPU")} == set(sync_bn.STATS_PRECISIONS)


def test_float32_statistics_carry_no_float64_in_the_graph(tmp_path):
    """The GPU path's point: no float64 cast or arithmetic left in the layer's compiled forward."""
    import glob
    import mindspore as ms
    x = ms.Tensor(np.random.default_rng(1).normal(size=(4, 8, 6, 6)).astype(np.float32))
    with_float64 = []
    for stats in ("float32", "float64"):
        ms.set_context(save_graphs=1, save_graphs_path=str(tmp_path / stats))
        try:
            _sync_bn(8, stats)(x)
        finally:
            ms.set_context(save_graphs=0)
        finals = glob.glob(str(tmp_path / stats / "**" / "hwopt_common_final*.ir"), recursive=True)
        with_float64.append(any("Float64" in open(f, encoding="utf-8").read() for f in finals) if finals else None)
    assert with_float64 == [False, True]
