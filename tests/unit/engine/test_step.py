"""engine/step.py, the train step:

- gradient accumulation splits each batch on the device (#32 item 6): no asnumpy()/Tensor(...) round trip
  through the host per optimizer step, and the same losses and weights as splitting on the host, the way it
  was done before;
- the step's launch (`_RunEveryStep`): MindSpore's per-run compile check, which walks every sub-cell, runs only
  when the inputs' shapes or dtypes change, and skipping it changes no result;
- the loss stays on the device between log steps (`LossAccumulator`): the host reads the window's mean;
- the gradient buckets (`--allreduce_fusion`) are validated and numbered in send order."""
import numpy as np
import pytest

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


@pytest.mark.slow  # trains two networks
def test_device_split_gives_the_losses_and_weights_of_the_host_split():
    device_step, device_net = _accumulating_step()
    host_step, host_net = _accumulating_step()
    for images, labels in _batches():
        on_device = float(device_step.train_on(images, labels).asnumpy())
        through_host = float(_split_through_the_host(host_step, images, labels).asnumpy())
        assert on_device == through_host
    for a, b in zip(device_net.trainable_params(), host_net.trainable_params()):
        assert np.array_equal(a.asnumpy(), b.asnumpy()), a.name


def _capturing_step(accum_steps, grad_scale, slots_owned=1):
    """A TrainStep whose "reducer" records the gradients it is given (what the all-reduce would take)."""
    import mindspore as ms
    from mindspore import Parameter, ParameterTuple, Tensor, nn, ops
    from msdist.engine import loss_scale, optim, step

    class Capture(nn.Cell):
        def __init__(self, params):
            super().__init__(auto_prefix=False)
            self.seen = ParameterTuple([Parameter(Tensor(np.zeros(p.shape, np.float32)), name=f"seen.{p.name}",
                                                  requires_grad=False) for p in params])
            self.hyper_map = ops.HyperMap()

        def construct(self, grads):
            return ops.depend(grads, self.hyper_map(ops.assign, self.seen, grads))

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    ms.set_seed(3)
    net = step.build_network("resnet_tiny", 4, False, False, 1)
    optimizer = optim.create_optimizer(net.trainable_params(), np.full(STEPS, 0.05, np.float32), 0.9, 1e-4)
    scaler = loss_scale.LossScaler(precision.loss_scale_plan("auto", "O0", "float32", "none"), 1)
    capture = Capture(optimizer.parameters)
    train = step.TrainStep(net, nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean"), optimizer, scaler,
                           capture, accum_steps, grad_scale, slots_owned)
    train.set_train(True)
    return train, capture, net


@pytest.mark.slow   # three resnet_tiny steps compiled
def test_a_rank_owning_two_slots_sends_exactly_the_mean_of_their_gradients_and_keeps_their_statistics_apart():
    """Batch layout (data/plan.py): one rank running a 2-rank job's two slots as micro-batches sends the all-reduce
    (g0 + g1) / 2 bitwise, each g the gradient one rank computes alone; each slot's BatchNorm statistics follow its
    own images only, as the two ranks' did."""
    import mindspore as ms
    images, labels = (t.asnumpy() for t in _batches()[0])
    images, labels = np.concatenate([images, images[::-1] * 0.5]), np.concatenate([labels, labels[::-1]])
    alone = []
    for part in (slice(0, 8), slice(8, 16)):
        train, capture, net = _capturing_step(1, None)
        train.train_on(ms.Tensor(images[part]), ms.Tensor(labels[part]))
        alone.append(([p.asnumpy() for p in capture.seen],
                      [p.asnumpy() for p in net.get_parameters() if "moving_" in p.name]))
    train, capture, net = _capturing_step(2, 0.5, slots_owned=2)
    train.train_on(ms.Tensor(images), ms.Tensor(labels))
    for sent, g0, g1 in zip(capture.seen, alone[0][0], alone[1][0]):
        assert np.array_equal(sent.asnumpy(), (g0 + g1) * np.float32(0.5)), sent.name
    stats = [p for p in net.get_parameters() if "moving_" in p.name]
    assert all(np.array_equal(p.asnumpy(), want) for p, want in zip(stats, alone[0][1]))   # the network: slot 0's
    assert all(np.array_equal(p.asnumpy(), want) for p, want in zip(train.slot_stats.others[0], alone[1][1]))


@pytest.mark.slow
def test_one_slot_of_an_uneven_layout_is_scaled_before_the_all_reduce():
    """Rank 1 of 3 owning one of 4 slots: its single micro-batch's gradient goes out times 3/4, so the mean over the
    ranks weighs every slot 1/4."""
    images, labels = _batches()[0]
    plain, seen_plain, _ = _capturing_step(1, None)
    plain.train_on(images, labels)
    scaled, seen_scaled, _ = _capturing_step(1, 3 / 4)
    assert scaled.accumulates and not plain.accumulates
    scaled.train_on(images, labels)
    for a, b in zip(seen_scaled.seen, seen_plain.seen):
        assert np.array_equal(a.asnumpy(), (b.asnumpy() * np.float32(0.75)).astype(np.float32)), a.name


def _train_step(accum_steps: int):
    import mindspore as ms
    from msdist.engine import loss_scale, optim, step

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    ms.set_seed(3)
    net = step.build_network("convnet_tiny", 4, False, False, 1)
    optimizer = optim.create_optimizer(net.trainable_params(), np.full(8, 0.05, np.float32), 0.9, 1e-4)
    scaler = loss_scale.LossScaler(precision.loss_scale_plan("dynamic", "O0", "float16", "none"), 1)
    return step.TrainStep(net, step.create_loss(False), optimizer, scaler, accum_steps=accum_steps), net


def _batches_of(sizes):
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
    batches = _batches_of([8, 8, 8, 4, 4, 8])
    counts = []
    for images, labels in batches:
        train.train_on(images, labels)
        counts.append(len(checks))
    # Compiled at the first batch, again at each change of shape; accumulating, the split and the micro-step change
    # shape together, and the input-free apply step compiles once.
    per_change = 2 if accum_steps > 1 else 1
    first = per_change + (accum_steps > 1)
    assert counts == [first, first, first, first + per_change, first + per_change, first + 2 * per_change]


@pytest.mark.slow  # trains two networks per case, compiling each at every batch shape
@pytest.mark.parametrize("accum_steps", [1, 2])
def test_skipping_the_check_gives_the_losses_and_weights_of_checking_every_run(accum_steps):
    from msdist.engine import step
    skipping, skipping_net = _train_step(accum_steps)
    checking, checking_net = _train_step(accum_steps)
    for images, labels in _batches_of([8, 8, 4, 8]):
        for _, cell in checking.cells_and_names():  # MindSpore's check before every run, as before the skip
            if isinstance(cell, step._RunEveryStep):
                cell._compiled_for = None
        assert float(skipping.train_on(images, labels).asnumpy()) == float(checking.train_on(images, labels).asnumpy())
    for a, b in zip(skipping_net.trainable_params(), checking_net.trainable_params()):
        assert np.array_equal(a.asnumpy(), b.asnumpy()), a.name


def test_loss_accumulator_reads_the_mean_since_the_last_read():
    """The train step adds its loss to a device total inside its own graph; the host reads the window's mean."""
    import mindspore as ms
    from mindspore import nn
    from msdist.engine import loss_scale, optim, precision, step

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    net = step.build_network("convnet_tiny", 4, False, False, 1)
    optimizer = optim.create_optimizer(net.trainable_params(), np.full(8, 0.01, np.float32), 0.9, 0.0)
    train = step.TrainStep(net, nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean"), optimizer,
                           loss_scale.LossScaler(precision.LossScalePlan(False, 1.0, checked=False), 1))
    rng = np.random.default_rng(0)
    labels = ms.Tensor(np.array([0, 1, 2, 3], np.int32))
    seen = [train.train_on(ms.Tensor(rng.random((4, 3, 32, 32), dtype=np.float32)), labels) for _ in range(3)]
    total = seen[0] + seen[1] + seen[2]  # float32 sums in the same order as the device total
    assert train.losses.read() == float(total.asnumpy()) / 3
    last = train.train_on(ms.Tensor(rng.random((4, 3, 32, 32), dtype=np.float32)), labels)
    assert train.losses.read() == float(last.asnumpy())


def test_allreduce_fusion_is_validated(monkeypatch):
    import pytest
    from msdist.run import config
    from msdist.engine import step
    from msdist.base.errors import ConfigError

    for bad in ("160,85", "a,b", "0,3"):
        with pytest.raises(ConfigError, match="strictly increasing parameter indices"):
            config.parse(["--allreduce_fusion", bad])
    assert config.parse([]).allreduce_fusion == "auto" and config.fusion_split("auto") is None
    net = step.build_network("resnet18", 10, False, False, 1)
    with pytest.raises(ConfigError, match="it has 62"):  # e.g. [85, 160] on a ResNet-18
        step.bucket_gradients(net, [85, 160], world_size=2)
    import mindspore as ms
    try:
        plan = step.bucket_gradients(net, None, world_size=2)
        # Each parameter carries its bucket's number in send order: MindSpore's reducer fuses equal numbers.
        assert [p.comm_fusion for p in net.trainable_params()] == [2] * 49 + [1] * 13 and len(plan) == 2
        # One 256 KB unit (MindSpore's) above the largest bucket, 24.1 MB = 96.4 units: no bucket is cut again
        assert ms.get_auto_parallel_context("comm_fusion")["allreduce"]["config"] == 98
    finally:
        ms.reset_auto_parallel_context()
