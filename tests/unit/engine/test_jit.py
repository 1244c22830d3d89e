"""`--jit_level` (issue 40 item 4, msdist/engine/jit.py): auto is O1 on GPU and O0 on CPU, an explicit level is kept,
anything else is a one-line error, and the resolved level reaches every graph the train step compiles."""
import numpy as np
import pytest

from msdist.base.errors import ConfigError
from msdist.engine import jit, precision
from msdist.run import config


@pytest.mark.parametrize("asked, device, level", [("auto", "GPU", "O1"), ("auto", "CPU", "O0"), ("O0", "GPU", "O0"),
                                                  ("O1", "CPU", "O1")])
def test_auto_is_fusion_on_gpu_and_kernel_by_kernel_on_cpu(asked, device, level):
    assert jit.resolve_jit_level(asked, device) == level


def test_the_option_defaults_to_auto_and_names_the_levels_it_takes():
    assert config.parse([]).jit_level == "auto"
    assert config.parse(["--jit_level", "O1"]).jit_level == "O1"
    with pytest.raises(ConfigError, match="O0"):
        config.parse(["--jit_level", "O2"])
    with pytest.raises(ConfigError, match="not one of auto, O0, O1"):
        jit.resolve_jit_level("O3", "CPU")


@pytest.mark.parametrize("accum_steps", [1, 2])
def test_every_compiled_cell_of_the_step_carries_the_level(accum_steps):
    import mindspore as ms
    from msdist.engine import loss_scale, optim, step
    ms.set_context(mode=ms.GRAPH_MODE)
    net = step.build_network("convnet_tiny", 4, False, False, 1)
    optimizer = optim.create_optimizer(net.trainable_params(), np.full(4, 0.05, np.float32), 0.9, 0.0)
    scaler = loss_scale.LossScaler(precision.loss_scale_plan("auto", "O0", "float16", "none"), 1)
    train = step.TrainStep(net, step.create_loss(False), optimizer, scaler, accum_steps=accum_steps, jit_level="O1")
    cells = [train] + ([train.apply_step, train.micro_batches] if accum_steps > 1 else [])
    assert [cell.jit_config_dict.get("jit_level") for cell in cells] == ["O1"] * len(cells)
    plain = step.TrainStep(net, step.create_loss(False), optimizer, scaler)
    assert not plain.jit_config_dict   # "" leaves MindSpore's own choice
