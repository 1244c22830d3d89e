"""`python -m msdist.cluster.scheduler`: MindSpore's dynamic-cluster scheduler, tied to the life of its job.

Started by rank 0 under mpirun (CPU) and by `msdist.launch`. Two processes:

* a watchdog (this module, no MindSpore) that the kernel signals when the process that started it
  dies (PR_SET_PDEATHSIG). It then gives the scheduler a short grace period to see the remaining
  workers leave, and kills it;
* the scheduler itself, a child of the watchdog, killed by the kernel if the watchdog dies.
  MindSpore's scheduler returns from `init()` once every worker has unregistered, so on a clean
  finish it exits by itself, right after the last worker.

So the scheduler never outlives its job, whether the job ends well, fails, or is killed.

Under msrun the entry point itself is started with MS_ROLE=MS_SCHED (msrun runs the training command
once more as its scheduler); `serve_job()` then runs the scheduler proper the same way and ends it
when the job's workers are gone (msrun waits for the scheduler before it exits).
"""
import os
import signal
import subprocess
import sys
import time

from msdist.cluster import preemption, rendezvous

_GRACE_AFTER_PARENT_S = 3.0
_JOB_GONE_S = 3.0   # no worker connected and no sibling worker alive for this long: the job is over
_CHILD_FLAG = "MSDIST_SCHEDULER_CHILD"


def _die_with_parent(sig: int) -> None:
    """Ask the kernel to send `sig` when our parent exits; exit now if it already has."""
    parent = int(os.environ.get("MSDIST_PARENT_PID", "0"))
    rendezvous.set_parent_death_signal(sig)  # without it (not glibc) the parent-liveness poll in _watch covers us
    if parent and os.getppid() != parent:
        sys.exit(1)  # the parent died before prctl took effect


def _run_scheduler() -> None:
    _die_with_parent(signal.SIGKILL)
    for sig in preemption.CANDIDATES:  # the ranks save through this scheduler after a preemption notice
        signal.signal(sig, signal.SIG_IGN)
    import mindspore as ms
    from mindspore.communication import init

    # The scheduler only routes metadata between workers; it never touches a device.
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    try:
        init()
    except RuntimeError as e:  # e.g. "The total number of timed out node is 1 ... worker 1 is the first one"
        print(f"{rendezvous.SCHEDULER_PREFIX}MindSpore's scheduler failed: {describe_cluster_error(str(e))}", flush=True)
        os._exit(1)  # pylint: disable=protected-access; MindSpore's teardown of a failed cluster takes seconds


def describe_cluster_error(message: str) -> str:
    """One line from MindSpore's cluster error: its first line, without the C++ call stack after it."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    return lines[0] if lines else "no message"


def _watch() -> int:
    _die_with_parent(signal.SIGTERM)
    parent = os.getppid()
    child = subprocess.Popen([sys.executable, "-m", "msdist.cluster.scheduler"],
                             env=dict(os.environ, **{_CHILD_FLAG: "1", "MSDIST_PARENT_PID": str(os.getpid())}))
    deadline = []

    def parent_gone(*_):
        # A signal while the parent lives is a scheduler's preemption notice sent to every process of the
        # job (Slurm signals a whole step): the ranks save through this scheduler, the parent ends it later.
        if not deadline and os.getppid() != parent:
            deadline.append(time.monotonic() + _GRACE_AFTER_PARENT_S)

    for sig in (*preemption.CANDIDATES, signal.SIGINT):
        signal.signal(sig, parent_gone)
    while child.poll() is None:
        if not deadline and os.getppid() != parent:
            parent_gone()
        if deadline and time.monotonic() > deadline[0]:
            child.kill()
            child.wait()
            return 1
        time.sleep(0.2)
    return child.returncode


def _live_sibling_workers() -> int:
    """Processes started by our parent (msrun) with our executable, other than us: its workers.

    msrun also starts `tail -f` processes for the console; their executable differs.
    """
    parent, me = os.getppid(), os.getpid()
    exe = os.path.realpath("/proc/self/exe")
    alive = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            if int(fields[1]) == parent and fields[0] != b"Z" and os.path.realpath(f"/proc/{entry}/exe") == exe:
                alive += 1
        except (OSError, IndexError, ValueError):
            continue
    return alive


def serve_job(port: int) -> int:
    """Run MindSpore's scheduler for a job whose workers another launcher (msrun) started.

    msdist's ranks leave with os._exit (runtime.exit_without_teardown), so they never unregister and
    MindSpore's scheduler would wait for its heartbeat timeout and then fail the finished job. This
    process ends it instead once nothing is connected to the scheduler port and no worker started
    next to this process is alive, for a few seconds. A failed worker is reported by its launcher;
    the scheduler's own failure (before that) is its exit status, with the cause in its output.
    """
    child = subprocess.Popen([sys.executable, "-m", "msdist.cluster.scheduler"],
                             env=dict(os.environ, **{_CHILD_FLAG: "1", "MSDIST_PARENT_PID": str(os.getpid())}))
    gone_since = None
    while child.poll() is None:
        busy = rendezvous.established_connections(port) or _live_sibling_workers()
        gone_since = None if busy else (gone_since or time.monotonic())
        if gone_since is not None and time.monotonic() - gone_since > _JOB_GONE_S:
            child.kill()
            child.wait()
            return 0
        time.sleep(0.5)
    return child.returncode


if __name__ == "__main__":
    preemption.unblock_all()  # a rank started us with its preemption signal blocked: SIGTERM must end us
    if os.environ.get(_CHILD_FLAG):
        _run_scheduler()
    else:
        sys.exit(_watch())
