"""Process environment that must be in place before `import mindspore`.

MindSpore and oneDNN read these variables once, when their libraries load, so
every entry point calls `prepare()` before anything imports mindspore. Nothing
here imports mindspore.
"""
import logging
import os
import sys
from dataclasses import dataclass

_logger = logging.getLogger(__name__)

# GLOG_v: 0 DEBUG, 1 INFO, 2 WARNING, 3 ERROR. MindSpore's Python logger reads it too.
_QUIET_LOG_LEVEL = "3"
_VERBOSE_LOG_LEVEL = "1"


@dataclass(frozen=True)
class RuntimeInfo:
    cpu_isa: str           # value given to ONEDNN_MAX_CPU_ISA ("" = oneDNN's own choice)
    isa_source: str        # where the choice came from: env, option, probe, default
    threads_per_rank: int


def usable_cores() -> int:
    """Cores this process may run on (respects taskset/cgroup affinity)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def threads_per_rank(local_world_size: int) -> int:
    """Split the host's cores evenly over the ranks on it, so ranks never oversubscribe."""
    return max(1, usable_cores() // max(1, local_world_size))


def choose_cpu_isa(requested: str) -> tuple:
    """Pick the oneDNN ISA cap: explicit environment, then the option, then the cached probe."""
    if os.environ.get("ONEDNN_MAX_CPU_ISA"):
        return os.environ["ONEDNN_MAX_CPU_ISA"], "env"
    if requested and requested != "auto":
        return ("" if requested == "default" else requested), "option"
    from msdist import isa_probe  # imported late: the probe spawns subprocesses
    return isa_probe.best_isa(), "probe"


def prepare(verbose: bool = False, cpu_isa: str = "auto", local_world_size: int = 1) -> RuntimeInfo:
    """Set logging, kernel ISA and thread variables for this process. Call before importing mindspore."""
    if "mindspore" in sys.modules:
        _logger.warning("runtime.prepare() called after mindspore was imported; ISA and thread settings may not apply")
    level = _VERBOSE_LOG_LEVEL if verbose else _QUIET_LOG_LEVEL
    os.environ["GLOG_v"] = level
    # Some of MindSpore's communication libraries log through plain glog, which reads this instead.
    os.environ["GLOG_minloglevel"] = "0" if verbose else "2"
    isa, source = choose_cpu_isa(cpu_isa)
    if isa:
        os.environ["ONEDNN_MAX_CPU_ISA"] = isa
    threads = threads_per_rank(local_world_size)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    return RuntimeInfo(cpu_isa=isa or "default", isa_source=source, threads_per_rank=threads)
