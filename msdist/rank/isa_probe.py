"""Find the fastest oneDNN ISA cap for this CPU, once, and remember it.

oneDNN picks its kernels when it loads, from the CPU's flags. On some CPUs
(e.g. AMD Zen 4 with MindSpore 2.10) the default choice routes strided and
3x3/7x7 convolutions through a reference kernel that is ~30x slower than the
AVX2 JIT kernels. Which cap is fastest can only be measured, and only in a
fresh process per candidate, because the variable is read at library load.
The verdict is cached per CPU model and MindSpore version.
"""
import fcntl
import json
import logging
import os
import platform
import subprocess
import sys
import time

from msdist.base.files import atomic_write_text

_logger = logging.getLogger(__name__)

_PROBE_TIMEOUT_S = 120


def cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "msdist")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> set:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def candidates(flags: set) -> list:
    """ISA caps worth timing on a CPU with these flags; "" is oneDNN's own default."""
    found = [""]
    if "avx512f" in flags:
        found.append("AVX512_CORE")
    if "avx2" in flags:
        found.append("AVX2")
    return found


def _mindspore_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("mindspore")
    except PackageNotFoundError:
        return "none"


def _time_candidate(isa: str) -> float:
    env = dict(os.environ, GLOG_v="3", OMP_NUM_THREADS="1")
    env.pop("ONEDNN_MAX_CPU_ISA", None)
    if isa:
        env["ONEDNN_MAX_CPU_ISA"] = isa
    try:
        out = subprocess.run([sys.executable, "-m", "msdist.rank.isa_probe"], env=env, capture_output=True, text=True,
                             timeout=_PROBE_TIMEOUT_S, check=False).stdout
    except subprocess.TimeoutExpired:
        return float("inf")
    for line in out.splitlines():
        if line.startswith("PROBE_SECONDS"):
            return float(line.split()[1])
    return float("inf")


def probe(isas: list) -> dict:
    """Seconds per probe step for each candidate ISA ("" = default)."""
    return {isa: _time_candidate(isa) for isa in isas}


def best_isa() -> str:
    """The cached verdict for this CPU, probing (under a lock shared by all local ranks) if needed."""
    isas = candidates(cpu_flags())
    if len(isas) == 1:
        return ""
    key = f"{cpu_model()} | mindspore {_mindspore_version()}"
    os.makedirs(cache_dir(), exist_ok=True)
    path = os.path.join(cache_dir(), "cpu_isa.json")
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # ranks starting together probe once, the rest read the verdict
        cache = _read_cache(path)
        if key not in cache:
            start = time.perf_counter()
            timings = probe(isas)
            best = min(timings, key=timings.get)
            if timings[best] == float("inf"):
                # Cached like any verdict, so later starts do not pay for the failing probe again.
                _logger.warning("oneDNN ISA probe failed for every candidate; keeping oneDNN's default "
                                "(cached in %s; delete it to probe again)", path)
                best = ""
            cache[key] = {"isa": best, "seconds": {k or "default": v for k, v in timings.items()},
                          "probe_seconds": round(time.perf_counter() - start, 1)}
            atomic_write_text(path, json.dumps(cache, indent=1))
            _logger.info("probed oneDNN ISA for %s: %s", key, cache[key])
    return cache[key]["isa"]


def _read_cache(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _time_one_step() -> float:
    """Run in a child process: seconds per conv forward+backward, like a ResNet stem."""
    import numpy as np
    import mindspore as ms
    from mindspore import Tensor, nn

    class MeanSquare(nn.Cell):
        def construct(self, out, target):
            return ((out - target) ** 2).mean()

    ms.set_device("CPU")  # not set_context(device_target=...): deprecated, and it warns
    ms.set_context(mode=ms.GRAPH_MODE)
    net = nn.SequentialCell([nn.Conv2d(3, 16, 7, stride=2), nn.ReLU(), nn.Conv2d(16, 32, 3, stride=2),
                             nn.ReLU(), nn.Conv2d(32, 32, 3)])
    step = nn.TrainOneStepCell(nn.WithLossCell(net, MeanSquare()), nn.SGD(net.trainable_params(), 0.01))
    x = Tensor(np.random.rand(8, 3, 64, 64).astype(np.float32))
    y = Tensor(np.zeros((8, 32, 16, 16), np.float32))
    for _ in range(2):
        step(x, y)
    start = time.perf_counter()
    for _ in range(5):
        step(x, y).asnumpy()
    return (time.perf_counter() - start) / 5


if __name__ == "__main__":
    print("PROBE_SECONDS", _time_one_step())
