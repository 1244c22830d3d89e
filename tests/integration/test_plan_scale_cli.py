"""`python -m msdist.plan_scale` (#35, #40): the refusals, the --json document, what the text says about overlap and
the H100's first start. No timing: the published and local comparisons live in
benchmarks/scaling_validation.py (docs/scaling.md)."""
import json
import os

import pytest

from conftest import REPO, run_msdist
from msdist.run import forecast


R18_CONFIG = os.path.join(REPO, "configs", "resnet18_fruits360.yaml")


@pytest.mark.parametrize("args, named", [
    (["--model", "resnet34", "--gpu", "A100"], "--step_ms"),
    (["--gpu", "T4"], "--step_ms"),
    ([], "--step_ms"),
    (["--gpu", "K80", "--amp_level", "O2"], "--step_ms"),
    (["--gpu", "A100", "--network", "ib800"], "ib400"),
    (["--model", "resnet99", "--step_ms", "100"], "resnet50"),
])
def test_what_the_tables_do_not_hold_is_refused_in_one_line(args, named):
    proc = run_msdist("plan_scale", ["--config", R18_CONFIG, *args], check=False, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and named in lines[0], proc.stderr


def test_json_holds_every_row_of_every_exchange():
    proc = run_msdist("plan_scale", ["--config", R18_CONFIG, "--gpu", "A100", "--per_gpu_batch", "64", "--json"])
    report = json.loads(proc.stdout)
    assert report["scaling"] == "weak" and report["batch"] == {"per_gpu": 64}
    assert set(report["forecasts"]) == {"none", "fp16", "topk"}
    for table in report["forecasts"].values():
        assert [r["gpus"] for r in table["rows"]] == list(forecast.SCALES)
        assert set(table["rows"][0]) == {"gpus", "nodes", "per_gpu_batch", "compute_ms", "exposed_ms", "host_ms",
                                         "step_ms", "images_per_sec", "efficiency", "input_cores_per_gpu",
                                         "overlapped", "dominated"}
        assert all(r["overlapped"] for r in table["rows"])
    assert report["gradients"]["buckets"][-1]["first"] == "stem.0.weight"
    assert [b["last"] for b in report["gradients"]["buckets"]] == ["fc.bias", "stages.3.0.conv2.weight"]
    assert report["first_start"] == ""
    text = run_msdist("plan_scale", ["--config", R18_CONFIG, "--gpu", "A100"]).stdout
    assert "strong scaling: global batch 32 kept" in text and "communication" in text
    assert "2 bucket(s) in send order" in text and "one AllReduce op each" in text
    assert "sink mode" in text and "first start" not in text


def test_h100_states_the_first_start_and_elastic_accumulation_and_sync_bn_have_no_overlap():
    proc = run_msdist("plan_scale", ["--config", R18_CONFIG, "--gpu", "H100", "--per_gpu_batch", "64", "--max_nodes",
                                     "2", "--json"])
    report = json.loads(proc.stdout)
    assert "sm_80" in report["first_start"] and "sm_90" in report["first_start"]
    rows = report["forecasts"]["none"]["rows"]
    assert [r["overlapped"] for r in rows if r["gpus"] <= 32] == [False, False, False, False, True, True]
    text = run_msdist("plan_scale", ["--config", R18_CONFIG, "--gpu", "A100", "--grad_accum_steps", "2",
                                     "--sync_bn", "true"]).stdout
    assert "none with grad_accum_steps 2" in text and "none with sync_bn" in text
