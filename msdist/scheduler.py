"""`python -m msdist.scheduler`: MindSpore's dynamic-cluster scheduler, tied to the life of its job.

Started by rank 0 under mpirun (CPU) and by `msdist.launch`. Two processes:

* a watchdog (this module, no MindSpore) that the kernel signals when the process that started it
  dies (PR_SET_PDEATHSIG). It then gives the scheduler a short grace period to see the remaining
  workers leave, and kills it;
* the scheduler itself, a child of the watchdog, killed by the kernel if the watchdog dies.
  MindSpore's scheduler returns from `init()` once every worker has unregistered, so on a clean
  finish it exits by itself, right after the last worker.

So the scheduler never outlives its job, whether the job ends well, fails, or is killed.
"""
import ctypes
import os
import signal
import subprocess
import sys
import time

_PR_SET_PDEATHSIG = 1
_GRACE_AFTER_PARENT_S = 3.0
_CHILD_FLAG = "MSDIST_SCHEDULER_CHILD"


def _die_with_parent(sig: int) -> None:
    """Ask the kernel to send `sig` when our parent exits; exit now if it already has."""
    parent = int(os.environ.get("MSDIST_PARENT_PID", "0"))
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)
    except OSError:  # not glibc: the parent-liveness poll in _watch still covers us
        pass
    if parent and os.getppid() != parent:
        sys.exit(1)  # the parent died before prctl took effect


def _run_scheduler() -> None:
    _die_with_parent(signal.SIGKILL)
    import mindspore as ms
    from mindspore.communication import init

    # The scheduler only routes metadata between workers; it never touches a device.
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    init()


def _watch() -> int:
    _die_with_parent(signal.SIGTERM)
    parent = os.getppid()
    child = subprocess.Popen([sys.executable, "-m", "msdist.scheduler"],
                             env=dict(os.environ, **{_CHILD_FLAG: "1", "MSDIST_PARENT_PID": str(os.getpid())}))
    deadline = []

    def parent_gone(*_):
        if not deadline:
            deadline.append(time.monotonic() + _GRACE_AFTER_PARENT_S)

    signal.signal(signal.SIGTERM, parent_gone)
    signal.signal(signal.SIGINT, parent_gone)
    while child.poll() is None:
        if not deadline and os.getppid() != parent:
            parent_gone()
        if deadline and time.monotonic() > deadline[0]:
            child.kill()
            child.wait()
            return 1
        time.sleep(0.2)
    return child.returncode


if __name__ == "__main__":
    if os.environ.get(_CHILD_FLAG):
        _run_scheduler()
    else:
        sys.exit(_watch())
