"""Which ranks have joined the cluster, in the scheduler's own words, and the one line naming a rank that has not.

A rank inside MindSpore's `init()` may hold the Python lock, so its heartbeat can be silent and its
own watchdog cannot run; the scheduler's log is the one view that keeps working. MindSpore's
scheduler logs each registration ("ProcessRegister] The new node: 1(role: MS_WORKER), rank id: 1,
device id: ..., hostname: vm, ..."), but not the failed tries of a rank that cannot register
(issue #34: they fail before any message reaches it).

`Registrations` reads those lines and, once the ranks that did register have waited
`--stall_register_timeout` (msdist.cluster.stall) without another joining, names the missing ones. msdist.launch's
supervisor then respawns the rank (same node id); under mpirun, srun and msrun the scheduler's
watchdog (msdist.cluster.scheduler) prints the line and ends the ranks with `NOT_REGISTERED_EXIT`.
"""
import ctypes
import os
import re
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

NOT_REGISTERED = "not registered with the scheduler"
# The exit status of a job ended because a rank never registered (scripts/run_distribute_train_retry.sh
# starts it again). Every rank waits inside MindSpore's init() then, holding the Python lock, so no Python
# code of theirs can end them: the real-time signal of the same number (SIGRTMIN+8 on glibc) has libc's
# `_exit` itself as its handler (`exit_on_signal`), which ends the rank with this status from any state.
NOT_REGISTERED_EXIT = 42
# Set by msdist.launch in the environment of a rank it starts again because it did not register: the local
# ranks' start-up exchange (msdist.rank.local_exchange) ended before, and no peer would answer it again.
RESPAWNED_VAR = "MSDIST_RESPAWNED"
_REGISTERED = re.compile(r"ProcessRegister\] The new node: (\S+?)\(role: MS_WORKER\).*?hostname: ([^,]*),")


@dataclass
class Registrations:
    """The workers MindSpore's scheduler has registered, fed its log text as it grows."""
    world_size: int
    wait_s: float                                   # --stall_register_timeout
    hosts: Dict[str, str] = field(default_factory=dict)   # node id -> host, as registered
    last_change: Optional[float] = None             # monotonic time of the last registration (or respawn)
    first_at: Optional[float] = None                # monotonic time of the first registration

    def feed(self, text: str, now: Optional[float] = None) -> None:
        for node, host in _REGISTERED.findall(text):
            if node not in self.hosts:
                self.hosts[node] = host
                self.last_change = time.monotonic() if now is None else now
                self.first_at = self.first_at or self.last_change

    def restart_clock(self, started_at: float, now: Optional[float] = None) -> None:
        """A missing rank was respawned: it gets the time the first rank took from `started_at` (the ranks'
        spawn) to its registration, to start up, and then the whole wait again."""
        now = time.monotonic() if now is None else now
        self.last_change = now + max(0.0, (self.first_at or now) - started_at)

    def missing(self) -> List[int]:
        """Ranks not registered yet (msdist numbers node ids as ranks)."""
        return [r for r in range(self.world_size) if str(r) not in self.hosts]

    def overdue(self, now: Optional[float] = None) -> List[int]:
        """The missing ranks, once some have registered and no registration came for `wait_s`; else [].

        Usually one rank is missing and the others have all joined; at scale several can miss their
        registration at once, and each of them is named.
        """
        missing = self.missing()
        if not missing or len(missing) == self.world_size or self.last_change is None:
            return []
        now = time.monotonic() if now is None else now
        return missing if now - self.last_change >= self.wait_s else []

    def line(self, rank: int, host: str) -> str:
        """The one line naming a rank that has not joined."""
        return (f"rank {rank} (host {host}) {NOT_REGISTERED}: the other {len(self.hosts)} rank(s) joined and "
                f"waited {self.wait_s:.0f} s for it (--stall_register_timeout)")


def exit_on_signal() -> None:
    """From now on, signal NOT_REGISTERED_EXIT ends this process at once with that exit status."""
    libc = ctypes.CDLL(None)
    libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.signal.restype = ctypes.c_void_p
    # The handler is called as handler(signum): _exit(42). _exit is async-signal-safe.
    libc.signal(NOT_REGISTERED_EXIT, ctypes.cast(libc._exit, ctypes.c_void_p))  # pylint: disable=protected-access


class LogTail:
    """The text appended to a file since the last read (the scheduler's log, written by another process)."""

    def __init__(self, path: str, offset: int = 0):
        self.path = path
        self.offset = offset

    @classmethod
    def from_end(cls, path: str) -> "LogTail":
        """What is appended from now on (a log that earlier attempts wrote to)."""
        return cls(path, os.path.getsize(path) if os.path.exists(path) else 0)

    def read(self) -> str:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return ""
        cut = data.rfind(b"\n") + 1  # whole lines only: a registration line may be half written
        self.offset += cut
        return data[:cut].decode("utf-8", errors="replace")


def host_from_heartbeat(read_beat: Callable[[int], Optional[dict]]) -> Callable[[int], str]:
    """A rank's host from its heartbeat (written before it joins), for a rank the scheduler never saw."""
    def host_of(rank: int) -> str:
        beat = read_beat(rank)
        return str(beat.get("host")) if beat and beat.get("host") else "unknown"
    return host_of
