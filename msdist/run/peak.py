"""One device's peak FLOP/s, the denominator of the utilisation msdist.train reports.

On a GPU: the table in run/hardware.py (`gpu_peak_flops`), looked up by the product name the NVIDIA driver
gives (/proc/driver/nvidia/gpus/*/information); a GPU the table does not hold has no peak. On a CPU: one
core's float32 matrix-product rate (NumPy's BLAS on 512 x 512 matrices, one thread, best of five), measured
once per host and CPU model and cached in `~/.cache/msdist/cpu_peak.json` (`$XDG_CACHE_HOME` is honoured),
times the threads a rank computes with. The measurement runs in a child process, so that the BLAS thread
count is set before NumPy loads; ranks of one host take turns on a file lock, and the first measures.
"""
import fcntl
import glob
import json
import logging
import os
import socket
import subprocess
import sys
from typing import Optional

from msdist.rank import isa_probe
from msdist.run import hardware

_logger = logging.getLogger(__name__)
_BENCHMARK = """
import os
for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):  # one thread, before NumPy loads
    os.environ[name] = "1"
import time
import numpy as np
n = 512
a, b = np.random.rand(n, n).astype(np.float32), np.random.rand(n, n).astype(np.float32)
a @ b
best = float("inf")
for _ in range(5):
    began = time.perf_counter()
    for _ in range(4):
        a @ b
    best = min(best, (time.perf_counter() - began) / 4)
print(2 * n ** 3 / best)
"""


def cache_path() -> str:
    return os.path.join(isa_probe.cache_dir(), "cpu_peak.json")  # beside the ISA probe's verdict


def _measure_core() -> Optional[float]:
    """One core's float32 FLOP/s, None when the child process fails (then the run reports no utilisation)."""
    try:
        out = subprocess.run([sys.executable, "-c", _BENCHMARK], check=True,
                             capture_output=True, text=True, timeout=120)
        return float(out.stdout.split()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as e:
        _logger.warning("CPU peak not measured (%s): the step line shows no utilisation", e)
        return None


def cpu_core_peak() -> Optional[float]:
    """One core's float32 FLOP/s on this host: from the cache, else measured now (about a second) and cached; a
    cache that cannot be written (a read-only home) is skipped and the figure measured for this run only."""
    path, key = cache_path(), f"{socket.gethostname()} | {isa_probe.cpu_model()}"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        lock = open(path + ".lock", "w", encoding="utf-8")  # pylint: disable=consider-using-with
    except OSError:
        return _measure_core()
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)   # the ranks of one host: the first measures, the others read
        try:
            with open(path, encoding="utf-8") as f:
                known = json.load(f)
        except (OSError, ValueError):
            known = {}
        if key not in known:
            measured = _measure_core()
            if measured is None:
                return None
            known[key] = measured
            _logger.info("CPU peak: %.1f GFLOP/s per core (float32 matrix product, measured once; cached in %s)",
                         measured / 1e9, path)
            with open(path + ".tmp", "w", encoding="utf-8") as f:
                json.dump(known, f, indent=1)
            os.replace(path + ".tmp", path)
        return float(known[key])


def gpu_model_name(information: str) -> str:
    """The product name in one /proc/driver/nvidia/gpus/*/information file ("" when it names none)."""
    for line in information.splitlines():
        if line.startswith("Model:"):
            return line.split(":", 1)[1].strip()
    return ""


def host_gpu_name() -> str:
    """The first GPU's product name on this host ("" without an NVIDIA driver)."""
    for path in sorted(glob.glob("/proc/driver/nvidia/gpus/*/information")):
        with open(path, encoding="utf-8", errors="replace") as f:
            name = gpu_model_name(f.read())
        if name:
            return name
    return ""


def device_peak(device_target: str, amp_level: str, threads_per_rank: int) -> Optional[float]:
    """One device's peak FLOP/s: a GPU's from the table (None where it holds no row), a CPU rank's threads'."""
    if device_target == "GPU":
        return hardware.gpu_peak_flops(host_gpu_name(), hardware.precision_of(amp_level))
    core = cpu_core_peak()
    return core * threads_per_rank if core else None
