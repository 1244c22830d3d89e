"""`python -m msdist.cluster.relay [--preempt_signal NAME] -- COMMAND ...`: pass a preemption on to the ranks below.

Some processes that receive a pod's or a job's stop signal do not pass it on to the ranks they (indirectly)
started: an MPIJob worker pod's PID 1 is sshd, whose SIGTERM never reaches the ranks that mpirun started
through it, and msrun dies by SIGTERM while its workers, in their own sessions, hear nothing. The relay
runs COMMAND as its child and stays PID 1. On the preemption signal (or SIGTERM, which is what Kubernetes
sends) it sends the preemption signal to every `msdist.train` process below COMMAND, waits until they are
gone (each saves at the agreed step and exits), gives COMMAND a few seconds to end by itself (mpirun,
msrun), then stops it with SIGTERM (sshd) and exits with preemption.REQUEUE_EXIT. A second signal later than preemption.REPEAT_S is passed on again: the ranks stop
at once. Without a signal it exits with COMMAND's status.

The ranks are found under COMMAND only (the process tree, /proc), never by name across the machine.
"""
import argparse
import os
import signal
import subprocess
import sys
import time
from typing import Dict, List, Optional

from msdist.cluster import preemption
from msdist.cluster.cli import cli_main
from msdist.cluster.errors import ConfigError

_POLL_S = 0.2
_CHILD_GRACE_S = 5.0     # after the ranks left: time for COMMAND (mpirun, msrun) to end by itself
_RANK_COMMAND = b"msdist.train"


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


def ranks_below(root: int) -> List[int]:
    """The live `msdist.train` processes in the process tree under `root`."""
    parents = _parents()
    below, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - below
        below |= frontier
    return [pid for pid in sorted(below) if _is_rank(pid)]


def _is_rank(pid: int) -> bool:
    """A Python interpreter running `-m msdist.train` (mpirun's and msrun's own command lines hold those words too)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return False
    return os.path.basename(argv[0]).startswith(b"python") and argv[1:3] == [b"-m", _RANK_COMMAND]


class _Relay:
    def __init__(self, sig: signal.Signals, command: List[str]):
        self.sig = sig
        self.child = subprocess.Popen(command)
        self.requests: List[float] = []

    def on_signal(self, signum, _frame) -> None:
        self.requests.append(time.monotonic())
        ranks = ranks_below(self.child.pid)
        print(f"msdist.relay: {signal.Signals(signum).name}: passing {self.sig.name} on to ranks {ranks}",
              file=sys.stderr, flush=True)
        for pid in ranks:
            try:
                os.kill(pid, self.sig)
            except ProcessLookupError:
                pass

    def run(self) -> int:
        ranks_gone = None
        while self.child.poll() is None:
            if self.requests and not ranks_below(self.child.pid):
                ranks_gone = ranks_gone or time.monotonic()
                if time.monotonic() - ranks_gone > _CHILD_GRACE_S:
                    self.child.terminate()  # sshd stays up by itself; mpirun and msrun left on their own
                    self.child.wait()
            time.sleep(_POLL_S)
        return preemption.REQUEUE_EXIT if self.requests else self.child.returncode


def _parse(argv: Optional[List[str]]):
    parser = argparse.ArgumentParser(prog="msdist.cluster.relay", description=__doc__.splitlines()[0])
    parser.add_argument("--preempt_signal", default="SIGTERM", help="the signal the ranks save on [SIGTERM]")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ... (sshd, msrun)")
    ns = parser.parse_args(argv)
    command = ns.command[1:] if ns.command[:1] == ["--"] else ns.command
    if not command:
        raise ConfigError("msdist.cluster.relay needs a command after --, e.g. -- /usr/sbin/sshd -De")
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
