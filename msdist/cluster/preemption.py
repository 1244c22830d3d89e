"""Preemption: a stop signal makes the ranks save at one agreed step boundary, then exit for a requeue.

What both sides of the protocol share, MindSpore-free: `--preempt_signal NAME` (`parse_signal`: SIGTERM by
default; SIGUSR1 is msdist's stack-dump signal, heartbeat.STACK_DUMP_SIGNAL, and SIGINT stays "stop now", so
neither can be it), the signals a scheduler may send (`CANDIDATES`), the signals that ask for a save
(`stop_signals`) and the exit status of a rank that saved (`REQUEUE_EXIT`), which msdist.launch, the relay, the
retry script and the sbatch take for "requeue, not failure" (docs/cluster.md).

SIGTERM always asks for a save (`stop_signals`): every scheduler sends it before its kill (Slurm on preemption and
scancel, Kubernetes), so `--preempt_signal` adds a signal and never takes SIGTERM away.

Inside a rank, msdist.rank.preempt_stop hears the signals (`Listener`) and makes every rank stop at one step
(`Agreement`); msdist.launch passes them on to its ranks (msdist.launcher.forwarder), and a pod's PID 1 to the
ranks below sshd, msrun or mpirun (msdist.launcher.relay). A request is one request however often it arrives
(Slurm signals a whole step and the launchers pass it on too; an MPIJob's two relays): repeats never interrupt
the save. SIGINT stops at once.
"""
import signal
from typing import FrozenSet

from msdist.base.errors import ConfigError

# The status of a rank (and of msdist.launch, the retry script, the sbatch step) that saved on a preemption.
# Not 1 (a crash) nor 2 (a UserError), and not 128+n for any Linux signal n (1..64, so at most 192); at
# least 128, which the Kubeflow training operators' `restartPolicy: ExitCode` retry (1-127 are permanent).
REQUEUE_EXIT = 200
DEFAULT_SIGNAL = "SIGTERM"  # --preempt_signal's default, for msdist.train/launch and the relay: what Kubernetes sends
# Signals a scheduler may send ahead of a kill. Faults (SIGSEGV...) and job control are not, and must
# never be blocked.
CANDIDATES = (signal.SIGTERM, signal.SIGUSR2, signal.SIGHUP, signal.SIGQUIT, signal.SIGALRM, signal.SIGXCPU)
_REFUSED = {signal.SIGUSR1: "it is msdist's stack-dump signal", signal.SIGINT: "SIGINT (Ctrl-C) stays 'stop now'"}


def parse_signal(name: str) -> signal.Signals:
    """`--preempt_signal`: a signal name (SIGTERM, TERM, SIGUSR2, USR2) -> the signal.

    Raises:
        ConfigError: an unknown name, or a signal that cannot mean "save, then exit".
    """
    text = str(name).strip().upper()
    text = text if text.startswith("SIG") else f"SIG{text}"
    try:
        sig = signal.Signals[text]
    except KeyError:
        raise ConfigError(f"--preempt_signal {name!r} is not a signal name; use e.g. SIGTERM or SIGUSR2") from None
    if sig in _REFUSED:
        raise ConfigError(f"--preempt_signal {sig.name} is refused: {_REFUSED[sig]}; use SIGTERM or SIGUSR2")
    if sig not in CANDIDATES:
        raise ConfigError(f"--preempt_signal {sig.name} is not one a scheduler sends before a kill; use one of "
                          f"{', '.join(c.name for c in CANDIDATES)}")
    return sig


def stop_signals(sig: int) -> FrozenSet[signal.Signals]:
    """The signals that ask for a save when `sig` is the --preempt_signal: SIGTERM always, and `sig`."""
    return frozenset({signal.SIGTERM, signal.Signals(sig)})


def check_signal(name: str) -> None:
    """The option's check (config.Option.check)."""
    parse_signal(name)


def unblock_all() -> None:
    """In a child of a rank: take every signal again (the rank's blocked mask is inherited across exec)."""
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
