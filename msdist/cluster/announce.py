"""Ranks announce themselves on their host: how a relay finds them, whatever command line started them.

A relay (msdist.launcher.relay) passes a stop signal on to the msdist.train ranks below its command, however
they were started: `python3 -u -X dev -m msdist.train`, an interpreter with another name, a wrapper script,
mpirun, orted or prted in between. So each rank writes `<dir>/<pid>` at its start, and 200 into the same
file once it saved on a stop request; the relay signals only announced processes below its command, never
sshd, orted/prted or MindSpore's scheduler, which announce nothing (msrun runs the scheduler as
msdist.train too, with MS_ROLE=MS_SCHED: it does not announce itself). The directory is $MSDIST_RANKS_DIR or a fixed
one per user under /tmp: fixed, because a session sshd starts (an MPIJob worker's) carries none of the
relay's variables. A file holds its process's start time (/proc/<pid>/stat), so a recycled pid never
passes for a rank.

MindSpore-free, standard library only.
"""
import os
import time
from dataclasses import dataclass
from typing import Dict, Optional

RANKS_DIR_ENV = "MSDIST_RANKS_DIR"
_STALE_S = 24 * 3600.0   # a file of a process long gone: removed by the next rank that announces itself

_this_rank: Dict[str, str] = {}   # this process's announcement: its file and start time, once announced


def ranks_dir() -> str:
    return os.environ.get(RANKS_DIR_ENV) or os.path.join("/tmp", f"msdist-ranks-{os.getuid()}")


def start_time(pid: int) -> Optional[str]:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22); None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == b"Z" else fields[19].decode()


def this_rank() -> None:
    """Announce this process as an msdist rank. A rank that cannot (a read-only /tmp) still trains; only a
    relay above it could not reach it, and it would say so (it counts the ranks it told)."""
    if os.environ.get("MS_ROLE") == "MS_SCHED":
        return
    directory, pid = ranks_dir(), os.getpid()
    try:
        os.makedirs(directory, exist_ok=True)
        _forget_stale(directory)
        path = os.path.join(directory, str(pid))
        _write(path, start_time(pid) or "")
    except OSError:
        return
    _this_rank.update(path=path, started=start_time(pid) or "")


def record(status: int) -> None:
    """This rank's exit status, said before it exits: the relay above it exits 200 only if every rank it told
    recorded 200."""
    if _this_rank:
        try:
            _write(_this_rank["path"], f"{_this_rank['started']} {status}")
        except OSError:
            pass


def _write(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="ascii") as f:
        f.write(text)
    os.replace(tmp, path)   # a reader sees the whole line or the previous one


def _forget_stale(directory: str) -> None:
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        try:
            if name.isdigit() and start_time(int(name)) is None and time.time() - os.path.getmtime(path) > _STALE_S:
                os.remove(path)
        except OSError:
            pass


@dataclass(frozen=True)
class Rank:
    pid: int
    started: str              # start time, as `start_time` reads it
    status: Optional[int]     # its exit status, once it recorded one (`record`)

    @property
    def alive(self) -> bool:
        return start_time(self.pid) == self.started


def announced() -> Dict[int, Rank]:
    """Every rank announced on this host (alive, or ended with its file left), by pid."""
    found = {}
    directory = ranks_dir()
    try:
        names = [n for n in os.listdir(directory) if n.isdigit()]
    except OSError:
        return found
    for name in names:
        try:
            with open(os.path.join(directory, name), encoding="ascii") as f:
                fields = f.read().split()
        except OSError:
            continue
        if fields:
            found[int(name)] = Rank(int(name), fields[0], int(fields[1]) if len(fields) > 1 else None)
    return found
