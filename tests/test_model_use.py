"""Using a trained model: predict from the checkpoint alone, export, best checkpoint, pretrained weights, EMA."""
import json
import os
import shutil

import numpy as np
import pytest

from conftest import checkpoints, run_msdist

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


def test_predict_text_output_and_bad_checkpoint(trained_ckpt, data_dir, tmp_path):
    ckpt, _ = trained_ckpt
    image = os.path.join(data_dir, "Test", "lemon", sorted(os.listdir(os.path.join(data_dir, "Test", "lemon")))[0])
    proc = run_msdist("predict", ["--ckpt", ckpt, image, "--topk", "2"])
    [line] = proc.stdout.splitlines()
    assert line.startswith(f"{image}: ") and line.count(", ") == 1
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(b"\0" * 64)
    proc = run_msdist("predict", ["--ckpt", str(bad), image], check=False)
    assert proc.returncode == 2 and proc.stderr.startswith("msdist: error: ") and "Traceback" not in proc.stderr


def _real_batch(data_dir, meta, n=8):
    from msdist import inference
    test_dir = os.path.join(data_dir, "Test")
    files = [os.path.join(test_dir, c, f) for c in CLASSES for f in sorted(os.listdir(os.path.join(test_dir, c)))[:2]]
    return np.stack([inference.preprocess(f, meta) for f in files[:n]])


def _checkpoint_logits(ckpt, images):
    import mindspore as ms
    from msdist import inference
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    net, meta = inference.load_network(ckpt)
    return net(ms.Tensor(images)).asnumpy(), net, meta


def test_export_mindir_gives_the_checkpoints_logits(trained_ckpt, data_dir, tmp_path):
    import mindspore as ms
    from mindspore import nn
    from msdist import checkpoint
    ckpt, _ = trained_ckpt
    proc = run_msdist("export", ["--ckpt", ckpt, "--format", "MINDIR", "--output", str(tmp_path / "model"),
                                 "--batch_size", "8"])
    path = tmp_path / "model.mindir"
    assert f"wrote {path}" in proc.stdout
    images = _real_batch(data_dir, checkpoint.read_meta(ckpt))
    expected, _, meta = _checkpoint_logits(ckpt, images)
    got = nn.GraphCell(ms.load(str(path)))(ms.Tensor(images)).asnumpy()
    assert got.shape == (8, len(CLASSES))
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)
    assert json.loads((tmp_path / "model.mindir.json").read_text())["classes"] == meta["classes"] == CLASSES


def test_export_onnx_on_cpu(trained_ckpt, data_dir, tmp_path):
    from msdist import export
    ckpt, _ = trained_ckpt
    from msdist import checkpoint
    images = _real_batch(data_dir, checkpoint.read_meta(ckpt), n=4)
    expected, net, meta = _checkpoint_logits(ckpt, images)
    path = export.export(net, meta, export.output_path(str(tmp_path / "model"), "ONNX"), "ONNX", batch_size=4)
    assert path.endswith(".onnx") and os.path.getsize(path) > 10_000
    ort = pytest.importorskip("onnxruntime")  # not a dependency: the numbers are checked where it is installed
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    got = session.run(None, {session.get_inputs()[0].name: images})[0]
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-4)


def _save(directory, epoch, accuracy=None):
    """One tiny checkpoint at `epoch`; with `accuracy`, offered as the best too."""
    import mindspore as ms
    from msdist import checkpoint
    params = [{"name": "w", "data": ms.Parameter(ms.Tensor(np.full((2, 3), epoch, np.float32)), name="w")}]
    state = {"epoch": epoch, "step": 5, "global_step": epoch * 5, "config_hash": "h"}
    checkpoint.save(params, directory, "m", 0, state)
    checkpoint.prune(directory, "m", 0, keep=1)
    if accuracy is not None:
        checkpoint.keep_best(params, directory, "m", 0, state, accuracy)


def test_best_checkpoint_survives_pruning_and_holds_the_best_epoch(tmp_path):
    from msdist import checkpoint
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
    assert checkpoint.latest_good(directory, "m", 0).epoch == 5  # resume never picks the best file
    with open(path, "r+b") as f:  # a corrupt best is not trusted: the next evaluation replaces it
        f.write(b"\0" * 16)
    assert checkpoint.read_best(directory, "m", 0) is None


def test_training_keeps_its_best_checkpoint(standalone_run):
    from msdist import checkpoint
    out, _ = standalone_run
    best = checkpoint.read_best(str(out / "ckpt"), "resnet_tiny", 0)
    result = json.loads((out / "result.json").read_text())
    assert (best["epoch"], best["accuracy"]) == (1, result["accuracy"]) and best["meta"]["classes"] == CLASSES
