"""The train loop without per-step host syncs, and the CPU-only start-up skipped on GPU.

- The loss stays on the device between log steps (`step.LossAccumulator`); the log line's loss is
  the mean since the previous log step, and the epoch loss weights each window by its steps.
- The compute time of a log line is the window's wall time minus its data waits (`Meter.take_window`),
  measured across the blocking loss read, so launches that return early cannot make it look fast.
"""
import time

import numpy as np

from msdist.run import meter, progress
from msdist.run.position import Position


def test_loss_accumulator_reads_the_mean_since_the_last_read():
    """The train step adds its loss to a device total inside its own graph; the host reads the window's mean."""
    import mindspore as ms
    from mindspore import nn
    from msdist.engine import loss_scale, optim, precision, step

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    net = step.build_network("convnet_tiny", 4, False, False, 1)
    optimizer = optim.create_optimizer(net.trainable_params(), np.full(8, 0.01, np.float32), 0.9, 0.0)
    train = step.TrainStep(net, nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean"), optimizer,
                           loss_scale.LossScaler(precision.LossScalePlan(False, 1.0, checked=False), 1))
    rng = np.random.default_rng(0)
    labels = ms.Tensor(np.array([0, 1, 2, 3], np.int32))
    seen = [train.train_on(ms.Tensor(rng.random((4, 3, 32, 32), dtype=np.float32)), labels) for _ in range(3)]
    total = seen[0] + seen[1] + seen[2]  # float32 sums in the same order as the device total
    assert train.losses.read() == float(total.asnumpy()) / 3
    last = train.train_on(ms.Tensor(rng.random((4, 3, 32, 32), dtype=np.float32)), labels)
    assert train.losses.read() == float(last.asnumpy())


def test_epoch_loss_weights_each_window_by_its_steps():
    shown = progress.Progress(epochs=1, steps_per_epoch=4, log_every=3, meter=meter.Meter(images_per_step=8))
    shown.start_epoch(Position())
    for step, loss in ((1, None), (2, None), (3, 2.0), (4, 6.0)):  # read at step 3 (log) and 4 (epoch end)
        shown.step(Position(1, step, step), loss, 0.1, 0.01, 0.0)
    assert shown.epoch_loss() == (3 * 2.0 + 6.0) / 4


def test_window_compute_time_includes_the_blocking_read():
    timer = meter.Meter(images_per_step=8)
    for _ in range(3):
        timer.data_ready()
        timer.step_done()  # launches return at once
    timer.data_ready()
    time.sleep(0.2)  # the blocking read at the log step waits for the queued steps
    timer.step_done()
    compute, data = timer.take_window()
    assert compute >= 0.2 / 4 and data < 0.05
    assert timer.take_window() == (0.0, 0.0)


def test_gpu_config_is_the_8_gpu_recipe():
    import os
    from conftest import REPO
    from msdist.run import config

    cfg = config.parse(["--config", os.path.join(REPO, "configs", "resnet50_fruits360_gpu.yaml")])
    assert 64 <= cfg.batch_size // 8 <= 128 and cfg.batch_size % 8 == 0  # per GPU on 8 GPUs
    # a fixed global batch, so a fixed LR (0.1 per 256 images) on 1, 4 or 8 GPUs; BatchNorm sees 1024 / N per GPU
    assert not cfg.scale_lr and cfg.lr == 0.1 * cfg.batch_size / 256
    assert cfg.warmup_epochs > 0 and cfg.amp_level == "auto" and cfg.loss_scale == "auto"
    assert config.fusion_split(cfg.allreduce_fusion) is None  # auto: byte buckets in network order


def test_allreduce_fusion_is_validated(monkeypatch):
    import pytest
    from msdist.run import config
    from msdist.engine import step
    from msdist.base.errors import ConfigError

    for bad in ("160,85", "a,b", "0,3"):
        with pytest.raises(ConfigError, match="strictly increasing parameter indices"):
            config.parse(["--allreduce_fusion", bad])
    assert config.parse([]).allreduce_fusion == "auto" and config.fusion_split("auto") is None
    net = step.build_network("resnet18", 10, False, False, 1)
    with pytest.raises(ConfigError, match="it has 62"):  # e.g. [85, 160] on a ResNet-18
        step.bucket_gradients(net, [85, 160], world_size=2)
    import mindspore as ms
    try:
        plan = step.bucket_gradients(net, None, world_size=2)
        # Each parameter carries its bucket's number in send order: MindSpore's reducer fuses equal numbers.
        assert [p.comm_fusion for p in net.trainable_params()] == [2] * 49 + [1] * 13 and len(plan) == 2
        # One 256 KB unit (MindSpore's) above the largest bucket, 24.1 MB = 96.4 units: no bucket is cut again
        assert ms.get_auto_parallel_context("comm_fusion")["allreduce"]["config"] == 98
    finally:
        ms.reset_auto_parallel_context()


# ---------------------------------------------------------------- GPU runs skip the CPU-only set-up

def test_gpu_runs_never_probe_the_cpu_isa(monkeypatch):
    from msdist.rank import isa_probe, runtime

    assert not runtime.needs_cpu_isa("GPU") and runtime.needs_cpu_isa("CPU") and runtime.needs_cpu_isa("auto")
    for name in ("GLOG_v", "GLOG_minloglevel", "OMP_NUM_THREADS"):  # prepare() sets them: restore afterwards
        monkeypatch.setenv(name, "")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)

    def no_probe(*_args):
        raise AssertionError("the oneDNN ISA was probed for a GPU run")
    monkeypatch.setattr(isa_probe, "best_isa", no_probe)
    rt = runtime.prepare(cpu_isa="auto", device_target="GPU")
    assert (rt.cpu_isa, rt.isa_source) == ("default", "not used on GPU")
    assert "ONEDNN_MAX_CPU_ISA" not in __import__("os").environ


def test_compile_cache_key_uses_the_resolved_device_and_amp_level(tmp_path, data_dir):
    """A run directory started on CPU and resumed on GPU must not load the CPU graph: the key holds the device
    `auto` resolved to, and the amp level `auto` resolved to there (O0 on CPU, O2 on GPU)."""
    from msdist.rank import runtime
    from msdist.run import config, startup

    def key(argv, target):
        return startup.compile_cache_path(config.parse(["--data_dir", data_dir, "--output_dir", str(tmp_path), *argv]), 2,
                                          target, 2)
    assert key([], "CPU") == key(["--device_target", "CPU"], "CPU")  # what was asked does not matter
    assert key([], "CPU") != key([], "GPU")
    assert runtime.compile_cache_dir(str(tmp_path), "cfg", 2, 4, "GPU", "O2") != \
        runtime.compile_cache_dir(str(tmp_path), "cfg", 2, 4, "GPU", "O0")
    # Two ranks running a 4-slot job's batch (resumed after a shrink) compile another step than 2 slots' do.
    assert runtime.compile_cache_dir(str(tmp_path), "cfg", 2, 4, "CPU", "O0", batch_slots=4) != \
        runtime.compile_cache_dir(str(tmp_path), "cfg", 2, 4, "CPU", "O0", batch_slots=2)
