"""`python -m msdist.launcher.relay [--preempt_signal NAME] -- COMMAND ...`: pass a stop signal on to the ranks below.

Some processes that receive a pod's or a job's stop signal do not pass it on to the ranks they (indirectly)
started: an MPIJob worker pod's PID 1 is sshd, whose SIGTERM never reaches the ranks that mpirun started
through it; mpirun itself, sent SIGTERM, kills its ranks within seconds; msrun dies by SIGTERM while its
workers, in their own sessions, hear nothing. The relay runs COMMAND as its child and stays PID 1.

* COMMAND starts shielded: SIGTERM (and the preemption signal, unless mpirun forwards it) blocked. Slurm
  signals every process of a step at once, mpirun included, and a shielded mpirun does not kill its ranks
  (it never unblocks it; the ranks it starts get an empty mask: measured, OpenMPI 4.1.4).
* On SIGTERM or the preemption signal it sends the preemption signal to every rank below COMMAND that
  announced itself (msdist.cluster.announce: never sshd, orted/prted or MindSpore's scheduler), to ranks that
  announce later too, and to mpirun when mpirun forwards that signal to all its ranks (SIGUSR2: the MPIJob
  launcher pod, whose ranks run on the workers). Repeats are the same request.
* Once the ranks it told are gone it gives COMMAND a few seconds to end by itself (mpirun, msrun), then
  stops it (sshd), and exits with `exit_status`: 200 only if the ranks saved, 0 if the job had finished
  before they could take the signal, 1 otherwise. Without a signal it exits with COMMAND's status.
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
from msdist.cluster import announce, preemption

_POLL_S = 0.2
_CHILD_GRACE_S = 5.0     # after the ranks left (or none was found): time for COMMAND to end by itself
_MPIRUN = (b"mpirun", b"mpiexec", b"orterun", b"prterun")
# What OpenMPI 4.1's mpirun passes on to every rank at once (ompi_info: ess_base_forward_signals). Sent
# SIGTERM, it instead ends the job: SIGTERM to the ranks after odls_base_sigkill_timeout, SIGKILL after
# that again (docs/cluster.md).
MPIRUN_FORWARDS = (signal.SIGUSR2, signal.SIGALRM)
_FAILED = 1


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


def _below(root: int) -> List[int]:
    """`root` and every process under it."""
    parents = _parents()
    below, frontier = {root}, {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - below
        below |= frontier
    return sorted(below)


def ranks_below(root: int) -> Dict[int, announce.Rank]:
    """The live msdist ranks under `root` that announced themselves (msdist.cluster.announce)."""
    ranks = announce.announced()
    return {pid: ranks[pid] for pid in _below(root) if pid in ranks and ranks[pid].alive}


def mpiruns_below(root: int, sig: signal.Signals) -> List[int]:
    """mpirun under `root`, when it forwards `sig` to its ranks wherever they run (the MPIJob launcher pod)."""
    if sig not in MPIRUN_FORWARDS:
        return []
    return [pid for pid in _below(root) if _program(pid) in _MPIRUN]


def _program(pid: int) -> bytes:
    """The name of the file the process executed (/proc/<pid>/comm: a script's own name, not its interpreter's)."""
    try:
        with open(f"/proc/{pid}/comm", "rb") as f:
            return f.read().strip()
    except OSError:
        return b""


def shielded(sig: signal.Signals) -> set:
    """The stop signals COMMAND starts with blocked: those mpirun would take as "kill the job"."""
    return set(preemption.stop_signals(sig)) - set(MPIRUN_FORWARDS)


class _Relay:
    def __init__(self, sig: signal.Signals):
        self.sig = sig
        self.child: Optional[subprocess.Popen] = None
        self.asked_at: Optional[float] = None   # a stop signal came: the ranks are told, then the status decided
        self.ranks: Dict[int, announce.Rank] = {}   # the ranks it told
        self.mpiruns: set = set()                 # the mpiruns it told (they forward to their ranks)
        self.stopped = False                      # the relay ended COMMAND itself

    def start(self, command: List[str]) -> None:
        blocked = shielded(self.sig)
        try:
            self.child = subprocess.Popen(command, preexec_fn=lambda: signal.pthread_sigmask(signal.SIG_BLOCK, blocked))
        except OSError as e:
            raise ConfigError(f"msdist.launcher.relay cannot run {command[0]!r}: {e.strerror}; check the command "
                              "after --") from None

    def on_signal(self, signum, _frame) -> None:
        """A stop signal: the ranks are told at the next poll, where the relay looks for them anyway."""
        if self.asked_at is None:
            self.asked_at = time.monotonic()
            say(f"{signal.Signals(signum).name}: passing {self.sig.name} on to the msdist ranks below the command")

    def tell(self) -> None:
        """Pass the signal on to the ranks (and mpiruns) below COMMAND not told yet."""
        ranks = {pid: r for pid, r in ranks_below(self.child.pid).items() if pid not in self.ranks}
        mpiruns = set(mpiruns_below(self.child.pid, self.sig)) - self.mpiruns
        for pid in [*ranks, *mpiruns]:
            try:
                os.kill(pid, self.sig)
            except ProcessLookupError:
                pass
        if ranks or mpiruns:
            say(f"told ranks {sorted(ranks)}" + (f" and mpirun {sorted(mpiruns)}" if mpiruns else ""))
        self.ranks.update(ranks)
        self.mpiruns |= mpiruns

    def run(self) -> int:
        settled_at = None
        while self.child.poll() is None:
            if self.asked_at is not None:
                self.tell()   # also the ranks that announce themselves after the signal
                settled_at = (settled_at or time.monotonic()) if self._settled() else None
                if settled_at is not None and time.monotonic() - settled_at > _CHILD_GRACE_S:
                    self.child.kill()  # sshd stays up (shielded from SIGTERM); mpirun and msrun left on their own
                    self.child.wait()
                    self.stopped = True
            time.sleep(_POLL_S)
        return self.child.returncode if self.asked_at is None else self.exit_status()

    def _settled(self) -> bool:
        """Whether the ranks it told are gone; with none told, whether none came in the grace. A told mpirun
        has its ranks elsewhere: COMMAND is then waited for."""
        if any(r.alive for r in self.ranks.values()):
            return False
        return bool(self.ranks) or not self.mpiruns and time.monotonic() - self.asked_at > _CHILD_GRACE_S

    def exit_status(self) -> int:
        """After a stop signal: 200 if every rank told recorded 200 (a rank does once the checkpoint is complete
        on every rank), or, with no rank on this host, if mpirun (which has them elsewhere) exited 200 or nothing
        ran to save; 0 if COMMAND finished by itself with 0; else a failure."""
        statuses = announce.announced()
        recorded = {pid: statuses[pid].status if pid in statuses else None for pid in self.ranks}
        command = None if self.stopped else self.child.returncode
        if recorded and all(s == preemption.REQUEUE_EXIT for s in recorded.values()):
            return preemption.REQUEUE_EXIT
        if command == 0:
            return 0
        if not recorded and (command == preemption.REQUEUE_EXIT or not self.mpiruns and self.stopped):
            if self.stopped:
                say("no msdist rank below the command took the signal: nothing to save")
            return preemption.REQUEUE_EXIT
        unsaved = sorted(pid for pid, s in recorded.items() if s != preemption.REQUEUE_EXIT)
        say(f"FAILED: the ranks did not all save (pid: exit status recorded) "
            f"{ {pid: recorded[pid] for pid in unsaved} }; command status {command}")
        return _FAILED


def say(message: str) -> None:
    print(f"msdist.relay: {message}", file=sys.stderr, flush=True)


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
    relay = _Relay(sig)
    for received in preemption.stop_signals(sig):  # first: a signal while COMMAND starts is one to pass on
        signal.signal(received, relay.on_signal)
    relay.start(command)
    return relay.run()


if __name__ == "__main__":
    sys.exit(main())
