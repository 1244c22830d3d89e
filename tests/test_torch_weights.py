"""--pretrained from torchvision and timm ResNet files: names mapped, padding as torch pads, torch's own logits.

torch and torchvision are references, never msdist dependencies: `pip install -e ".[reference]"` (CI does).
Where they are absent the reference tests skip; the file-handling and training tests here need neither
(their torch-named files are written with the safetensors package from msdist's own models).
timm's ResNet-18/34/50/101 state_dicts have torchvision's names and shapes (checked with timm 1.0.31), so
torchvision's models stand for both.
"""
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, base_env, checkpoints, run_msdist, tiny_args

IMAGE_SIZE = 64  # the stem's 32x32 map is even: MindSpore's pad_mode="same" max-pool pads it 0/1, torch 1/1
CLASSES = [f"class{i:03d}" for i in range(1000)]
_TORCH_BN = {"gamma": "weight", "beta": "bias", "moving_mean": "running_mean", "moving_variance": "running_var"}


def _torch_name(name: str) -> str:
    """An msdist ResNet parameter name as torchvision and timm write it."""
    name = re.sub(r"^stem\.0\.", "conv1.", re.sub(r"^stem\.1\.", "bn1.", name))
    name = re.sub(r"^stages\.(\d)\.", lambda m: f"layer{int(m[1]) + 1}.", name)
    name = name.replace(".downsample.conv.", ".downsample.0.").replace(".downsample.bn.", ".downsample.1.")
    return re.sub(r"\.(gamma|beta|moving_mean|moving_variance)$", lambda m: "." + _TORCH_BN[m[1]], name)


def _write_torch_named(params: dict, path, extra=None) -> None:
    """{msdist name: array} as a torch-named .safetensors file, BatchNorm counters included as torch saves them."""
    from safetensors.numpy import save_file
    tensors = {_torch_name(name): np.ascontiguousarray(value) for name, value in params.items()}
    for name in [n for n in tensors if n.endswith(".running_var")]:
        tensors[name.replace(".running_var", ".num_batches_tracked")] = np.array(1000, np.int64)
    save_file({**tensors, **(extra or {})}, str(path))


def _model_params(model: str, num_classes: int, seed: int = 3) -> dict:
    import mindspore as ms
    from models import create_model
    ms.set_seed(seed)
    rng = np.random.default_rng(seed)
    params = {}
    for param in create_model(model, num_classes).get_parameters():
        value = param.asnumpy()
        if "moving_" in param.name:  # statistics a fresh model would not have
            value = rng.random(value.shape, dtype=np.float32) + 0.5
        params[param.name] = value
    return params


# ---------------------------------------------------------------- files, no torch needed

def test_torch_named_files_load_exactly_and_convert_keeps_their_convention(tmp_path):
    from models import create_model
    from msdist.run import weights
    params = _model_params("resnet18", 1000)
    _write_torch_named(params, tmp_path / "resnet18.safetensors")
    source = weights.read(str(tmp_path / "resnet18.safetensors"))
    assert (source.kind, source.convention, source.architecture, source.num_classes) == ("torch", "torch", "resnet18",
                                                                                       1000)
    assert len(source.counters) == 20 and source.names["stem.1.moving_variance"] == "bn1.running_var"
    net = create_model("resnet18", 2, convention=source.convention)
    result = weights.load_pretrained(net, source, "resnet18")
    assert weights.report(source, result).endswith("loaded 100 backbone tensors; head fresh (1000 -> 2 classes); "
                                                   "skipped 20 BatchNorm counters (num_batches_tracked)")
    for param in net.get_parameters():
        if not param.name.startswith("fc."):
            np.testing.assert_array_equal(param.asnumpy(), params[param.name], err_msg=param.name)

    # Converted once, the weights need MindSpore alone, and still say how they pad.
    out = tmp_path / "resnet18.ckpt"
    proc = run_msdist("pretrained", ["convert", str(tmp_path / "resnet18.safetensors"), str(out)])
    assert "head loaded (1000 classes)" in proc.stdout and f"wrote {out}" in proc.stdout
    converted = weights.read(str(out))
    assert (converted.kind, converted.convention, converted.architecture) == ("mindspore", "torch", "resnet18")
    assert converted.tensors.keys() == source.tensors.keys()
    for name, value in source.tensors.items():
        np.testing.assert_array_equal(converted.tensors[name], value, err_msg=name)


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


# The launcher of the no-torch test: torch cannot be imported in this process, whatever is installed.
_NO_TORCH = """
import importlib.abc, runpy, sys

class _NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _NoTorch())
sys.argv = ["msdist.pretrained", *sys.argv[1:]]
runpy.run_module("msdist.pretrained", run_name="__main__", alter_sys=True)
"""


def test_a_pth_without_torch_installed_says_what_to_do(tmp_path):
    launcher = tmp_path / "no_torch.py"
    launcher.write_text(_NO_TORCH)
    (tmp_path / "resnet50-0676ba61.pth").write_bytes(b"PK\x03\x04 not read: torch is missing first")
    proc = subprocess.run([sys.executable, str(launcher), "convert", str(tmp_path / "resnet50-0676ba61.pth"),
                           str(tmp_path / "out.ckpt")], cwd=REPO, env=base_env(), capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 2, proc.stderr
    [line] = [line for line in proc.stderr.splitlines() if line.strip()]
    assert line == (f"msdist: error: {tmp_path / 'resnet50-0676ba61.pth'} is a torch file and reading it needs "
                    "torch, which is not installed: pip install torch (the CPU wheel is enough), or convert it to "
                    ".safetensors where torch is installed")
    assert not (tmp_path / "out.ckpt").exists()


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


# ---------------------------------------------------------------- training from torch-named weights

def _two_classes(data_dir, root) -> str:
    """mango and raspberry of the shipped data: a new task for a 4-class backbone (with the fresh head seeded as
    training seeds it, the start predicts one class for all: 0.5; apple vs lemon happened to start at 1.0)."""
    for split in ("Training", "Test"):
        for cls in ("mango", "raspberry"):
            shutil.copytree(os.path.join(data_dir, split, cls), os.path.join(root, split, cls))
    return str(root)


def _accuracy(net, meta, data: str) -> float:
    import mindspore as ms
    from msdist.run import inference
    files = inference.expand_paths([os.path.join(data, "Test")])
    labels = [meta["classes"].index(os.path.basename(os.path.dirname(f))) for f in files]
    logits = net(ms.Tensor(np.stack([inference.preprocess(f, meta) for f in files]))).asnumpy()
    return float(np.mean(logits.argmax(axis=1) == np.array(labels)))


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_rank_finetune_from_safetensors_with_a_new_head(standalone_run, data_dir, tmp_path):
    import mindspore as ms
    from conftest import load_params
    from models import create_model
    from msdist.run import checkpoint_model, weights
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    out, _ = standalone_run
    model_names = {p.name for p in create_model("resnet_tiny", 4).get_parameters()}
    trained = {n: v.astype(np.float32) for n, v in load_params(checkpoints(out, 0)[-1]).items() if n in model_names}
    _write_torch_named(trained, tmp_path / "fruits4.safetensors")  # a 4-class backbone, as timm would ship it
    data = _two_classes(data_dir, tmp_path / "data")

    # The starting point: the backbone with a fresh 2-class head, seeded as training seeds it.
    ms.set_seed(1)
    start = create_model("resnet_tiny", 2)
    weights.load_pretrained(start, weights.read(str(tmp_path / "fruits4.safetensors")), "resnet_tiny")
    start.set_train(False)
    meta = checkpoint_model.model_meta("resnet_tiny", 2, 32, {"mango": 0, "raspberry": 1}, "torch")
    start_accuracy = _accuracy(start, meta, data)

    run = tmp_path / "run"
    proc = run_msdist("train", tiny_args(data, run, "--pretrained", tmp_path / "fruits4.safetensors", "--epochs", 2,
                                         "--lr", 0.02, "--warmup_epochs", 0), ranks=2)
    assert "(torch naming, torch padding): loaded 60 backbone tensors; head fresh (4 -> 2 classes); skipped 12 " \
           "BatchNorm counters (num_batches_tracked)" in proc.stdout
    assert "bn1.num_batches_tracked" not in proc.stdout  # the full list is in the rank's log file only
    assert "skipped BatchNorm counters (num_batches_tracked): bn1.num_batches_tracked" in \
        (run / "logs" / "rank_0.log").read_text()
    result = json.loads((run / "result.json").read_text())
    assert result["world_size"] == 2 and result["num_samples"] == 32
    assert result["accuracy"] > start_accuracy, (start_accuracy, result["accuracy"])
    for rank in (0, 1):
        assert checkpoint_model.stored_meta(checkpoints(run, rank)[-1])["convention"] == "torch"


# ---------------------------------------------------------------- the convention through train, resume, eval

@pytest.mark.multiprocess
@pytest.mark.slow
def test_torch_padding_flows_through_training_resume_and_eval(data_dir, tmp_path):
    """ResNet-18 (it has the stem max-pool) at 32 px: its 16x16 map is even, where the conventions differ."""
    from msdist.run import checkpoint_model
    _write_torch_named(_model_params("resnet18", 4), tmp_path / "resnet18.safetensors")
    run = tmp_path / "run"
    args = ["--model", "resnet18", "--max_steps", 1, "--batch_size", 8, "--eval_batch_size", 16]
    run_msdist("train", tiny_args(data_dir, run, *args, "--pretrained", tmp_path / "resnet18.safetensors"))
    assert checkpoint_model.stored_meta(checkpoints(run, 0)[-1])["convention"] == "torch"
    # Resumed without --pretrained: the network is built as the checkpoint says, not as MindSpore's default.
    args[args.index("--max_steps") + 1] = 2
    run_msdist("train", tiny_args(data_dir, run, *args, "--resume", "auto"))
    newest = checkpoints(run, 0)[-1]
    assert newest.endswith("-1_2.ckpt") and checkpoint_model.stored_meta(newest)["convention"] == "torch"
    # msdist.eval rebuilds the same network from the checkpoint: the same loss as training's own evaluation.
    run_msdist("eval", tiny_args(data_dir, tmp_path / "eval", "--model", "resnet18", "--ckpt", newest,
                                 "--eval_batch_size", 16))
    expected = json.loads((run / "result.json").read_text())
    got = json.loads((tmp_path / "eval" / "eval_result.json").read_text())
    assert got["loss"] == pytest.approx(expected["loss"], rel=1e-5) and got["correct"] == expected["correct"]


# ---------------------------------------------------------------- torchvision's own models as the reference

def _torch_model(torch, tv, name: str):
    """torchvision's own model with random weights and BatchNorm statistics unlike a fresh model's, in eval mode."""
    torch.manual_seed(0)
    model = getattr(tv.models, name)(weights=None)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.running_mean.normal_(0, 0.2, generator=generator)
                module.running_var.uniform_(0.5, 2.0, generator=generator)
                module.weight.uniform_(0.5, 1.5, generator=generator)
                module.bias.normal_(0, 0.2, generator=generator)
                module.num_batches_tracked.fill_(1000)
    return model.eval()


def _msdist_checkpoint(source_path: str, model: str, path: str, convention: str) -> str:
    """The checkpoint training from these weights would start from: the network as --pretrained builds it, with
    the metadata every checkpoint carries (here with 1000 class names and `convention` as given)."""
    from msdist.engine import step
    from msdist.run import checkpoint, checkpoint_model, weights
    source = weights.read(source_path)
    net = step.build_network(model, 1000, False, False, 1, convention)
    weights.load_pretrained(net, source, model)
    meta = checkpoint_model.model_meta(model, 1000, IMAGE_SIZE, {c: i for i, c in enumerate(CLASSES)}, convention)
    checkpoint.save_as([{"name": p.name, "data": p} for p in net.get_parameters()], path,
                       {"epoch": 0, "step": 0, "global_step": 0, "config_hash": ""}, meta)
    return path


@pytest.fixture(scope="module", params=["resnet18", "resnet50"])
def reference(request, torchvision, tmp_path_factory, data_dir):
    """torchvision's model, its weights as .safetensors and .pth, msdist's checkpoint of them, real images.

    msdist's side runs through its CLIs (their start-up picks the oneDNN kernels msdist uses; this test
    process may have started MindSpore with others)."""
    from safetensors.torch import save_file
    torch, tv = torchvision
    name, folder = request.param, tmp_path_factory.mktemp(request.param)
    model = _torch_model(torch, tv, name)
    state = model.state_dict()
    save_file(state, str(folder / f"{name}.safetensors"))
    torch.save(state, str(folder / f"{name}.pth"))
    ckpt = _msdist_checkpoint(str(folder / f"{name}.safetensors"), name, str(folder / f"{name}.ckpt"), "torch")
    files, images, expected = torch_logits_on_test_images(torch, model, data_dir, per_class=4)
    return {"name": name, "folder": folder, "ckpt": ckpt, "files": files, "images": images, "expected": expected}


def torch_logits_on_test_images(torch, model, data_dir: str, per_class: int) -> tuple:
    """(files, images, logits): the first `per_class` Test images of each class, prepared as evaluation prepares
    them at IMAGE_SIZE, and `model`'s logits on them."""
    from msdist.data import pipeline
    from msdist.run import inference
    test_dir = os.path.join(data_dir, "Test")
    files = [os.path.join(test_dir, c, f) for c in sorted(os.listdir(test_dir))
             for f in sorted(os.listdir(os.path.join(test_dir, c)))[:per_class]]
    as_evaluated = {"image_size": IMAGE_SIZE, "mean": list(pipeline.MEAN), "std": list(pipeline.STD)}
    images = np.stack([inference.preprocess(f, as_evaluated) for f in files])
    with torch.no_grad():
        return files, images, model(torch.from_numpy(images)).numpy()


def _relative_gap(got: np.ndarray, expected: np.ndarray) -> float:
    return float(np.abs(got - expected).max() / np.abs(expected).max())


def _onnx_logits(ckpt: str, images: np.ndarray, folder) -> np.ndarray:
    """`python -m msdist.export --format ONNX` of `ckpt`, run by onnxruntime on `images`."""
    import onnxruntime as ort  # the [test] extra installs it
    run_msdist("export", ["--ckpt", ckpt, "--format", "ONNX", "--output", str(folder / "model"),
                          "--batch_size", str(len(images))])
    session = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: images})[0]


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


def assert_predicts_torchs_top5(ckpt: str, files: list, expected: np.ndarray, class_names: list) -> None:
    """`python -m msdist.predict --json` of `ckpt` names torch's top-5 classes with torch's softmax probabilities."""
    from msdist import predict
    proc = run_msdist("predict", ["--ckpt", ckpt, "--json", "--topk", "5", *files])
    records = json.loads(proc.stdout)["predictions"]
    assert len(records) == len(files)
    for record, logits in zip(records, expected):
        probs = predict.softmax(logits[None])[0]
        top = np.argsort(-probs, kind="stable")[:5]
        assert [p["class"] for p in record["predictions"]] == [class_names[i] for i in top]
        np.testing.assert_allclose([p["probability"] for p in record["predictions"]], probs[top], atol=1e-5)


def test_predict_gives_torchs_predictions(reference):
    assert_predicts_torchs_top5(reference["ckpt"], reference["files"], reference["expected"], CLASSES)


def test_onnx_export_gives_torchs_logits(reference, tmp_path):
    got = _onnx_logits(reference["ckpt"], reference["images"], tmp_path)
    assert _relative_gap(got, reference["expected"]) < 1e-4


@pytest.mark.parametrize("reference", ["resnet18"], indirect=True)
def test_mindspore_padding_with_torch_weights_is_not_torchs_model(reference, tmp_path):
    """The control: the test above fails where the network does not pad as the weights' framework did."""
    ckpt = _msdist_checkpoint(str(reference["folder"] / "resnet18.safetensors"), "resnet18",
                              str(tmp_path / "mindspore_padding.ckpt"), "mindspore")
    assert _relative_gap(_onnx_logits(ckpt, reference["images"], tmp_path), reference["expected"]) > 1e-3


def test_safetensors_and_pth_give_identical_parameters(reference):
    from models import create_model
    from msdist.run import weights
    name, folder = reference["name"], reference["folder"]
    loaded = []
    for suffix in (".safetensors", ".pth"):
        source = weights.read(str(folder / f"{name}{suffix}"))
        net = create_model(name, 1000, convention=source.convention)
        weights.load_pretrained(net, source, name)
        loaded.append((source.convention, {p.name: p.asnumpy() for p in net.get_parameters()}))
    (st_convention, st), (pth_convention, pth) = loaded
    assert st_convention == pth_convention == "torch" and st.keys() == pth.keys()
    for param_name, value in st.items():
        np.testing.assert_array_equal(pth[param_name], value, err_msg=param_name)
