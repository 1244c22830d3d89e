"""The small tools around training: demo data, the environment check, the launch scripts."""
import os
import subprocess

import numpy as np
import pytest
from PIL import Image

from conftest import REPO, base_env, run_msdist


@pytest.mark.multiprocess
def test_synth_writes_an_imagefolder_tree(tmp_path):
    proc = run_msdist("data", ["synth", str(tmp_path), "--classes", "3", "--per_class", "8"])
    assert "wrote 24 training and 6 test images in 3 classes" in proc.stdout
    for split, per_class in (("Training", 8), ("Test", 2)):
        classes = sorted(os.listdir(tmp_path / split))
        assert classes == ["fruit_00", "fruit_01", "fruit_02"]
        for name in classes:
            files = sorted(os.listdir(tmp_path / split / name))
            assert len(files) == per_class and all(f.endswith(".jpg") for f in files)
    image = np.asarray(Image.open(tmp_path / "Training" / "fruit_00" / "0000.jpg"))
    assert image.shape == (100, 100, 3) and image.std() > 10  # a real picture, not a blank


@pytest.mark.multiprocess
def test_check_all_gathers_ranks_under_mpirun():
    proc = run_msdist("check", [], ranks=2, timeout=180)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("rank ")]
    assert len(lines) == 2
    for line in lines:
        assert "all_gather(rank) -> [0, 1] [ok]" in line
        assert "device CPU" in line and "backend mccl" in line and "mindspore 2." in line


@pytest.mark.multiprocess
def test_scripts_name_the_install_when_mpirun_is_missing():
    env = dict(base_env(), MPIRUN="/nonexistent/mpirun")
    for script in ("run_distribute_train.sh", "run_distribute_train_2p.sh"):
        proc = subprocess.run(["bash", os.path.join(REPO, "scripts", script), *(["2"] if "_2p" not in script else []),
                               "--config", "configs/tiny_test.yaml"], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=30)
        assert proc.returncode == 127, script
        assert "apt-get install -y openmpi-bin" in proc.stderr and "LAUNCHER=msdist" in proc.stderr
