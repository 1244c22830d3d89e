"""Using a trained model as real processes: predict from the checkpoint alone, export (MindIR, ONNX), the best
checkpoint of a run, a frozen backbone."""
import json
import os
import shutil

import numpy as np
import pytest

from conftest import _write_pretrained, checkpoints, run_msdist


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


def test_training_keeps_its_best_checkpoint(standalone_run):
    from msdist.run.best_checkpoint import Best
    out, _ = standalone_run
    best = Best(str(out / "ckpt"), "resnet_tiny", 0).read()
    result = json.loads((out / "result.json").read_text())
    assert (best["epoch"], best["accuracy"]) == (result["epochs"], result["accuracy"])
    assert best["meta"]["classes"] == CLASSES


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
