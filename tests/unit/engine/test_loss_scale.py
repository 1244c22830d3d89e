"""engine/loss_scale.py: an inf or NaN in the loss or the gradients is caught on every path (#32 item 8, #34
section 3): per step where float16 carries the gradients (the loss counted too, since it can be non-finite while
the gradients are not), at the log steps everywhere else, through real compiled train steps on CPU. Dynamic loss
scaling is checked against MindSpore's own nn.DynamicLossScaleUpdateCell step by step."""
import re

import numpy as np
import pytest

from conftest import run_msdist, tiny_args
from msdist.engine import precision


def _poisonable_loss():
    """Cross-entropy plus a host-set term outside the gradient: the loss turns inf when asked while the
    gradients stay what they were (what MindSpore 2.10's sparse CPU cross-entropy does past a margin of 88)."""
    import mindspore as ms
    from mindspore import Parameter, Tensor, nn, ops

    class PoisonableLoss(nn.Cell):
        def __init__(self):
            super().__init__()
            self.cross_entropy = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
            self.poison = Parameter(Tensor(0.0, ms.float32), name="poison", requires_grad=False)

        def construct(self, logits, labels):
            return self.cross_entropy(logits, labels) + ops.stop_gradient(self.poison)

    return PoisonableLoss()


def _train_step(plan, amp_level: str, accum_steps: int = 1):
    import mindspore as ms
    from msdist.engine import loss_scale, optim, step

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    ms.set_seed(1)
    net = step.mixed_precision(step.build_network("convnet_tiny", 4, False, False, 1), amp_level, "float16")
    optimizer = optim.create_optimizer(net.trainable_params(), np.full(8, 0.05, np.float32), 0.9, 0.0)
    scaler = loss_scale.LossScaler(plan, world_size=1, rank=0)
    loss_fn = _poisonable_loss()
    return step.TrainStep(net, loss_fn, optimizer, scaler, accum_steps=accum_steps), loss_fn, net


def _batch(seed: int):
    import mindspore as ms
    rng = np.random.default_rng(seed)
    return ms.Tensor(rng.random((4, 3, 32, 32), dtype=np.float32)), ms.Tensor(np.array([0, 1, 2, 3], np.int32))


def _weights(net):
    return [p.asnumpy().copy() for p in net.trainable_params()]


def test_a_fixed_float16_scale_counts_the_loss_in_its_per_step_check():
    """O2 float16, fixed 1024: step 2's loss is inf and its gradients finite; the step and every later one
    leave the weights alone, and the check names step 2 and rank 0."""
    from msdist.base.errors import NonFiniteError
    from msdist.engine import loss_scale
    plan = precision.loss_scale_plan(1024.0, "O2", "float16", "none")
    train, loss_fn, net = _train_step(plan, "O2")
    assert plan.checked
    train(*_batch(0))
    loss_scale.check_finite(train.scaler, train.finite_weights)
    after_one = _weights(net)
    loss_fn.poison.set_data(float("inf"))
    train(*_batch(1))
    loss_fn.poison.set_data(0.0)
    train(*_batch(2))
    assert all(np.array_equal(a, b) for a, b in zip(after_one, _weights(net)))
    with pytest.raises(NonFiniteError, match=r"^step 2: the loss or gradients are not finite \(inf/NaN\) on rank 0 "):
        loss_scale.check_finite(train.scaler, train.finite_weights)


@pytest.mark.parametrize("plan", [precision.loss_scale_plan(1024.0, "O0", "float16", "none"),
                                  precision.loss_scale_plan("dynamic", "O0", "float16", "none")],
                         ids=["fixed_float32_unchecked", "dynamic"])
def test_a_non_finite_loss_is_caught_at_the_log_step(plan):
    """The window's mean loss, read at the log step where the host syncs anyway, stops the run on every path,
    including the one whose steps carry no check at all."""
    from msdist.base.errors import NonFiniteError
    from msdist.engine import loss_scale
    train, loss_fn, _ = _train_step(plan, "O0")
    train.train_on(*_batch(0))
    loss_scale.check_finite(train.scaler, train.finite_weights, train.losses.read(), 1)
    loss_fn.poison.set_data(float("inf"))
    train.train_on(*_batch(1))
    loss_fn.poison.set_data(0.0)
    train.train_on(*_batch(2))
    with pytest.raises(NonFiniteError, match=r"^step 3: the mean training loss since the last log line is inf"):
        loss_scale.check_finite(train.scaler, train.finite_weights, train.losses.read(), 3)


def test_float32_steps_carry_no_check_but_non_finite_gradients_are_caught_at_the_log_step():
    """Fixed 1024 under float32: the compiled step has no overflow check (no IsFinite in its graph), and a
    batch holding an inf, whose gradients are NaN, is caught from the weights at the next check."""
    from msdist.base.errors import NonFiniteError
    from msdist.engine import loss_scale
    plan = precision.loss_scale_plan(1024.0, "O0", "float16", "none")
    train, _, _ = _train_step(plan, "O0")
    assert not train.scaler.checked and train.finite_weights is not None
    images, labels = _batch(0)
    poisoned = images.asnumpy()
    poisoned[0, 0, 3, 3] = np.inf
    import mindspore as ms
    train(ms.Tensor(poisoned), labels)
    with pytest.raises(NonFiniteError, match=r"^step 7: the weights hold an inf or NaN"):
        loss_scale.check_finite(train.scaler, train.finite_weights, None, 7)


def test_accumulated_steps_check_the_mean_loss_of_their_micro_batches():
    from msdist.base.errors import NonFiniteError
    from msdist.engine import loss_scale
    plan = precision.loss_scale_plan(1024.0, "O2", "float16", "none")
    train, loss_fn, _ = _train_step(plan, "O2", accum_steps=2)
    loss_fn.poison.set_data(float("inf"))
    train.train_on(*_batch(0))
    with pytest.raises(NonFiniteError, match=r"^step 1: the loss or gradients are not finite"):
        loss_scale.check_finite(train.scaler, train.finite_weights)


@pytest.mark.slow
def test_a_float32_run_that_diverges_stops_at_its_log_step_with_one_line(data_dir, tmp_path):
    """End to end, no hook: a learning rate of 1e30 under float32 with a fixed 1024, unchecked per step."""
    proc = run_msdist("train", tiny_args(data_dir, tmp_path, "--loss_scale", 1024, "--lr", "1e30", "--warmup_epochs", 0,
                                         "--max_steps", 4, "--log_every", 2), check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "loss scale fixed 1024, no per-step overflow check" in proc.stdout + proc.stderr  # the start-up line
    [line] = [line for line in proc.stderr.splitlines() if line.startswith("msdist:")]
    # Which shows first depends on the loss: a log-sum-exp loss can stay finite on inf logits, the weights cannot.
    assert re.match(r"msdist: error: step 2: (the mean training loss since the last log line is (inf|nan) \(not finite\)"
                    r"|the weights hold an inf or NaN)", line), line
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "result.json").exists()


def test_dynamic_update_matches_mindspore_cell():
    """Same scale after every step as nn.DynamicLossScaleUpdateCell for a run of overflow flags."""
    import mindspore as ms
    from mindspore import Parameter, Tensor, nn
    from msdist.engine.loss_scale import LossScaler

    class Update(nn.Cell):
        def __init__(self, scaler):
            super().__init__()
            self.scaler = scaler

        def construct(self, flag):
            return self.scaler.update(flag)

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    scaler = LossScaler(precision.LossScalePlan(True, 8.0), world_size=1, scale_window=3)
    ours = Update(scaler)
    theirs = nn.DynamicLossScaleUpdateCell(loss_scale_value=8.0, scale_factor=2, scale_window=3)
    their_scale = Parameter(Tensor(8.0, ms.float32), name="their_scale")
    flags = [False, False, False, True, True, True, True, False, False, False, False, False, False, False]
    seen = []
    for flag in flags:
        ours(Tensor(flag))
        theirs(their_scale, Tensor(flag))
        assert float(scaler.value.asnumpy()) == float(their_scale.asnumpy()), flags[:len(seen) + 1]
        seen.append(float(scaler.value.asnumpy()))
    assert min(seen) == 1.0 and max(seen) == 16.0  # halved down to the floor of 1, doubled after 3 clean steps


def test_fixed_scale_under_o2_stops_on_a_batch_holding_inf_before_the_weights_change():
    """A fixed loss scale, amp O2, on CPU: a batch holding an inf (made here, as data) leaves the weights alone
    in that step and every later one, with no host sync per step; `check_finite`, which the loop calls at
    log steps and before writing weights, then names the step and the rank in one line."""
    import mindspore as ms
    from mindspore import nn
    from msdist.base.errors import NonFiniteError
    from msdist.engine import loss_scale, optim, step

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    net = step.mixed_precision(step.build_network("convnet_tiny", 4, False, False, 1), "O2", "float16")
    optimizer = optim.create_optimizer(net.trainable_params(), np.full(8, 0.05, np.float32), 0.9, 0.0)
    scaler = loss_scale.LossScaler(precision.LossScalePlan(False, 1024.0), world_size=1, rank=0)
    train = step.TrainStep(net, nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean"), optimizer, scaler)
    rng = np.random.default_rng(0)
    batches = [rng.random((4, 3, 32, 32), dtype=np.float32) for _ in range(3)]
    labels = ms.Tensor(np.array([0, 1, 2, 3], np.int32))

    def weights():
        return [p.asnumpy().copy() for p in net.trainable_params()]
    before = weights()
    train(ms.Tensor(batches[0]), labels)
    loss_scale.check_finite(scaler)  # a clean step passes
    after_one = weights()
    assert any(not np.array_equal(a, b) for a, b in zip(before, after_one))
    batches[1][1, 0, 5, 5] = np.inf
    train(ms.Tensor(batches[1]), labels)
    train(ms.Tensor(batches[2]), labels)  # after a non-finite step the weights stay put until the run stops
    assert all(np.array_equal(a, b) for a, b in zip(after_one, weights()))
    with pytest.raises(NonFiniteError, match=r"^step 2: the loss or gradients are not finite \(inf/NaN\) on rank 0 "
                                             r"with the fixed loss scale 1024; training stopped before writing"):
        loss_scale.check_finite(scaler)
    assert int(optimizer.global_step.asnumpy()[0]) == 3  # the schedule still follows the data
