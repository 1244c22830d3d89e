"""Each rank's progress, and the stall verdict read from it.

Every rank rewrites `{output_dir}/logs/rank_{r}.heartbeat` every couple of seconds from a daemon thread.
The file is small JSON:

* `time`, `pid`, `rank`, `host`: who wrote it, when (the writer's clock);
* `epoch` (1-based), `step` (within the epoch), `global_step`: the last optimizer step completed;
* `phase` and `phase_s`: what the main thread is doing (a `phases.Phase` name: start-up, compile, data wait,
  train step, stop check, evaluation, checkpoint save, epoch end, finish) and for how long, as of `time`;
* `limit_s`: how long this rank may stay in this phase before it counts as stuck (null: watching is off);
* `in_collective`: the main thread is inside a host-side collective (`Collectives.gather`: BatchNorm
  statistics before a save or an evaluation, evaluation counts, the epoch's loss, the stop check), waiting for
  the others;
* `loop_state`: the kernel's state letter for the main thread ("S" asleep, "R" running, "D" in uninterruptible I/O,
  "t" stopped by a debugger; "" unknown), and `loop_tid`, that thread's id. A reader on the same host reads the
  state afresh (`Tracker`), so it is known even when the main thread stopped holding the Python lock and the
  heartbeat thread fell silent with it;
* `median_step_s`: the median wall time between the rank's recent steps.

The writer is msdist.rank.heartbeat_writer: the training loop reports with `enter(phase)` and
`step_done(...)`, attribute writes (and one file write per epoch), no host sync. The thread keeps writing
while the main thread is stuck (a collective, a dead NFS read, a deadlocked reader), so a stuck rank shows up as a phase that does not end, not as
silence. Silence means the whole process stopped (SIGSTOP, a hang that holds the Python lock, a dead host).

`Tracker` and `find_stall` turn the beats of a job into a verdict under the one stall policy
(msdist.cluster.stall), the same way for the two deciders: msdist.launch's supervisor and, under other
launchers, the watchdog thread inside every rank (msdist.rank.watchdog). Durations are measured
skew-free: a rank's time in its phase as of its own beat, plus the reader's own time since that beat changed.
"""
import json
import os
import signal
import socket
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from msdist.base.files import atomic_write_text
from msdist.cluster.phases import Phase
from msdist.cluster.stall import StallPolicy

DEFAULT_INTERVAL_S = 2.0     # between two beats of a rank
# The first steps of a process fill the input pipeline, finish compiling kernels and queue up behind the
# other ranks' first collectives: 8 s for a 30 ms step was seen on a 2-core machine at load 20.
WARMUP_STEPS = 3
_SILENT_AFTER_BEATS = 4      # no new beat for this many intervals: the process itself is not running
STACK_DUMP_SIGNAL = signal.SIGUSR1   # a rank answers it with every thread's stack in its log


def path_for(log_dir: str, rank: int) -> str:
    return os.path.join(log_dir, f"rank_{rank}.heartbeat")


def read(path: str) -> Optional[dict]:
    """The last heartbeat written to `path`, or None when there is none (yet)."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


# ---------------------------------------------------------------- reading a job's beats

@dataclass(frozen=True)
class RankState:
    """One rank as a reader sees it now."""
    rank: int
    beat: dict
    stuck_s: float      # in its current phase, as of now
    silent_s: float     # since its heartbeat last changed

    @property
    def silent(self) -> bool:
        return self.silent_s > _SILENT_AFTER_BEATS * DEFAULT_INTERVAL_S

    @property
    def over_limit(self) -> bool:
        limit = self.beat.get("limit_s")
        return limit is not None and self.stuck_s > limit


class Tracker:
    """Follows the heartbeat files of a job's ranks.

    A file that holds the same beat as when the tracker started is left out until it changes: it may be
    a previous run's (a retried mpirun job in the same output_dir).

    Args:
        paths: rank -> heartbeat path.
        pids: rank -> pid for ranks whose process the reader started (beats of other pids are ignored).
    """

    def __init__(self, paths: Dict[int, str], pids: Optional[Dict[int, int]] = None):
        self.paths = dict(paths)
        self.pids = dict(pids or {})
        self._stale = {rank: read(path) for rank, path in self.paths.items()}
        self._seen: Dict[int, tuple] = {}   # rank -> (beat time, local monotonic time it was first read)

    def poll(self) -> List[RankState]:
        now = time.monotonic()
        states = []
        for rank, path in self.paths.items():
            beat = read(path)
            if beat is None or beat == self._stale.get(rank):
                continue
            self._stale.pop(rank, None)
            if rank in self.pids and beat.get("pid") != self.pids[rank]:
                continue
            if self._seen.get(rank, (None,))[0] != beat["time"]:
                self._seen[rank] = (beat["time"], now)
            silent = now - self._seen[rank][1]
            states.append(RankState(rank, _fresh_loop_state(beat), beat.get("phase_s", 0.0) + silent, silent))
        return states


def _on_this_host(beat: dict) -> bool:
    """Whether `beat`'s process runs where this reader does (its /proc can be read)."""
    return beat.get("host") == socket.gethostname()


def _fresh_loop_state(beat: dict) -> dict:
    """`beat` with its main thread's state as this reader sees it now, when that thread is on this host."""
    if not _on_this_host(beat) or not beat.get("loop_tid"):
        return beat
    now = state_letter(f"/proc/{beat.get('pid')}/task/{beat['loop_tid']}/stat")
    return dict(beat, loop_state=now) if now else beat


# Main-thread states that say by themselves that a rank holds the job up: a thread waiting for the other ranks
# in a collective sleeps ("S") or spins ("R"), it is never stopped or in uninterruptible I/O.
_HELD = {"t": "its main thread is stopped by a debugger", "T": "its main thread is stopped",
         "D": "its main thread is in uninterruptible I/O: a dead disk or network file system?"}


def _began_next_step(beat: dict) -> bool:
    """Past every phase between step `global_step` and the next (data wait, saves, stop check, evaluation,
    epoch end): in the next step's own."""
    return beat.get("phase") == Phase.TRAIN_STEP


def _waiting(beat: dict) -> bool:
    """In a collective that waits for the other ranks (a train step's, or a host-side one), not held there
    by its own main thread."""
    return (_began_next_step(beat) or bool(beat.get("in_collective"))) and beat.get("loop_state") not in _HELD


def _blame_order(state: RankState):
    """The rank that holds the others up: the furthest behind, by step and then by phase; then one not waiting
    in a collective (the others wait there for it); then a silent one; then the one stuck longest."""
    return (state.beat["global_step"], _began_next_step(state.beat), _waiting(state.beat), not state.silent,
            -state.stuck_s)


def _where(beat: dict) -> str:
    if _began_next_step(beat):
        return f"waiting in step {beat['global_step'] + 1}"
    if beat.get("in_collective"):
        return f"waiting in {beat.get('phase')} at step {beat['global_step']}"
    return f"in {beat.get('phase')} at step {beat['global_step']}"


def _ranks(numbers: Sequence[int]) -> str:
    return f"rank{'s' if len(numbers) > 1 else ''} {', '.join(str(n) for n in numbers)}"


@dataclass(frozen=True)
class Stall:
    """A job that stopped making progress: who holds it up, and where everyone else is."""
    culprit: RankState
    others: Sequence[RankState]

    @property
    def rank(self) -> int:
        return self.culprit.rank

    def line(self) -> str:
        """`rank 1 (host a) stuck in data wait at step 37 for 62 s; ranks 0, 2, 3 waiting in step 38`"""
        beat = self.culprit.beat
        text = (f"rank {self.rank} (host {beat.get('host', '?')}) stuck in {beat.get('phase')} at step "
                f"{beat['global_step']} for {self.culprit.stuck_s:.0f} s")
        if beat.get("loop_state") in _HELD:
            text += f" ({_HELD[beat['loop_state']]})"
        if self.culprit.silent:
            text += f" (no heartbeat for {self.culprit.silent_s:.0f} s: the process is stopped or hung)"
        groups: Dict[str, List[int]] = {}
        for other in sorted(self.others, key=lambda s: s.rank):
            groups.setdefault(_where(other.beat), []).append(other.rank)
        return "; ".join([text] + [f"{_ranks(ranks)} {where}" for where, ranks in groups.items()])

    def record(self) -> dict:
        """The failure record's fields (see write_failure)."""
        beat = self.culprit.beat
        return {"kind": "stall", "message": self.line(), "rank": self.rank, "host": beat.get("host"),
                "phase": beat.get("phase"), "global_step": beat["global_step"],
                "stuck_s": round(self.culprit.stuck_s, 1), "limit_s": beat.get("limit_s"),
                "ranks": {str(s.rank): s.beat for s in [self.culprit, *self.others]}}


def state_letter(stat_path: str) -> str:
    """The state letter in a /proc stat file ("R", "S", "D", "T", "t"...), "" when its process or thread is gone."""
    try:
        with open(stat_path, encoding="utf-8") as f:
            return f.read().rsplit(")", 1)[1].split()[0]  # the field after "(command name)"
    except (OSError, IndexError):
        return ""


def _process_state(pid: int) -> str:
    """The state letter of a process of this host, "" when it is gone."""
    return state_letter(f"/proc/{pid}/stat")


def is_stopped(pid: int) -> bool:
    """True when the process is stopped (SIGSTOP, SIGTSTP, a debugger)."""
    return _process_state(pid) in ("T", "t")


def _too_long_silent(state: RankState, policy: StallPolicy) -> bool:
    """Silent past the policy's silence limit, judged for a process seen alive on this host only: a rank whose
    process ended is gone, not silent (its launcher reports the exit), and another host's cannot be told apart."""
    pid = state.beat.get("pid")
    if not _on_this_host(state.beat) or not pid or _process_state(pid) in ("", "Z", "X"):
        return False
    return state.silent_s > policy.silence_limit(state.beat, is_stopped(pid))[0]


def find_stall(states: Sequence[RankState], policy: StallPolicy) -> Optional[Stall]:
    """The job's stall when any rank has been in its phase longer than its limit, or silent longer than
    `policy` allows, else None."""
    if not any(s.over_limit or _too_long_silent(s, policy) for s in states):
        return None
    culprit = min(states, key=_blame_order)
    return Stall(culprit, [s for s in states if s is not culprit])


# ---------------------------------------------------------------- what a stall leaves behind

FAILURE_FILE = "failure.json"


def write_failure(log_dir: str, record: dict) -> str:
    """`{log_dir}/failure.json`: the one-line account of why the job was ended, with its details."""
    path = os.path.join(log_dir, FAILURE_FILE)
    atomic_write_text(path, json.dumps({"time": round(time.time(), 3), **record}, indent=1))
    return path
