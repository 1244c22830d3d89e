"""The stall watchdog inside every rank, for launchers that have no msdist supervisor (mpirun, msrun, srun).

A daemon thread in each rank reads every rank's heartbeat (`{output_dir}/logs/rank_{r}.heartbeat`) once
a second and asks `heartbeat.find_stall` whether the job still makes progress. On one host the files
are local; across hosts `--output_dir` must be on storage every host sees (NFS, a shared volume), with
attribute caching short enough that a file rewritten every 2 s is seen changing (NFS `actimeo` below
the stall timeout). Without shared storage each rank still sees its own file, so a stuck rank still
ends itself; only the account of where the other ranks were is lost.

When a stall is found:

* the reporter, the lowest rank whose own heartbeat thread still runs, writes `logs/failure.json`,
  prints the one line that explains it (`msdist: job failed: rank 1 (host a) stuck in data wait at
  step 37 for 62 s; ranks 0, 2, 3 waiting in step 38`), dumps its threads' stacks to its log and ends;
* every other rank sees the new failure record, dumps its stacks to its own log and ends quietly.
  A rank that sees the stall but no record within a few seconds (the reporter is gone, or on another
  host without shared storage) reports it itself.

Every rank leaving with a non-zero status makes every launcher end the job: mpirun and msrun stop
the rest at the first failure, srun's step ends when its tasks have.
"""
import os
import socket
import sys
import threading
import time

from msdist.base.files import rank_log_path
from msdist.base.launch_env import LaunchEnv
from msdist.cluster import heartbeat
from msdist.cluster.stall import StallPolicy
from msdist.rank import heartbeat_writer

_POLL_S = 1.0
_REPORT_GRACE_S = 5.0    # a rank other than the reporter waits this long for the reporter's record
_LINGER_S = 2.0          # the reporter's record reaches the other ranks (one poll) before it ends the job
_EXIT_STALLED = 1


def _record_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError:
        return ""


class Watchdog:
    """Ends this rank, and so the job, when the job stops making progress.

    Args:
        log_dir: the run's log directory (heartbeats, failure record, `rank_{r}.log`).
        rank: this rank.
        world_size: ranks in the job.
        log_path: this rank's log, where its stacks go.
        policy: the stall limits, the same the launcher's supervisor obeys.
    """

    def __init__(self, log_dir: str, rank: int, world_size: int, log_path: str, policy: StallPolicy):
        self.log_dir, self.rank, self.log_path, self.policy = log_dir, rank, log_path, policy
        self.record_path = os.path.join(log_dir, heartbeat.FAILURE_FILE)
        # A previous run's record (a retried job in the same output_dir) says nothing about this one.
        self._old_record = _record_text(self.record_path)
        self._tracker = heartbeat.Tracker({r: heartbeat.path_for(log_dir, r) for r in range(world_size)})
        self._thread = threading.Thread(target=self._run, name="msdist-stall-watchdog", daemon=True)

    def start(self) -> "Watchdog":
        self._thread.start()
        return self

    def _run(self) -> None:
        seen_at = None
        while True:
            time.sleep(_POLL_S)
            if _record_text(self.record_path) != self._old_record:
                self._end("another rank ended the job (see logs/failure.json)", linger_s=0.0)
            stall = heartbeat.find_stall(self._tracker.poll(), self.policy)
            if stall is None:
                seen_at = None
                continue
            seen_at = seen_at or time.monotonic()
            live = [s.rank for s in (stall.culprit, *stall.others) if not s.silent]
            if self.rank == min(live, default=self.rank) or time.monotonic() - seen_at > _REPORT_GRACE_S:
                self._report(stall)

    def _report(self, stall: heartbeat.Stall) -> None:
        path = heartbeat.write_failure(self.log_dir, stall.record())
        print(f"msdist: job failed: {stall.line()} (failure record: {path})", file=sys.stderr, flush=True)
        self._ask_local_ranks_for_stacks(stall)
        self._end(stall.line(), linger_s=_LINGER_S)

    def _ask_local_ranks_for_stacks(self, stall: heartbeat.Stall) -> None:
        """The other ranks on this host dump their stacks on STACK_DUMP_SIGNAL, answered in C: a rank whose
        main thread is stuck holding the Python lock cannot run its own watchdog to do it (seen under msrun)."""
        here = socket.gethostname()
        for state in (stall.culprit, *stall.others):
            pid = state.beat.get("pid")
            if state.rank == self.rank or state.beat.get("host") != here or not pid:
                continue
            with open(rank_log_path(self.log_dir, state.rank), "a", encoding="utf-8") as log:
                log.write(f"--- msdist: rank {self.rank} ended the job; Python stacks of every thread "
                          "(most recent call first) ---\n")
            try:
                os.kill(pid, heartbeat.STACK_DUMP_SIGNAL)
            except ProcessLookupError:  # it ended meanwhile
                pass

    def _end(self, why: str, linger_s: float) -> None:
        heartbeat_writer.dump_stacks(self.log_path, why)
        time.sleep(linger_s)
        os._exit(_EXIT_STALLED)  # pylint: disable=protected-access; the main thread may never run again


def watch_this_rank(log_dir: str, launch: LaunchEnv, policy: StallPolicy) -> heartbeat_writer.Heartbeat:
    """Start this rank's heartbeat, and its watchdog unless msdist.launch's supervisor watches the job.

    Args:
        log_dir: `{output_dir}/logs`.
        launch: how this process was started.
        policy: the stall options (`StallPolicy.from_options`).
    """
    beat = heartbeat_writer.Heartbeat(log_dir, launch.rank, policy).start()
    if needed(launch, policy):
        Watchdog(log_dir, launch.rank, launch.world_size, rank_log_path(log_dir, launch.rank), policy).start()
    return beat


def needed(launch: LaunchEnv, policy: StallPolicy) -> bool:
    """Whether this rank runs a watchdog: always, unless msdist.launch's supervisor watches or watching is off."""
    return launch.launcher != "msdist.launch" and policy.watches_progress
