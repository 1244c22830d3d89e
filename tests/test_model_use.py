"""Using a trained model: predict from the checkpoint alone, export, best checkpoint, pretrained weights, EMA."""
import json
import os
import shutil

import numpy as np
import pytest

from conftest import checkpoints, run_msdist
from msdist.run.position import Position

CLASSES = ["apple", "lemon", "mango", "raspberry"]


@pytest.fixture(scope="module")
def trained_ckpt(standalone_run, tmp_path_factory):
    """The standalone run's checkpoint (and sidecar) copied away from its output_dir and data tree."""
    out, _ = standalone_run
    folder = tmp_path_factory.mktemp("ckpt_only")
    src = checkpoints(out, 0)[-1]
    for path in (src, f"{src}.json"):
        shutil.copy(path, folder)
    return str(folder / os.path.basename(src)), json.loads((out / "result.json").read_text())


@pytest.mark.multiprocess
def test_predict_from_the_checkpoint_alone(trained_ckpt, data_dir, tmp_path):
    ckpt, result = trained_ckpt
    test_dir = os.path.join(data_dir, "Test")
    (tmp_path / "broken.jpg").write_bytes(b"not an image")
    missing = str(tmp_path / "missing.png")
    proc = run_msdist("predict", ["--ckpt", ckpt, "--json", "--topk", "3", test_dir, str(tmp_path), missing],
                      check=False)
    assert proc.returncode == 1, proc.stderr  # some files failed; the others were still predicted
    records = json.loads(proc.stdout)["predictions"]
    failed = {r["path"]: r["error"] for r in records if "error" in r}
    assert failed.keys() == {str(tmp_path / "broken.jpg"), missing}
    assert "cannot decode" in failed[str(tmp_path / "broken.jpg")] and "cannot read" in failed[missing]
    good = [r for r in records if "predictions" in r]
    assert len(good) == result["num_samples"]
    for record in good:
        probs = [p["probability"] for p in record["predictions"]]
        assert len(probs) == 3 and probs == sorted(probs, reverse=True) and 0 < sum(probs) <= 1 + 1e-9
        assert {p["class"] for p in record["predictions"]} <= set(CLASSES)
    # Same weights and the same preprocessing as evaluation: the same images are right.
    right = sum(r["predictions"][0]["class"] == os.path.basename(os.path.dirname(r["path"])) for r in good)
    assert right == result["correct"]


@pytest.mark.multiprocess
def test_predict_text_output_and_unreadable_checkpoint(trained_ckpt, data_dir, tmp_path):
    ckpt, _ = trained_ckpt
    image = os.path.join(data_dir, "Test", "lemon", sorted(os.listdir(os.path.join(data_dir, "Test", "lemon")))[0])
    proc = run_msdist("predict", ["--ckpt", ckpt, image, "--topk", "2"])
    [line] = proc.stdout.splitlines()
    assert line.startswith(f"{image}: ") and line.count(", ") == 1
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(b"\0" * 64)
    from msdist.base.errors import CheckpointError
    from msdist.run import checkpoint_model
    with pytest.raises(CheckpointError, match="cannot read checkpoint"):  # a one-line error, exit 2 in the CLI
        checkpoint_model.read_meta(str(bad))


def _real_batch(data_dir, meta, n=8):
    from msdist.run import inference
    test_dir = os.path.join(data_dir, "Test")
    files = [os.path.join(test_dir, c, f) for c in CLASSES for f in sorted(os.listdir(os.path.join(test_dir, c)))[:2]]
    return np.stack([inference.preprocess(f, meta) for f in files[:n]])


def _checkpoint_logits(ckpt, images):
    import mindspore as ms
    from msdist.run import inference
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    net, meta = inference.load_network(ckpt)
    return net(ms.Tensor(images)).asnumpy(), net, meta


@pytest.mark.multiprocess
def test_export_mindir_gives_the_checkpoints_logits(trained_ckpt, data_dir, tmp_path):
    import mindspore as ms
    from mindspore import nn
    from msdist.run import checkpoint_model
    ckpt, _ = trained_ckpt
    proc = run_msdist("export", ["--ckpt", ckpt, "--format", "MINDIR", "--output", str(tmp_path / "model"),
                                 "--batch_size", "8"])
    path = tmp_path / "model.mindir"
    assert f"wrote {path}" in proc.stdout
    images = _real_batch(data_dir, checkpoint_model.read_meta(ckpt))
    expected, _, meta = _checkpoint_logits(ckpt, images)
    got = nn.GraphCell(ms.load(str(path)))(ms.Tensor(images)).asnumpy()
    assert got.shape == (8, len(CLASSES))
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)
    assert json.loads((tmp_path / "model.mindir.json").read_text())["classes"] == meta["classes"] == CLASSES


def test_export_onnx_on_cpu(trained_ckpt, data_dir, tmp_path):
    from msdist import export
    ckpt, _ = trained_ckpt
    from msdist.run import checkpoint_model
    images = _real_batch(data_dir, checkpoint_model.read_meta(ckpt), n=4)
    expected, net, meta = _checkpoint_logits(ckpt, images)
    path = export.export(net, meta, export.output_path(str(tmp_path / "model"), "ONNX"), "ONNX", batch_size=4)
    assert path.endswith(".onnx") and os.path.getsize(path) > 10_000
    import onnxruntime as ort  # the [test] extra installs it
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    got = session.run(None, {session.get_inputs()[0].name: images})[0]
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)


def _save(directory, epoch, accuracy=None):
    """One tiny checkpoint at `epoch`; with `accuracy`, offered as the best too."""
    import mindspore as ms
    from msdist.run import checkpoint
    params = [{"name": "w", "data": ms.Parameter(ms.Tensor(np.full((2, 3), epoch, np.float32)), name="w")}]
    state = {"epoch": epoch, "step": 5, "global_step": epoch * 5, "config_hash": "h"}
    checkpoint.save(params, directory, "m", 0, state)
    checkpoint.prune(directory, "m", 0, keep=1)
    if accuracy is not None:
        checkpoint.keep_best(params, directory, "m", 0, state, accuracy)


def test_best_checkpoint_survives_pruning_and_holds_the_best_epoch(tmp_path):
    from msdist.run import checkpoint
    directory = str(tmp_path)
    for epoch, accuracy in ((1, 0.5), (2, 0.8), (3, 0.6), (4, 0.8), (5, None)):
        _save(directory, epoch, accuracy)
    assert sorted(os.listdir(directory)) == ["m_rank0-5_5.ckpt", "m_rank0-5_5.ckpt.json",
                                             "m_rank0_best.ckpt", "m_rank0_best.ckpt.json"]
    best = checkpoint.read_best(directory, "m", 0)
    assert (best["epoch"], best["accuracy"]) == (2, 0.8)  # a tie later does not replace it
    path = checkpoint.best_path(directory, "m", 0)
    assert checkpoint.verify(path) is None and best["sha256"] == checkpoint.sha256_file(path)
    loaded = checkpoint.load(path, {"w": ((2, 3), "Float32")})
    assert (loaded["params"]["w"].asnumpy() == 2).all() and loaded["state"]["epoch"] == 2
    assert checkpoint.latest_good(directory, "m", 0).position.epoch == 5  # resume never picks the best file
    with open(path, "r+b") as f:  # a corrupt best is not trusted: the next evaluation replaces it
        f.write(b"\0" * 16)
    assert checkpoint.read_best(directory, "m", 0) is None


def test_best_right_after_a_save_at_the_same_position_is_that_checkpoint(tmp_path):
    """The usual end of an epoch (save, then evaluate at the same position): the best is a hard link to the
    numbered checkpoint, so the model is on disk once, decided by position without hashing the weights; a model
    evaluated at a position with no save of its own (trained on since) gets its own file."""
    import mindspore as ms
    from msdist.cluster.distributed import Collectives
    from msdist.run import checkpoint, checkpoint_model, checkpoint_saver
    from msdist.run.position import Position
    net = ms.nn.Dense(3, 2)
    moments = ms.Parameter(ms.Tensor(np.ones((2, 3), np.float32)), name="moments.weight")
    saver = checkpoint_saver.Saver(directory=str(tmp_path), prefix="m", rank=0, keep=2, config_hash="h", net=net,
                                   train_state=[moments], collectives=Collectives(1))
    at = Position(1, 4, 4)
    numbered = saver.save(at).path
    assert saver.keep_best(at, accuracy=0.5)
    best = checkpoint.best_path(str(tmp_path), "m", 0)
    assert os.path.samefile(best, numbered) and checkpoint.read_best(str(tmp_path), "m", 0)["accuracy"] == 0.5
    checkpoint_model.load_weights(best, net)   # evaluation reads the model part and ignores the training state
    assert saver.keep_best(at, accuracy=0.55)   # already that file: nothing left behind
    assert os.path.samefile(best, numbered) and not [f for f in os.listdir(tmp_path) if f.startswith(".")]
    net.weight.set_data(ms.Tensor(np.zeros((2, 3), np.float32)))   # trained on to the next epoch, not saved there
    assert saver.keep_best(Position(2, 4, 8), accuracy=0.6)
    assert not os.path.samefile(best, numbered) and checkpoint.read_best(str(tmp_path), "m", 0)["accuracy"] == 0.6
    tensors = checkpoint.read_tensors(best)
    assert set(tensors) == {"weight", "bias"} | {f"msdist_state.{k}" for k in checkpoint.STATE_KEYS}
    assert (tensors["weight"].asnumpy() == 0).all()   # the model as evaluated


def test_training_keeps_its_best_checkpoint(standalone_run):
    from msdist.run import checkpoint
    out, _ = standalone_run
    best = checkpoint.read_best(str(out / "ckpt"), "resnet_tiny", 0)
    result = json.loads((out / "result.json").read_text())
    assert (best["epoch"], best["accuracy"]) == (result["epochs"], result["accuracy"])
    assert best["meta"]["classes"] == CLASSES


# ---------------------------------------------------------------- --pretrained

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


def _write_pretrained(path, num_classes, rename=lambda n: n, seed=7):
    import mindspore as ms
    from models import create_model
    ms.set_seed(seed)
    net = create_model("resnet_tiny", num_classes)
    for param in net.get_parameters():  # give the BN statistics values a fresh model would not have
        if "moving_" in param.name:
            param.set_data(ms.Tensor(np.random.default_rng(seed).random(param.shape, dtype=np.float32) + 0.5))
    entries = [{"name": rename(p.name), "data": p} for p in net.get_parameters()]
    entries.append({"name": "moments.fc.weight", "data": ms.Tensor(np.zeros((1,), np.float32))})  # optimizer state
    ms.save_checkpoint(entries, str(path), append_dict={"learning_rate": 0.1})
    return {p.name: p.asnumpy().copy() for p in net.get_parameters()}


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
    # One grouped line for the console; every name only in the rank's log file.
    console = [r.getMessage() for r in caplog.records if getattr(r, "console", True)]
    assert console == [f"pretrained {path} (mindspore naming, mindspore padding): loaded {len(backbone)} backbone "
                       "tensors; head fresh (3 -> 4 classes); skipped 2 optimizer/state entries"]
    file_only = [r.getMessage() for r in caplog.records if not getattr(r, "console", True)]
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
    by_name = {p.name: (g["lr"].asnumpy(), g["weight_decay"]) for g in groups for p in g["params"]}
    np.testing.assert_allclose(by_name["conv.weight"][0], lrs * 0.1)
    np.testing.assert_allclose(by_name["fc.weight"][0], lrs)
    assert by_name["conv.weight"][1] == by_name["fc.weight"][1] == 1e-4 and by_name["fc.bias"][1] == 0.0
    assert len(optim.param_groups(params, 1e-4)) == 2  # scale 1: the plain two groups, no per-group lr


@pytest.fixture(scope="module")
def finetune_run(tmp_path_factory, data_dir):
    """A 3-step run from a 3-class "pretrained" resnet_tiny on the 4-class data, backbone frozen, with an EMA."""
    from conftest import tiny_args
    root = tmp_path_factory.mktemp("finetune")
    source = _write_pretrained(root / "weights.ckpt", num_classes=3)
    out = root / "run"
    proc = run_msdist("train", tiny_args(data_dir, out, "--max_steps", 3, "--log_every", 1, "--pretrained",
                                         root / "weights.ckpt", "--freeze_backbone", "true", "--ema_decay", 0.5))
    return out, proc, source


@pytest.mark.multiprocess
def test_frozen_backbone_does_not_move(finetune_run):
    from conftest import load_params
    out, proc, source = finetune_run
    assert "loaded 60 backbone tensors; head fresh (3 -> 4 classes); skipped 2 optimizer/state entries" in proc.stdout
    log = (out / "logs" / "rank_0.log").read_text()
    assert "skipped optimizer/state entries: learning_rate, moments.fc.weight" in log  # the full list: file only
    assert "moments.fc.weight" not in proc.stdout
    assert "freeze_backbone: 60 backbone parameters frozen" in proc.stdout
    trained = load_params(checkpoints(out, 0)[-1], include_state=True)
    for name, value in source.items():
        if not name.startswith("fc."):  # weights and BatchNorm statistics exactly as loaded
            np.testing.assert_array_equal(trained[name], value, err_msg=name)
    assert trained["fc.weight"].shape == (4, 64) and np.abs(trained["moments.fc.weight"]).max() > 0  # the head trains
    assert not [n for n in trained if n.startswith("moments.") and not n.startswith("moments.fc.")]


# ---------------------------------------------------------------- --ema_decay

def test_ema_update_swap_and_resume(tmp_path):
    import mindspore as ms
    from mindspore import nn
    from msdist.run import checkpoint_saver
    from msdist.cluster import distributed
    from msdist.engine import ema
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    net = nn.Dense(3, 2)
    start = {p.name: p.asnumpy().copy() for p in net.get_parameters()}
    averaged = ema.create(net, 0.75)
    assert ema.create(net, 0.0) is None
    for param in net.get_parameters():
        param.set_data(ms.Tensor(np.full(param.shape, 2.0, np.float32)))
    averaged()
    for weight, average in zip(net.get_parameters(), averaged.state_parameters()):
        assert average.name == "ema." + weight.name
        np.testing.assert_allclose(average.asnumpy(), 0.75 * start[weight.name] + 0.25 * 2.0, rtol=1e-6)
    expected = {a.name: a.asnumpy().copy() for a in averaged.state_parameters()}
    with averaged.swapped_into():  # evaluation sees the EMA, training gets its own weights back
        assert all(np.array_equal(w.asnumpy(), expected["ema." + w.name]) for w in net.get_parameters())
    assert all((w.asnumpy() == 2.0).all() for w in net.get_parameters())
    assert [e["name"] for e in averaged.as_model_checkpoint()] == [p.name for p in net.get_parameters()]

    # Saved with the resumable state, restored by the same resume that restores the weights.
    def saver(model, average):
        return checkpoint_saver.Saver(directory=str(tmp_path), prefix="m", rank=0, keep=2, config_hash="h", net=model,
                                train_state=average.state_parameters(), collectives=distributed.Collectives(1))
    info = saver(net, averaged).save(Position(1, 2, 2))
    other = nn.Dense(3, 2)  # the same parameter names as `net`
    fresh = ema.create(other, 0.75)
    assert saver(other, fresh).resume(info.path).position == Position(1, 2, 2)
    for average in fresh.state_parameters():
        np.testing.assert_array_equal(average.asnumpy(), expected[average.name])
