"""`python -m msdist.launcher.relay [--preempt_signal NAME] -- COMMAND ...`: pass a preemption on to the ranks below.

Some processes that receive a pod's or a job's stop signal do not pass it on to the ranks they (indirectly)
started: an MPIJob worker pod's PID 1 is sshd, whose SIGTERM never reaches the ranks that mpirun started
through it; mpirun itself, sent SIGTERM, kills its ranks within seconds; msrun dies by SIGTERM while its
workers, in their own sessions, hear nothing. The relay runs COMMAND as its child and stays PID 1. On the
preemption signal, or SIGTERM (what Kubernetes sends), it sends the preemption signal to every
`msdist.train` rank below COMMAND, and to mpirun when mpirun forwards that signal to all its ranks (SIGUSR2:
the MPIJob launcher pod, whose ranks run on the workers). Once those are gone (the ranks saved at the
agreed step) it gives COMMAND a few seconds to end by itself (mpirun, msrun), stops it with SIGTERM (sshd),
and exits with preemption.REQUEUE_EXIT, unless COMMAND ended by itself with 0: the job finished before the
ranks could take the signal, and a requeue would only start a finished job again. A second signal, later
than preemption.REPEAT_S, is passed on again: the ranks stop at once. Without a signal it exits with COMMAND's status.

The ranks are found under COMMAND only (the process tree, /proc), never by name across the machine.
"""
import argparse
import os
import signal
import subprocess
import sys
import time
from typing import Dict, List, Optional

from msdist.base.args import ArgumentParser
from msdist.base.cli import cli_main
from msdist.base.errors import ConfigError
from msdist.cluster import preemption

_POLL_S = 0.2
_CHILD_GRACE_S = 5.0     # after the ranks left: time for COMMAND (mpirun, msrun) to end by itself
_RANK_COMMAND = b"msdist.train"
_MPIRUN = (b"mpirun", b"mpiexec", b"orterun")
# What OpenMPI 4.1's mpirun passes on to every rank at once (ompi_info: ess_base_forward_signals). Sent
# SIGTERM, it instead ends the job: SIGTERM to the ranks after odls_base_sigkill_timeout, SIGKILL after
# that again (docs/cluster.md).
MPIRUN_FORWARDS = (signal.SIGUSR2, signal.SIGALRM)


def _parents() -> Dict[int, int]:
    """pid -> parent pid of every live process, from /proc."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != b"Z":
            found[int(entry)] = int(fields[1])
    return found


def targets_below(root: int, sig: signal.Signals) -> List[int]:
    """The processes under `root` to pass `sig` on to: the `msdist.train` ranks, and mpirun itself when it
    forwards `sig` to its ranks wherever they run (the MPIJob launcher pod, whose ranks are on the workers)."""
    parents = _parents()
    below, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - below
        below |= frontier
    return [pid for pid in sorted(below) if _is_target(_argv(pid), sig)]


def _argv(pid: int) -> List[bytes]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return [b""]


def _is_target(argv: List[bytes], sig: signal.Signals) -> bool:
    program = os.path.basename(argv[0])
    if program in _MPIRUN:  # its command line holds `-m msdist.train` too
        return sig in MPIRUN_FORWARDS
    return program.startswith(b"python") and argv[1:3] == [b"-m", _RANK_COMMAND]


class _Relay:
    def __init__(self, sig: signal.Signals, command: List[str]):
        self.sig = sig
        self.child = subprocess.Popen(command)
        self.asked = False     # a signal came: the exit status is REQUEUE_EXIT
        self.told: set = set()  # the processes it was passed on to

    def on_signal(self, signum, _frame) -> None:
        targets = targets_below(self.child.pid, self.sig)
        print(f"msdist.relay: {signal.Signals(signum).name}: passing {self.sig.name} on to processes {targets}",
              file=sys.stderr, flush=True)
        for pid in targets:
            try:
                os.kill(pid, self.sig)
            except ProcessLookupError:
                pass
        self.asked = True
        self.told |= set(targets)

    def run(self) -> int:
        gone_at = None
        stopped = False
        while self.child.poll() is None:
            if self.asked and not any(os.path.exists(f"/proc/{pid}") for pid in self.told):
                gone_at = gone_at or time.monotonic()
                if time.monotonic() - gone_at > _CHILD_GRACE_S:
                    self.child.terminate()  # sshd stays up by itself; mpirun and msrun left on their own
                    self.child.wait()
                    stopped = True
            time.sleep(_POLL_S)
        finished = self.child.returncode == 0 and not stopped
        return preemption.REQUEUE_EXIT if self.asked and not finished else self.child.returncode


def _parse(argv: Optional[List[str]]):
    parser = ArgumentParser(prog="msdist.launcher.relay", description=__doc__.splitlines()[0])
    parser.add_argument("--preempt_signal", default=preemption.DEFAULT_SIGNAL,
                        help=f"the signal the ranks save on [{preemption.DEFAULT_SIGNAL}]")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ... (sshd, msrun)")
    ns = parser.parse_args(argv)
    command = ns.command[1:] if ns.command[:1] == ["--"] else ns.command
    if not command:
        raise ConfigError("msdist.launcher.relay needs a command after --, e.g. -- /usr/sbin/sshd -De")
    return preemption.parse_signal(ns.preempt_signal), command


@cli_main
def main(argv: Optional[List[str]] = None) -> int:
    sig, command = _parse(argv)
    relay = _Relay(sig, command)
    for received in {signal.SIGTERM, sig}:
        signal.signal(received, relay.on_signal)
    return relay.run()


if __name__ == "__main__":
    sys.exit(main())
