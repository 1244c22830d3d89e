"""run/flops.py, run/peak.py: training FLOPs per image counted from the network's layers, against torchvision's
published figures, the step line's TFLOP/s, and the device's peak (GPU table, CPU benchmark cached per host)."""
import json
import os

import pytest

from models import create_model
from msdist.run import flops, hardware, peak

# torchvision's model docs, "GFLOPS" at 224 px: forward multiply-adds (ResNet18_Weights / ResNet50_Weights meta).
TORCHVISION_GFLOPS = {"resnet18": 1.81, "resnet50": 4.09}


@pytest.fixture(scope="module")
def nets():
    return {name: create_model(name, 1000) for name in TORCHVISION_GFLOPS}


@pytest.mark.parametrize("name", sorted(TORCHVISION_GFLOPS))
def test_the_count_matches_torchvisions_published_gflops_within_two_percent(name, nets):
    net = nets[name]
    macs = flops.forward_multiply_adds(net, 224)
    assert macs / 1e9 == pytest.approx(TORCHVISION_GFLOPS[name], rel=0.02)
    # The convention: a multiply-add is 2 FLOPs, training is 3 forward passes.
    assert flops.training_flops_per_image(net, 224) == 6 * macs


def test_the_count_follows_the_run_image_size(nets):
    """Each stride rounds the feature map up, so 113 px costs far more than 112 px: a count carried from 224 px
    by area would not say so."""
    net = nets["resnet18"]
    assert flops.forward_multiply_adds(net, 113) > 1.05 * flops.forward_multiply_adds(net, 112) * (113 / 112) ** 2


@pytest.mark.slow
@pytest.mark.parametrize("name,size,convention", [("resnet18", 99, "torch"), ("resnet50", 65, "mindspore"),
                                                  ("resnet_tiny", 37, "mindspore")])
def test_the_walk_counts_what_a_forward_pass_runs(name, size, convention):
    """Against one real forward pass with a hook on every Conv2d and Dense (PyNative, seconds)."""
    from msdist.run.network_cost import layer_multiply_adds
    net = create_model(name, 10, convention=convention)
    assert flops.forward_multiply_adds(net, size) == sum(layer_multiply_adds(net, size).values())


def test_the_rate_per_device_per_job_and_against_the_peak():
    rate = flops.FlopRate(flops_per_image=6e9, world_size=4, device_peak=1e12)
    assert rate.job(1000) == 6e12 and rate.per_device(1000) == 1.5e12 and rate.utilisation(100) == 0.15
    assert rate.step_line(100) == "0.15 TFLOP/s/device, 0.6 job, 15.0% of peak"
    assert rate.fields(100) == {"train_gflops_per_image": 6.0, "tflops_per_device": 0.15, "tflops_job": 0.6,
                                "device_peak_tflops": 1.0, "flops_utilisation": 0.15}
    unknown = flops.FlopRate(6e9, 1)
    assert unknown.step_line(100) == "0.6 TFLOP/s/device, 0.6 job"
    assert "flops_utilisation" not in unknown.fields(100)


def test_a_gpus_peak_comes_from_its_product_name_and_precision():
    assert hardware.gpu_peak_flops("Tesla V100-SXM2-16GB", "amp") == 125e12
    assert hardware.gpu_peak_flops("NVIDIA A100-SXM4-80GB", "fp32") == 156e12
    assert hardware.gpu_peak_flops("NVIDIA GeForce RTX 3090", "fp32") is None
    assert hardware.gpu_peak_flops("Tesla K80", "amp") is None   # no float16 row: no peak, no guess
    assert peak.gpu_model_name("Model: \t\t Tesla V100-SXM2-16GB\nIRQ:   33\n") == "Tesla V100-SXM2-16GB"
    assert peak.gpu_model_name("IRQ: 33\n") == ""


def test_the_cpu_peak_is_measured_once_per_host_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = peak.cpu_core_peak()   # a real matrix-product benchmark in a child process
    assert 1e8 < first < 1e12
    with open(peak.cache_path(), encoding="utf-8") as f:
        cached = json.load(f)
    assert list(cached.values()) == [first]
    key = next(iter(cached))
    with open(peak.cache_path(), "w", encoding="utf-8") as f:   # a second call reads the file, measures nothing
        json.dump({key: 123e9}, f)
    assert peak.cpu_core_peak() == 123e9
    assert peak.device_peak("CPU", "O0", threads_per_rank=2) == 246e9
    assert not os.path.exists(peak.cache_path() + ".tmp")


def test_a_cache_that_cannot_be_written_still_gives_a_measured_peak(tmp_path, monkeypatch):
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))   # ~/.cache/msdist cannot be made under a file
    assert 1e8 < peak.cpu_core_peak() < 1e12
