"""--pretrained from torchvision and timm ResNet files: names mapped, padding as torch pads, torch's own logits.

torch and torchvision are references, never msdist dependencies: `pip install -e ".[reference]"` (CI does).
Where they are absent the reference tests skip; the file-handling and training tests here need neither
(their torch-named files are written with the safetensors package from msdist's own models).
timm's ResNet-18/34/50/101 state_dicts have torchvision's names and shapes (checked with timm 1.0.31), so
torchvision's models stand for both.
"""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, base_env, checkpoints, run_msdist, tiny_args
from torch_files import _model_params, _write_torch_named


IMAGE_SIZE = 64  # the stem's 32x32 map is even: MindSpore's pad_mode="same" max-pool pads it 0/1, torch 1/1
CLASSES = [f"class{i:03d}" for i in range(1000)]


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
