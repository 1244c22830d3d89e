"""engine/precision.py: the amp level and the loss-scale plan (`--amp_level`, `--loss_scale`).

The device decisions are pure functions, tested here for GPU and CPU without a GPU. The scaler that carries
out the plan is tested in test_loss_scale.py."""
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
