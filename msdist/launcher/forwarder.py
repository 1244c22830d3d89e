"""msdist.launch's side of a preemption: the signal passed on to the ranks it started (msdist.cluster.preemption)."""
import os
import signal
import time
from typing import Optional, Sequence

from msdist.cluster.preemption import stop_signals


class Forwarder:
    """msdist.launch's side: the first stop signal (SIGTERM or --preempt_signal) is passed on to every rank it
    started, once; repeats are the same request. SIGINT, handled elsewhere, stops everything at once.

    The ranks run in their own sessions, so a signal sent to the launcher alone (Kubernetes signals PID 1,
    a terminal its foreground group) would never reach them. Each rank's main process gets it, not its
    process group: dataset workers and helpers must not die before the save.

    Args:
        sig: the preemption signal (`parse_signal`), the one passed on.
    """

    def __init__(self, sig: signal.Signals):
        self.sig = sig
        self.requested_at: Optional[float] = None
        self._told = set()

    def install(self) -> None:
        for received in stop_signals(self.sig):
            signal.signal(received, self._on_signal)

    def _on_signal(self, _signum, _frame) -> None:
        if self.requested_at is None:
            self.request()

    def request(self) -> None:
        """Preemption asked for (also without a signal: an elastic job admitting a node, msdist.launcher.elastic)."""
        self.requested_at = time.monotonic()

    def forward(self, pids: Sequence[int]) -> None:
        """Once preemption is requested: pass the signal on to each of `pids` not told yet."""
        if self.requested_at is None:
            return
        for pid in set(pids) - self._told:
            try:
                os.kill(pid, self.sig)
            except ProcessLookupError:
                pass
            self._told.add(pid)
