"""Shared fixtures and helpers of tests/unit and tests/integration (pytest.ini puts tests/ on sys.path): the real
data, running msdist entry points as real processes, and the small files several test modules write or read."""
import glob
import json
import logging
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

from models import add_family
from msdist.run import checkpoint_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Real Fruits-360 images shipped inside the repository (tests/data/fruits360-mini/README.md): the suite
# never reads outside the checkout.
REAL_DATA = os.path.join(REPO, "tests", "data", "fruits360-mini")
TINY_CONFIG = os.path.join(REPO, "configs", "tiny_test.yaml")
# OpenMPI refuses root (CI runs as root) without these; --oversubscribe allows more ranks than cores.
TRAIN_WITH_TEST_MODELS = os.path.join(REPO, "tests", "train_with_test_models.py")
add_family("convnet")  # tests/convnet.py, BatchNorm-free; tests/ is on sys.path
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
TEST_SIZE = 64  # tests/data/fruits360-mini
OLD = os.path.join(REPO, "tests", "data", "old_checkpoint")
OLD_SINGLE = os.path.join(OLD, "single", "resnet_tiny_rank0-2_6.ckpt")
# The options the old checkpoints were written with (tests/data/old_checkpoint/README.md).
OLD_OPTIONS = ("--epochs", 2, "--deterministic", "true", "--log_every", 1, "--loss_scale", "dynamic",
               "--ema_decay", 0.9)


INTEGRATION = os.path.join(REPO, "tests", "integration")


def _dispatch_onednn_as_a_rank_does():
    """This process's oneDNN kernels are the ones msdist's ranks run (runtime.choose_cpu_isa: the environment, else
    the probed and cached best ISA): on some CPUs oneDNN's default is a reference kernel, ~6x slower and rounding
    otherwise (AMD EPYC here, msdist/rank/isa_probe.py), which every test training or comparing in this process
    would run. oneDNN reads the variable at its first primitive; putenv leaves os.environ, from which the tests
    build the environments of the processes they start, as it was: those choose for themselves."""
    from msdist.rank import runtime
    isa, _ = runtime.choose_cpu_isa("auto")
    if isa:
        os.putenv("ONEDNN_MAX_CPU_ISA", isa)


_dispatch_onednn_as_a_rank_does()


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: the marker must be there when it looks
def pytest_collection_modifyitems(items):
    """Every test in tests/integration starts real processes (msdist faces, mpirun, msdist.launch, msrun,
    namespaces), so it is `slow` by where it lives and stays out of the fast subset (docs/testing.md)."""
    for item in items:
        if str(item.path).startswith(INTEGRATION + os.sep):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _msdist_logging_restored():
    """logs.setup_logging configures msdist's loggers for the process: give later tests (caplog) theirs back."""
    loggers = [logging.getLogger(name) for name in ("msdist", "msdist.crash")]
    saved = [(lg.handlers[:], lg.level, lg.propagate) for lg in loggers]
    yield
    for lg, (handlers, level, propagate) in zip(loggers, saved):
        lg.handlers, lg.level, lg.propagate = handlers, level, propagate


@pytest.fixture(scope="session")
def data_dir():
    assert os.path.isdir(REAL_DATA), f"real test data missing at {REAL_DATA}"
    return REAL_DATA


@pytest.fixture(scope="session")
def torchvision():
    """(torch, torchvision): the references the weights tests compare msdist with; they skip without them."""
    torch = pytest.importorskip("torch", reason="torch is not installed: pip install -e '.[reference]'")
    # torchvision's PyPI wheel links libtorch_cuda; next to the CPU torch, registering the fake kernels of its C
    # ops (nms, ...) fails at import. Its models never call those ops, so the registration is skipped meanwhile.
    register_fake = torch.library.register_fake
    torch.library.register_fake = lambda *args, **kwargs: (lambda fn: fn)
    try:
        tv = pytest.importorskip("torchvision", reason="torchvision is not installed: pip install -e '.[reference]'")
    finally:
        torch.library.register_fake = register_fake
    return torch, tv


def base_env() -> dict:
    env = dict(os.environ, **MPI_ENV)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return env


def mpirun(n: int) -> list:
    return ["mpirun", "-n", str(n), "--oversubscribe"]


def processes_below(root: int) -> list:
    """`root` and every live process under it: what Slurm signals on a preemption or scancel (a whole step)."""
    parents = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                parents[int(entry)] = int(f.read().rsplit(b")", 1)[1].split()[1])
        except OSError:
            pass
    found, frontier = {root}, {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return sorted(found)


def run_msdist(module: str, args: list, ranks: int = 1, timeout: int = 300, check: bool = True,
               env: dict = None) -> subprocess.CompletedProcess:
    """Run `python -m msdist.<module> args`, under `mpirun -n ranks` when ranks > 1.

    module "train_with_test_models" is msdist.train with the test-only models known too.
    """
    entry = [TRAIN_WITH_TEST_MODELS] if module == "train_with_test_models" else ["-m", f"msdist.{module}"]
    cmd = (mpirun(ranks) if ranks > 1 else []) + [sys.executable, *entry] + list(args)
    proc = subprocess.run(cmd, cwd=REPO, env={**base_env(), **(env or {})}, capture_output=True, text=True,
                          timeout=timeout, check=False)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\n"
                             f"stderr:\n{proc.stderr[-3000:]}")
    return proc


def msrun(tmp_path, train_args: list) -> tuple:
    """(command, env) for MindSpore's msrun starting 2 local workers of `python -m msdist.train train_args`;
    the calling test is skipped where msrun is not on PATH."""
    if shutil.which("msrun") is None:
        pytest.skip("msrun (MindSpore's launcher) is not on PATH")
    from msdist.cluster import rendezvous
    env = base_env()
    # msrun runs a binary only when it is named python, python3 or pytest: this interpreter comes first on PATH
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    cmd = ["msrun", "--worker_num", "2", "--local_worker_num", "2", "--master_port", str(rendezvous.free_port()),
           "--join", "True", "--log_dir", str(tmp_path / "msrun_logs"), "python3", "-m", "msdist.train",
           *map(str, train_args)]
    return cmd, env


def tiny_args(data_dir: str, output_dir, *extra) -> list:
    return ["--config", TINY_CONFIG, "--data_dir", str(data_dir), "--output_dir", str(output_dir), *map(str, extra)]


def plan_on(cfg, world_size: int, target: str, environ=None):
    """The run plan start-up resolves from `cfg` on `world_size` ranks of `target` (CPU or GPU) devices."""
    from msdist.rank import device
    from msdist.run import run_plan
    chosen = device.DevicePlan(target, target, "test", 0 if target == "GPU" else None)
    return run_plan.resolve(cfg, world_size, chosen, {} if environ is None else environ)


def load_params(path: str, include_state: bool = False) -> dict:
    """Model parameters of a checkpoint as float64 arrays (optimizer state left out unless asked)."""
    import mindspore as ms
    raw = ms.load_checkpoint(path)
    out = {}
    for name, value in raw.items():
        if not hasattr(value, "asnumpy"):
            continue
        if not include_state and checkpoint_model.is_training_state(name):
            continue
        out[name] = value.asnumpy().astype(np.float64)
    return out


def worst_relative_gap(a: dict, b: dict) -> float:
    """The largest difference between two parameter sets, each tensor's relative to its own max |value|."""
    assert a.keys() == b.keys()
    return max(np.abs(a[n] - b[n]).max() / max(np.abs(a[n]).max(), np.finfo(np.float32).tiny) for n in a)


@pytest.fixture(scope="session")
def standalone_run(tmp_path_factory, data_dir):
    """(output_dir, process) of one short single-card run; shared by integration/test_train.py and test_model_use.py."""
    out = tmp_path_factory.mktemp("standalone")
    # 60 steps (5 epochs of the 192-image set): 12 steps learn or not depending on the seed's draws.
    proc = run_msdist("train", tiny_args(data_dir, out, "--epochs", 5, "--max_steps", 60, "--save_every_epochs", 5))
    return out, proc


def checkpoints(output_dir, rank: int) -> list:
    folder = os.path.join(str(output_dir), "ckpt")
    return sorted(os.path.join(folder, f) for f in os.listdir(folder)
                  if f.endswith(".ckpt") and f"_rank{rank}-" in f and not f.startswith("."))


def pad_crop_flip(image: np.ndarray, params: np.ndarray, padding: int) -> np.ndarray:
    """The plain definition of msdist's training crop, per HWC image: random crop at the training resolution
    from the zero-padded image, then optional mirror. `augment.pad_crop_flip_batch` must equal it."""
    h, w = image.shape[:2]
    dy, dx, flip = (int(v) for v in params)
    if padding:
        image = np.pad(image, ((padding, padding), (padding, padding), (0, 0)))[dy:dy + h, dx:dx + w]
    return np.ascontiguousarray(image[:, ::-1] if flip else image)


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


def _records(run_dir, kind):
    from msdist.run import metrics
    with open(os.path.join(run_dir, metrics.METRICS_FILE), encoding="utf-8") as f:
        return [r for r in map(json.loads, f) if r["kind"] == kind]


def _write_beat(log_dir, rank, **fields):
    from msdist.cluster import heartbeat
    beat = {"time": time.time(), "pid": 100 + rank, "rank": rank, "host": "a", "epoch": 4, "step": 1,
            "global_step": 37, "phase": "train step", "phase_s": 1.0, "limit_s": 60.0, "median_step_s": 0.5}
    beat.update(fields)
    with open(heartbeat.path_for(str(log_dir), rank), "w") as f:
        json.dump(beat, f)


def fake_gpu_node(root, gpus: int, cuda: bool = True) -> str:
    """A GPU node's files under `root`, for `--host_root`: /dev/nvidia0..N-1, NVIDIA's driver under /proc, and
    (`cuda`) the CUDA-stack libraries the installed wheel's newest GPU plugin needs, where a CUDA 11 install puts
    them (/usr/local/cuda/lib64; the driver's libcuda.so.1 in the system library folder). Empty files: --plan
    looks libraries up, it does not load them."""
    from msdist.rank import device
    (root / "dev").mkdir(parents=True, exist_ok=True)
    for index in range(gpus):
        (root / "dev" / f"nvidia{index}").touch()
    (root / "dev" / "nvidiactl").touch()
    (root / "proc" / "driver" / "nvidia").mkdir(parents=True, exist_ok=True)
    (root / "proc" / "driver" / "nvidia" / "version").write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module\n")
    if cuda:
        for name in cuda_libraries(device.wheel_plugin_dir()):
            folder = root / ("usr/lib/x86_64-linux-gnu" if name.startswith("libcuda.so") else "usr/local/cuda/lib64")
            folder.mkdir(parents=True, exist_ok=True)
            (folder / name).touch()
    return str(root)


def cuda_libraries(plugin_dir: str) -> list:
    """The CUDA-stack libraries the wheel's newest GPU plugin and its NCCL collective need (from their ELF headers)."""
    from msdist.rank import gpu_plugin
    plugin = sorted(glob.glob(os.path.join(plugin_dir, "libmindspore_gpu.so.*")))[-1]
    version = ".".join(map(str, gpu_plugin.plugin_version(plugin)))
    needed = gpu_plugin.elf_dynamic(plugin)[0] + gpu_plugin.elf_dynamic(
        os.path.join(plugin_dir, f"gpu{version}", "libnvidia_collective.so"))[0]
    return [name for name in needed if gpu_plugin.is_cuda_stack(name)]
