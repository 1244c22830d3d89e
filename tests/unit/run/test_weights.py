"""run/weights.py: `--pretrained` names mapped from the zoo and MindCV, another class count, a file that does
not fit, `--backbone_lr_scale` groups; torchvision and timm ResNet files: names mapped, padding as torch pads,
torch's own logits.

torch and torchvision are references, never msdist dependencies: `pip install -e ".[reference]"` (CI does).
Where they are absent the reference tests skip; the file-handling and training tests here need neither
(their torch-named files are written with the safetensors package from msdist's own models).
timm's ResNet-18/34/50/101 state_dicts have torchvision's names and shapes (checked with timm 1.0.31), so
torchvision's models stand for both.
"""
import os

import numpy as np
import pytest
from conftest import _write_pretrained
from torch_files import _model_params, _write_torch_named


ZOO_AND_MINDCV_NAMES = {  # names as the model zoo (official/cv/ResNet) and MindCV (models/resnet.py) write them
    "conv1.weight": "stem.0.weight", "bn1.moving_variance": "stem.1.moving_variance",
    "layer1.0.conv1.weight": "stages.0.0.conv1.weight", "layer1.1.bn1d.gamma": "stages.0.1.bn1.gamma",
    "layer2.0.bn2d.beta": "stages.1.0.bn2.beta", "layer4.2.bn3.moving_mean": "stages.3.2.bn3.moving_mean",
    "layer2.0.down_sample_layer.0.weight": "stages.1.0.downsample.conv.weight",
    "layer3.0.down_sample_layer.1.gamma": "stages.2.0.downsample.bn.gamma",
    "layer4.0.down_sample.0.weight": "stages.3.0.downsample.conv.weight",
    "layer4.0.down_sample.1.moving_mean": "stages.3.0.downsample.bn.moving_mean",
    "end_point.weight": "fc.weight", "classifier.bias": "fc.bias",
    "stages.0.0.conv1.weight": "stages.0.0.conv1.weight",  # msdist's own names stay
}


def _zoo_name(name: str) -> str:
    """An msdist ResNet-18-style name as the model zoo writes it (bn{k}d in basic blocks, end_point)."""
    import re
    name = re.sub(r"^stem\.0\.", "conv1.", re.sub(r"^stem\.1\.", "bn1.", name))
    name = re.sub(r"^stages\.(\d)\.", lambda m: f"layer{int(m[1]) + 1}.", name)
    name = re.sub(r"\.bn(\d)\.", r".bn\1d.", name)
    name = name.replace("downsample.conv.", "down_sample_layer.0.").replace("downsample.bn.", "down_sample_layer.1.")
    return re.sub(r"^fc\.", "end_point.", name)


def test_zoo_and_mindcv_names_map_onto_msdist_resnets():
    from models import create_model
    from msdist.run.weights import to_msdist_name
    ours = {p.name for name in ("resnet18", "resnet50") for p in create_model(name, 10).get_parameters()}
    for theirs, expected in ZOO_AND_MINDCV_NAMES.items():
        assert to_msdist_name(theirs) == expected and expected in ours, theirs
    r18 = [p.name for p in create_model("resnet18", 10).get_parameters()]
    assert [to_msdist_name(_zoo_name(n)) for n in r18] == r18  # every tensor of a zoo ResNet-18 finds its place


def test_pretrained_with_another_class_count_loads_the_backbone_exactly(tmp_path, caplog):
    import mindspore as ms
    from models import create_model
    from msdist.run import weights
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    path = str(tmp_path / "zoo.ckpt")
    source = _write_pretrained(path, num_classes=3, rename=_zoo_name)
    ms.set_seed(1)
    net = create_model("resnet_tiny", 4)
    fresh_head = {p.name: p.asnumpy().copy() for p in net.get_parameters() if p.name.startswith("fc.")}
    with caplog.at_level("INFO", logger="msdist.run.weights"):
        result = weights.load_pretrained(net, weights.read(path), "resnet_tiny")
    backbone = [p for p in net.get_parameters() if not p.name.startswith("fc.")]
    assert sorted(result.loads) == sorted(p.name for p in backbone)
    for param in backbone:
        np.testing.assert_array_equal(param.asnumpy(), source[param.name], err_msg=param.name)
    for param in net.get_parameters():
        if param.name.startswith("fc."):
            np.testing.assert_array_equal(param.asnumpy(), fresh_head[param.name])  # fresh, not the 3-class head
    assert result.skipped == {"optimizer/state entries": ["learning_rate", "moments.fc.weight"]}
    # One grouped line for the console; every name only in the rank's log file. Only weights' own records:
    # MindSpore logs once per process (its set_context deprecation warning) in whichever test comes first.
    ours = [r for r in caplog.records if r.name == "msdist.run.weights"]
    console = [r.getMessage() for r in ours if getattr(r, "console", True)]
    assert console == [f"pretrained {path} (mindspore naming, mindspore padding): loaded {len(backbone)} backbone "
                       "tensors; head fresh (3 -> 4 classes); skipped 2 optimizer/state entries"]
    file_only = [r.getMessage() for r in ours if not getattr(r, "console", True)]
    assert file_only[0].startswith(f"pretrained {path}: loaded stem.0.weight, stem.1.moving_mean, ")
    assert file_only[1] == f"pretrained {path}: skipped optimizer/state entries: learning_rate, moments.fc.weight"
    same = create_model("resnet_tiny", 3)  # the same class count: the classifier loads too
    assert "fc.weight" in weights.load_pretrained(same, weights.read(path), "resnet_tiny").loads


def test_pretrained_that_does_not_fit_names_the_first_tensor(tmp_path):
    from models import create_model
    from msdist.run import weights
    from msdist.base.errors import CheckpointError
    _write_pretrained(tmp_path / "tiny.ckpt", num_classes=4)
    with pytest.raises(CheckpointError) as info:
        weights.load_pretrained(create_model("resnet18", 4), weights.read(str(tmp_path / "tiny.ckpt")), "resnet18")
    message = str(info.value)
    assert "stem.0.weight is [8, 3, 3, 3] there, the model needs [64, 3, 7, 7]" in message and "\n" not in message
    assert "they are a resnet_tiny: pass --model resnet_tiny, or weights of a resnet18" in message


def test_backbone_lr_scale_groups():
    import mindspore as ms
    from msdist.engine import optim
    params = [ms.Parameter(ms.Tensor(np.ones(shape, np.float32)), name=name)
              for name, shape in (("conv.weight", (2, 2)), ("bn.gamma", (2,)), ("fc.weight", (3, 2)),
                                  ("fc.bias", (3,)))]
    lrs = np.array([0.1, 0.2], np.float32)
    groups = optim.param_groups(params, 1e-4, lrs, backbone_lr_scale=0.1)
    assert groups[-1] == {"order_params": params}  # network order kept (gradient buckets)
    by_name = {p.name: (g["lr"].asnumpy(), g["weight_decay"]) for g in groups[:-1] for p in g["params"]}
    np.testing.assert_allclose(by_name["conv.weight"][0], lrs * 0.1)
    np.testing.assert_allclose(by_name["fc.weight"][0], lrs)
    assert by_name["conv.weight"][1] == by_name["fc.weight"][1] == 1e-4 and by_name["fc.bias"][1] == 0.0
    assert len(optim.param_groups(params, 1e-4)) == 3  # scale 1: the plain two groups (no per-group lr), order


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
