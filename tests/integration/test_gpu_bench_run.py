"""`scripts/gpu_check.sh` (msdist.check --gpu_bench) on this CPU host: four real runs through msdist.launch, the
report printed and written, and the same weights at one step per call and at the default."""
import json
import os
import subprocess

import pytest

from conftest import REPO, TINY_CONFIG, base_env


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_acceptance_run_trains_every_arm_on_cpu_and_says_so(tmp_path, data_dir):
    out = tmp_path / "bench"
    proc = subprocess.run(["bash", os.path.join(REPO, "scripts", "gpu_check.sh"), "--data_dir", str(data_dir),
                           "--output_dir", str(out), "--steps", "6", "--config", TINY_CONFIG, "--log_every", "2"],
                          cwd=REPO, env=base_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads((out / "gpu_bench.json").read_text())
    assert report["device_target"] == "CPU" and report["steps"] == 6
    assert sorted(report["arms"]) == ["1dev_k1", "1dev_kauto", "2dev_k1", "2dev_kauto"]
    assert all(arm["images_per_sec"] > 0 for arm in report["arms"].values())
    # CPU has no data sink: K=auto is one step per call there, so the weights are the same bit for bit.
    assert {ranks: figures["max_weight_difference"] for ranks, figures in report["per_device_count"].items()} == \
        {"1": 0.0, "2": 0.0}
    assert [figures["host_share"] for figures in report["per_device_count"].values()] == [None, None]
    assert report["overlap"]["overlapped"] is None and report["overlap"]["why"].startswith("could not tell: a CPU run")
    lines = proc.stdout.splitlines()
    assert any(line.startswith("gpu_bench on CPU (no usable GPU here") for line in lines), proc.stdout
    assert f"  written to {out / 'gpu_bench.json'}" in lines
