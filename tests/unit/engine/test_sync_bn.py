"""engine/sync_bn.py and bn_stats.unify_bn_stats: SyncBatchNorm's explicit backward against float64,
its rounding, its gradients and precision, and one rank equal to plain BatchNorm.

Its float32 statistics (#32 item 7): the GPU path, selectable on CPU, against a float64 reference on real
ResNet-18 activations. The float64 CPU path and the 1-vs-N equivalence it carries are tested in
tests/integration/test_equivalence.py."""
import numpy as np
import pytest

TOLERANCE = 1e-6  # #32: relative error of the BatchNorm outputs, float32 statistics vs float64


def test_sync_bn_standalone_is_plain_batchnorm():
    from mindspore import nn
    from models import create_model
    from msdist.engine.sync_bn import SyncBatchNorm2d, convert_sync_batchnorm
    net = create_model("resnet_tiny", 4)
    names = [p.name for p in net.get_parameters()]
    assert convert_sync_batchnorm(net, world_size=1) is net
    assert not any(isinstance(c, SyncBatchNorm2d) for _, c in net.cells_and_names())
    converted = convert_sync_batchnorm(create_model("resnet_tiny", 4), world_size=2)
    cells = [c for _, c in converted.cells_and_names()]
    assert sum(isinstance(c, SyncBatchNorm2d) for c in cells) == 12
    assert not any(type(c) is nn.BatchNorm2d for c in cells)  # pylint: disable=unidiomatic-typecheck
    assert sorted(p.name for p in converted.get_parameters()) == sorted(names)  # checkpoints stay interchangeable


def _bn_loss_grads(bn, x, w):
    """Forward of bn on x in training mode; gradients of sum(bn(x) * w) w.r.t. x, gamma, beta."""
    import mindspore as ms
    from mindspore import nn, ops

    class Probe(nn.Cell):
        def __init__(self):
            super().__init__()
            self.bn = bn

        def construct(self, x, w):
            return (ops.cast(self.bn(x), ms.float32) * w).sum()

    probe = Probe()
    probe.set_train(True)
    (dx, _), (dgamma, dbeta) = ops.GradOperation(get_all=True, get_by_list=True)(probe, [bn.gamma, bn.beta])(
        ms.Tensor(x), ms.Tensor(w))
    return dx.asnumpy(), dgamma.asnumpy(), dbeta.asnumpy()


def _float64_batchnorm_grads(x, w, gamma, eps=1e-5):
    x = x.astype(np.float64)
    mean, var = x.mean(axis=(0, 2, 3), keepdims=True), x.var(axis=(0, 2, 3), keepdims=True)
    x_hat = (x - mean) / np.sqrt(var + eps)
    g = gamma.reshape(1, -1, 1, 1)
    dx = g / np.sqrt(var + eps) * (w - w.mean(axis=(0, 2, 3), keepdims=True)
                                   - x_hat * (w * x_hat).mean(axis=(0, 2, 3), keepdims=True))
    return dx, (w * x_hat).sum(axis=(0, 2, 3)), w.sum(axis=(0, 2, 3))


def test_sync_bn_explicit_backward_matches_float64():
    """The hand-written backward on one process against float64 numpy; the shift of 1e3 with std 1 would
    cost E[x^2] - E[x]^2 about 1e-1 of the variance in float32; the Chan/two-pass form keeps it exact."""
    import mindspore as ms
    from mindspore import nn
    from msdist.engine.sync_bn import SyncBatchNorm2d
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((4, 3, 6, 6)) + 1e3).astype(np.float32)
    w = rng.standard_normal((4, 3, 6, 6)).astype(np.float32)
    bn = nn.BatchNorm2d(3)
    bn.gamma.set_data(ms.Tensor(np.array([1.0, 2.0, 0.5], np.float32)))
    got = _bn_loss_grads(SyncBatchNorm2d(bn, world_size=1), x, w)
    want = _float64_batchnorm_grads(x.astype(np.float64), w.astype(np.float64), np.array([1.0, 2.0, 0.5]))
    for name, a, b in zip(("dx", "dgamma", "dbeta"), got, want):
        assert np.abs(a - b).max() <= 1e-3 * np.abs(b).max(), name


def test_statistics_round_exactly_like_reducesum():
    """The forward statistics decide ReLU decisions near zero, so their speed-ups must not change one
    bit: MindSpore's CPU ReduceSum accumulates in double, and so does the float64 matrix product."""
    import mindspore as ms
    from mindspore import nn, ops
    from msdist.engine.sync_bn import _GlobalMoments
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")

    class ReduceSumMoments(nn.Cell):
        def construct(self, x):
            mean = x.mean(axis=(0, 2, 3))
            return mean, ops.square(x - mean.reshape((-1, 1, 1))).sum(axis=(0, 2, 3)) / (x.size // x.shape[1])

    rng = np.random.default_rng(0)
    for shape in ((8, 64, 25, 25), (8, 512, 7, 7), (3, 5, 4, 4)):
        x = ms.Tensor(rng.normal(1, 3, shape).astype(np.float32))
        for fast, reference in zip(_GlobalMoments(1e-5, shape[1], world_size=1)(x), ReduceSumMoments()(x)):
            assert np.array_equal(fast.asnumpy(), reference.asnumpy()), shape


def test_sync_bn_gradients_of_gamma_and_beta_skip_the_gradient_reducer():
    """Their backward already returns the job's mean (the equivalence runs above check the values), so
    MindSpore's data-parallel reducer must leave out exactly those: a second average would be two more
    blocking collectives per layer. With one rank nothing is converted or marked."""
    import mindspore as ms
    from models import create_model
    from msdist.engine.reducers import default_reducer
    from msdist.engine.sync_bn import SyncBatchNorm2d, convert_sync_batchnorm
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    net = convert_sync_batchnorm(create_model("resnet_tiny", 4), 2)
    affine = {id(p) for _, cell in net.cells_and_names() if isinstance(cell, SyncBatchNorm2d)
              for p in (cell.gamma, cell.beta)}
    params = net.trainable_params()
    skipped = {id(p) for p, reduced in zip(params, default_reducer(params, 2).allreduce_filter) if not reduced}
    assert affine and skipped == affine
    single = convert_sync_batchnorm(create_model("resnet_tiny", 4), 1)
    assert not any(p.layerwise_parallel for p in single.trainable_params())


def test_sync_bn_stays_float32_under_amp():
    """O2: MindSpore's AMP black list keeps it float32 like nn.BatchNorm2d. O3 casts every cell to float16;
    the statistics stay float32 anyway (a float16 sum over a batch of values ~300 overflows at 65504)."""
    import mindspore as ms
    from mindspore import nn
    from models import create_model
    from msdist.engine.sync_bn import SyncBatchNorm2d, convert_sync_batchnorm
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    net = ms.amp.auto_mixed_precision(convert_sync_batchnorm(create_model("resnet_tiny", 4), 2), "O2",
                                      dtype=ms.float16)
    layers = [c for _, c in net.cells_and_names() if isinstance(c, SyncBatchNorm2d)]
    assert len(layers) == 12 and all(c.get_flags().get("fp32") and not c.get_flags().get("fp16") for c in layers)
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((8, 2, 16, 16)) * 4 + 300).astype(np.float32)
    w = rng.standard_normal(x.shape).astype(np.float32)
    bn = SyncBatchNorm2d(nn.BatchNorm2d(2), world_size=1)
    bn.to_float(ms.float16)
    dx, dgamma, _ = _bn_loss_grads(bn, x, w)
    want_dx, want_dgamma, _ = _float64_batchnorm_grads(x.astype(np.float16).astype(np.float64), w, np.ones(2))
    assert np.isfinite(dx).all() and np.isfinite(dgamma).all()
    assert np.abs(dgamma - want_dgamma).max() <= 2e-2 * np.abs(want_dgamma).max()  # output rounded to float16


def test_unify_bn_stats_reduce_and_broadcast():
    """The operation alone, seen from rank 1 of two: stand-in collectives return what AllGather would."""
    from models import create_model
    from msdist.engine.bn_stats import unify_bn_stats

    class TwoRanks:  # Collectives.gather on rank 1 of a 2-rank job: row r = rank r's values
        world_size = 2

        def __init__(self, rank0):
            self.rank0 = rank0

        def gather(self, values):
            return np.stack([self.rank0, values])

    stats = lambda net: [p for p in net.get_parameters() if "moving_" in p.name]  # noqa: E731
    for mode in ("reduce", "broadcast", "none"):
        net = create_model("resnet_tiny", 4)
        before = np.concatenate([p.asnumpy().astype(np.float64).ravel() for p in stats(net)])
        rank0 = before + 1.0
        unify_bn_stats(net, TwoRanks(rank0), mode)
        after = np.concatenate([p.asnumpy().astype(np.float64).ravel() for p in stats(net)])
        want = {"reduce": (before + rank0) / 2, "broadcast": rank0, "none": before}[mode]
        assert np.array_equal(after, want.astype(np.float32)), mode


def test_unify_bn_stats_over_batch_slots():
    """A rank running 2 of a 4-slot job's slots on 2 ranks (seen from rank 1): "reduce" is the mean over the 4
    slots, "broadcast" slot 0's (rank 0's network); every slot of this rank gets the result."""
    from mindspore import Tensor
    from models import create_model
    from msdist.engine.bn_stats import SlotStatistics, bn_running_stats, unify_bn_stats

    class TwoRanks:
        world_size = 2

        def __init__(self, rank0):
            self.rank0 = rank0

        def gather(self, values):
            return np.stack([self.rank0, values])

    flat = lambda params: np.concatenate([p.asnumpy().astype(np.float64).ravel() for p in params])  # noqa: E731
    for mode in ("reduce", "broadcast"):
        net = create_model("resnet_tiny", 4)
        slots = SlotStatistics(net, 2)
        own = flat(bn_running_stats(net))
        for p in slots.others[0]:
            p.set_data(Tensor(p.asnumpy() + 2.0))
        rank0_own, rank0_sum = own + 1.0, 2 * own + 5.0   # rank 0's network, and its two slots summed
        unify_bn_stats(net, TwoRanks(rank0_sum if mode == "reduce" else rank0_own), mode, slots.others, slots=4)
        want = {"reduce": (rank0_sum + own + own + 2.0) / 4, "broadcast": rank0_own}[mode].astype(np.float32)
        assert np.array_equal(flat(bn_running_stats(net)), want), mode
        assert np.array_equal(flat(slots.others[0]), want), mode



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
