"""Mixed precision and loss scaling (msdist/engine/precision.py, msdist/engine/loss_scale.py, engine/step.py ScaledUpdate).

The device decisions are pure functions, tested here for GPU and CPU without a GPU. Dynamic loss
scaling is checked against MindSpore's own nn.DynamicLossScaleUpdateCell step by step."""
import numpy as np
import pytest

from msdist.base.errors import ConfigError
from msdist.engine import precision
from msdist.run import config


def test_amp_auto_is_o2_on_gpu_and_o0_on_cpu():
    assert precision.resolve_amp_level("auto", "GPU") == "O2"
    assert precision.resolve_amp_level("auto", "CPU") == "O0"
    assert precision.resolve_amp_level("O3", "GPU") == "O3"
    assert precision.resolve_amp_level("O2", "CPU") == "O2"  # explicit levels still run (with a warning)
    assert config.parse([]).amp_level == "auto"


def test_explicit_low_precision_on_cpu_warns_and_names_auto(caplog):
    precision.warn_if_no_speedup("O2", "CPU")
    precision.warn_if_no_speedup("O2", "GPU")
    precision.warn_if_no_speedup("auto", "CPU")
    assert len(caplog.records) == 1 and "--amp_level auto" in caplog.records[0].getMessage()


def test_loss_scale_auto_is_dynamic_only_where_float16_carries_gradients():
    dynamic = precision.LossScalePlan(True, precision.DYNAMIC_INITIAL_SCALE)
    assert precision.loss_scale_plan("auto", "O2", "float16", "none") == dynamic          # GPU default
    unchecked = precision.LossScalePlan(False, 1.0, checked=False)
    assert precision.loss_scale_plan("auto", "O0", "float16", "none") == unchecked
    assert precision.loss_scale_plan("auto", "O2", "bfloat16", "none") == unchecked
    assert precision.loss_scale_plan("auto", "O0", "float16", "fp16") == dynamic          # float16 exchange
    assert precision.loss_scale_plan("dynamic", "O0", "float16", "none") == dynamic       # asked for on CPU
    assert precision.loss_scale_plan(1024.0, "O2", "float16", "none") == precision.LossScalePlan(False, 1024.0)


def test_loss_scale_option_accepts_modes_and_numbers_and_suggests():
    assert config.parse([]).loss_scale == "auto"
    assert config.parse(["--loss_scale", "Dynamic"]).loss_scale == "dynamic"
    assert config.parse(["--loss_scale", "1024"]).loss_scale == 1024.0
    with pytest.raises(ConfigError, match=r"did you mean dynamic\?"):
        config.parse(["--loss_scale", "dynamc"])
    with pytest.raises(ConfigError, match="must be a finite number > 0"):
        config.parse(["--loss_scale", "0"])


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


@pytest.mark.parametrize("loss_scale, amp_level, amp_dtype, compression, checked", [
    ("auto", "O0", "float16", "none", False),       # CPU default: no scaling
    (1024.0, "O0", "float16", "none", False),       # float32 gradients: 1024 changes nothing, costs a check
    (1024.0, "O2", "bfloat16", "none", False),      # bfloat16 has float32's range
    (1024.0, "O2", "float16", "none", True),        # float16 gradients can overflow
    (1.0, "O3", "float16", "none", True),
    (1024.0, "O0", "float16", "fp16", True),        # the float16 exchange can overflow
    ("dynamic", "O0", "float16", "none", True),
])
def test_the_per_step_check_runs_only_where_float16_carries_gradients(loss_scale, amp_level, amp_dtype, compression,
                                                                       checked):
    """#32 item 8: under float32 a fixed scale cannot matter, so no step pays for the check; the start-up line
    says which."""
    from msdist.engine import loss_scale as scaling
    plan = precision.loss_scale_plan(loss_scale, amp_level, amp_dtype, compression)
    assert plan.checked == checked and scaling.LossScaler(plan, 1).checked == checked
    assert ("no per-step overflow check" in plan.describe()) == (not checked)
