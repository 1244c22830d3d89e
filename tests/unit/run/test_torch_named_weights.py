"""--pretrained from torchvision and timm ResNet files: names mapped, padding as torch pads, torch's own logits.

torch and torchvision are references, never msdist dependencies: `pip install -e ".[reference]"` (CI does).
Where they are absent the reference tests skip; the file-handling and training tests here need neither
(their torch-named files are written with the safetensors package from msdist's own models).
timm's ResNet-18/34/50/101 state_dicts have torchvision's names and shapes (checked with timm 1.0.31), so
torchvision's models stand for both.
"""
import os

import numpy as np
import pytest
from torch_files import _model_params, _write_torch_named


def test_a_file_of_another_architecture_is_one_line_naming_the_first_mismatch(tmp_path):
    from models import create_model
    from msdist.base.errors import CheckpointError
    from msdist.run import weights
    _write_torch_named(_model_params("resnet_tiny", 4), tmp_path / "tiny.safetensors")
    with pytest.raises(CheckpointError) as info:
        weights.load_pretrained(create_model("resnet18", 4), weights.read(str(tmp_path / "tiny.safetensors")),
                                "resnet18")
    assert str(info.value) == (f"pretrained weights {tmp_path / 'tiny.safetensors'} do not fit --model resnet18: "
                               "conv1.weight is [8, 3, 3, 3] there, the model needs [64, 3, 7, 7] (stem.0.weight); "
                               "they are a resnet_tiny: pass --model resnet_tiny, or weights of a resnet18")
    # Every tensor of the model present, plus one it has no place for (an SE block): another architecture too.
    params = _model_params("resnet_tiny", 4)
    _write_torch_named(params, tmp_path / "se.safetensors", {"layer1.0.se.fc1.weight": np.ones((2, 8), np.float32)})
    with pytest.raises(CheckpointError, match=r"it has layer1\.0\.se\.fc1\.weight, which the model has no place "
                                              r"for; pass weights of a resnet_tiny$"):
        weights.load_pretrained(create_model("resnet_tiny", 4), weights.read(str(tmp_path / "se.safetensors")),
                                "resnet_tiny")
    # A missing tensor.
    del params["stages.1.0.downsample.bn.moving_mean"]
    _write_torch_named(params, tmp_path / "short.safetensors")
    with pytest.raises(CheckpointError, match=r"it has no stages\.1\.0\.downsample\.bn\.moving_mean \(model \[16\]\)"):
        weights.load_pretrained(create_model("resnet_tiny", 4), weights.read(str(tmp_path / "short.safetensors")),
                                "resnet_tiny")


def test_a_truncated_file_is_one_line(tmp_path):
    from msdist.base.errors import CheckpointError
    from msdist.run import weights
    _write_torch_named(_model_params("resnet_tiny", 4), tmp_path / "full.safetensors")
    data = (tmp_path / "full.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) // 2])  # an interrupted download
    with pytest.raises(CheckpointError) as info:
        weights.read(str(tmp_path / "cut.safetensors"))
    message = str(info.value)
    assert message.startswith(f"cannot read {tmp_path / 'cut.safetensors'} as .safetensors: ") and "\n" not in message
    assert message.endswith("is the file complete (a finished download)?")


def test_resume_and_eval_read_the_convention_the_checkpoint_records(tmp_path):
    import mindspore as ms
    from msdist.base.errors import CheckpointError
    from msdist.run import checkpoint, checkpoint_model
    params = [{"name": "w", "data": ms.Parameter(ms.Tensor(np.ones((1,), np.float32)), name="w")}]
    directory = str(tmp_path / "ckpt")
    for epoch in (1, 2):
        info = checkpoint.save(params, directory, "m", 0, {"epoch": epoch, "step": 3, "global_step": 3 * epoch,
                                                           "config_hash": "h"}, {"convention": "torch"})
    assert checkpoint_model.resume_meta("auto", directory, "m", 0) == {"convention": "torch"}
    os.remove(f"{info.path}.json")  # without the sidecar, the string inside the file answers
    assert checkpoint_model.resume_meta(info.path, directory, "m", 0) == {"convention": "torch"}
    assert checkpoint_model.resume_meta("", directory, "m", 0) == {}
    assert checkpoint_model.resume_meta("auto", directory, "x", 0) == {}
    # Before this field, and without any metadata (model zoo, MindCV): MindSpore's padding, as always.
    ms.save_checkpoint(params, str(tmp_path / "zoo.ckpt"))
    assert checkpoint_model.stored_meta(str(tmp_path / "zoo.ckpt")) == {}
    with pytest.raises(CheckpointError, match="holds no model metadata"):  # predict and export need it
        checkpoint_model.read_meta(str(tmp_path / "zoo.ckpt"))
    assert checkpoint_model.meta_convention({}) == "mindspore"
    assert checkpoint_model.meta_convention({"model": "resnet18"}) == "mindspore"


def test_torchvision_and_timm_names_map_onto_msdist_resnets(torchvision):
    """ResNet-34 and -101 (18 and 50 load in full below): every torchvision tensor has its msdist place."""
    from models import create_model
    from msdist.run.weights import to_msdist_name
    torch, tv = torchvision
    for name in ("resnet34", "resnet101"):
        with torch.device("meta"):  # names and shapes only: no memory, no initialization
            state = getattr(tv.models, name)(weights=None).state_dict()
        theirs = {to_msdist_name(n): tuple(v.shape) for n, v in state.items() if not n.endswith("num_batches_tracked")}
        assert theirs == {p.name: tuple(p.shape) for p in create_model(name, 1000).get_parameters()}, name
