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
