"""`python -m msdist.cluster.scheduler`: MindSpore's dynamic-cluster scheduler, tied to the life of its job.

Started by rank 0 under mpirun (CPU) and by `msdist.launch`. Two processes:

* a watchdog (this module, no MindSpore) that the kernel signals when the process that started it
  dies (PR_SET_PDEATHSIG). It then gives the scheduler a short grace period to see the remaining
  workers leave, and kills it;
* the scheduler itself, a child of the watchdog, killed by the kernel if the watchdog dies.
  MindSpore's scheduler returns from `init()` once every worker has unregistered, so on a clean
  finish it exits by itself, right after the last worker.

So the scheduler never outlives its job, whether the job ends well, fails, or is killed.

Both relay the scheduler's output line by line (to the scheduler log or msrun's) and read the
registrations in it (msdist.cluster.registration). Under mpirun, srun and msrun, a rank still not
registered `--stall_register_timeout` seconds after all the others is named in one line and the
scheduler is ended with `registration.NOT_REGISTERED_EXIT` (msdist.launch watches and respawns itself).

Under msrun the entry point itself is started with MS_ROLE=MS_SCHED (msrun runs the training command
once more as its scheduler); `serve_job()` then runs the scheduler proper the same way and ends it
when the job's workers are gone (msrun waits for the scheduler before it exits).
"""
import os
import signal
import subprocess
import sys
import threading
import time
from typing import List

from msdist.cluster import heartbeat, preemption, registration, rendezvous

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
    ms.set_device("CPU")  # not set_context(device_target=...): deprecated, and it warns
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        init()
    except RuntimeError as e:  # e.g. "The total number of timed out node is 1 ... worker 1 is the first one"
        print(f"{rendezvous.SCHEDULER_PREFIX}MindSpore's scheduler failed: {describe_cluster_error(str(e))}", flush=True)
        os._exit(1)  # pylint: disable=protected-access; MindSpore's teardown of a failed cluster takes seconds


def describe_cluster_error(message: str) -> str:
    """One line from MindSpore's cluster error: its first line, without the C++ call stack after it."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    return lines[0] if lines else "no message"


class _Child:
    """The scheduler proper, its output relayed through this process and its registrations read on the way."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-m", "msdist.cluster.scheduler"], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT,
                                     env=dict(os.environ, **{_CHILD_FLAG: "1", "MSDIST_PARENT_PID": str(os.getpid())}))
        wait_s = float(os.environ.get(rendezvous.REGISTER_TIMEOUT_VAR, "0"))
        self.registrations = registration.Registrations(int(os.environ.get("MS_WORKER_NUM", "1")), wait_s) \
            if wait_s > 0 else None
        self._relaying = threading.Thread(target=self._relay, daemon=True)
        self._relaying.start()

    def _relay(self) -> None:
        for raw in self.proc.stdout:
            text = raw.decode("utf-8", errors="replace")
            sys.stdout.write(text)
            sys.stdout.flush()
            if self.registrations is not None:
                self.registrations.feed(text)

    def returncode(self) -> int:
        """The scheduler's exit status, once its last lines (its verdict among them) are relayed."""
        self._relaying.join(timeout=5)
        return self.proc.returncode

    def unregistered_line(self) -> str:
        """One line naming the ranks still unregistered past the wait, or ""."""
        overdue = self.registrations.overdue() if self.registrations is not None else []
        if not overdue:
            return ""
        log_dir = os.environ.get(rendezvous.LOG_DIR_VAR, "")
        host_of = registration.host_from_heartbeat(
            lambda rank: heartbeat.read(heartbeat.path_for(log_dir, rank)) if log_dir else None)
        return "; ".join(self.registrations.line(rank, host_of(rank)) for rank in overdue)

    def fail_unregistered(self, line: str, ranks: List[int], console: str) -> int:
        """Name the missing ranks in the log and on `console`, end `ranks` (pids) with NOT_REGISTERED_EXIT
        (registration.exit_on_signal), then the scheduler."""
        print(f"{rendezvous.SCHEDULER_PREFIX}{line}", flush=True)
        try:
            with open(console, "w", encoding="utf-8") as out:
                out.write(f"msdist: job failed: {line}\n")
        except OSError:
            pass
        for pid in ranks:
            try:
                os.kill(pid, registration.NOT_REGISTERED_EXIT)
            except ProcessLookupError:
                pass
        self.proc.kill()
        self.proc.wait()
        return registration.NOT_REGISTERED_EXIT


def _watch() -> int:
    _die_with_parent(signal.SIGTERM)
    parent = os.getppid()
    scheduler = _Child()
    child = scheduler.proc
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
        line = scheduler.unregistered_line()
        if line:  # rank 0, our parent: mpirun then ends the job with its exit status
            return scheduler.fail_unregistered(line, [parent], f"/proc/{parent}/fd/2")
        time.sleep(0.2)
    return scheduler.returncode()


def _sibling_workers() -> List[int]:
    """Processes started by our parent (msrun) with our executable, other than us: its workers.

    msrun also starts `tail -f` processes for the console; their executable differs.
    """
    parent, me = os.getppid(), os.getpid()
    exe = os.path.realpath("/proc/self/exe")
    alive = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            if int(fields[1]) == parent and fields[0] != b"Z" and os.path.realpath(f"/proc/{entry}/exe") == exe:
                alive.append(int(entry))
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
    scheduler = _Child()
    child = scheduler.proc
    gone_since = None
    while child.poll() is None:
        line = scheduler.unregistered_line()
        if line:  # msrun waits for its workers: the registered ones would wait for the missing one for good
            return scheduler.fail_unregistered(line, _sibling_workers(), "/proc/self/fd/2")
        busy = rendezvous.established_connections(port) or _sibling_workers()
        gone_since = None if busy else (gone_since or time.monotonic())
        if gone_since is not None and time.monotonic() - gone_since > _JOB_GONE_S:
            child.kill()
            child.wait()
            return 0
        time.sleep(0.5)
    return scheduler.returncode()


if __name__ == "__main__":
    preemption.unblock_all()  # a rank started us with its preemption signal blocked: SIGTERM must end us
    if os.environ.get(_CHILD_FLAG):
        _run_scheduler()
    else:
        sys.exit(_watch())
