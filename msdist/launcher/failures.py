"""How a failed attempt of msdist.launch is described: which process failed, how, where it was, and the end
of its traceback; which of several failures came first; the scheduler's account of a rank timed out elsewhere.

The supervisor (msdist.launcher.supervisor) finds the failures; this module turns them into the one line
and the traceback tail the user reads, and the record `logs/failure.json` keeps.
"""
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from msdist.base.errors import first_line
from msdist.cluster import heartbeat, rendezvous

_SCHEDULER_VERDICT_S = 2.0     # how long a failed attempt waits for the scheduler's own account
# MindSpore SIGTERMs the ranks of a broken cluster as soon as it times a node out, but its scheduler
# checks its nodes and exits only every 5 s (meta_server_node.cc Finalize): wait for that verdict longer.
_SCHEDULER_VERDICT_AFTER_SIGTERM_S = 8.0
_TRACEBACK_LINES = 12
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b")


@dataclass
class Failure:
    """Why an attempt failed: which process, how, and where it was."""
    rank: Optional[int]              # None: the scheduler
    how: str                         # "exit code 1", "killed by SIGKILL", "stalled: ..."
    beat: Optional[dict] = None
    tail: List[str] = field(default_factory=list)
    stalled: bool = False
    silent_since: float = 0.0        # a stalled rank's last sign of life (heartbeat or spawn), time.time()
    user_error: bool = False         # `msdist: error: ...`: bad option, config or data
    requeue: bool = False            # not a failure: every rank saved on a preemption and exited for a requeue
    reform: bool = False             # not a failure: an elastic job's membership changes (msdist.launcher.elastic)
    seen_at: float = field(default_factory=time.monotonic)   # when the launcher noticed
    stall: Optional[heartbeat.Stall] = None   # a job that stopped making progress: its own account

    def summary(self) -> str:
        if self.stall is not None:
            return self.stall.line()
        if self.requeue:
            return f"preempted: {self.how}"
        if self.reform:
            return self.how
        if self.rank is None:
            return f"the scheduler failed: {self.how}"
        if self.beat is None:
            where = "no heartbeat yet"
        elif self.beat["epoch"] == 0:
            where = "no training step yet (cluster init, compile or resume)"
        else:
            where = (f"last reported epoch {self.beat['epoch']} step {self.beat['step']} "
                     f"(global step {self.beat['global_step']}) in {self.beat.get('phase', '?')}")
        return f"rank {self.rank} failed: {self.how}; {where}"

    def record(self) -> dict:
        """The failure record's fields (heartbeat.write_failure)."""
        if self.stall is not None:
            return self.stall.record()
        return {"kind": "failure", "message": self.summary(), "rank": self.rank, "traceback": self.tail}


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _lines_since(path: str, offset: int, limit: int = 400) -> List[str]:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode("utf-8", errors="replace").splitlines()[-limit:]
    except OSError:
        return []


def traceback_tail(log_offsets: Dict[str, int]) -> List[str]:
    """The end of the last traceback (or else the last error line) written after the given offsets.

    Args:
        log_offsets: log path -> where this attempt began, in the order to search them.
    """
    for path, offset in log_offsets.items():
        lines = _lines_since(path, offset)
        starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
        if starts:
            block = lines[starts[-1]:]
            # End at the exception line: MindSpore appends pages of graph source after it.
            ends = [i for i, line in enumerate(block) if _EXCEPTION_LINE.match(line)]
            if not ends:
                return block[-_TRACEBACK_LINES:]
            end = ends[-1]
            exception = block[end]
            if exception.rstrip().endswith(":"):
                # MindSpore's RuntimeError puts its message below rulers and a heading: bring it up.
                exception = exception.rstrip() + " " + first_line("\n".join(block[end + 1:end + 12]))
            return [*block[:end], exception][-_TRACEBACK_LINES:]
        errors = [line for line in lines if " ERROR " in line or line.startswith("msdist: error")]
        if errors:
            return errors[-1:]
    return []


def first_cause(failures: List[Failure]) -> Failure:
    """A rank that died explains the others; among stalls, the rank silent the longest blocked the rest."""
    return min(failures, key=lambda f: (f.stalled, f.silent_since))


def with_cluster_cause(failure: Failure, scheduler: Optional[subprocess.Popen], log_dir: str) -> Failure:
    """On node 0, a local rank that died because MindSpore's cluster timed out a rank elsewhere: name
    that rank too (the scheduler says which, right before it exits)."""
    if scheduler is None or failure.rank is None or failure.how == "killed by SIGKILL":
        return failure  # a SIGKILLed rank is the cause itself (MindSpore ends ranks of a broken cluster by SIGTERM)
    try:
        scheduler.wait(timeout=_SCHEDULER_VERDICT_AFTER_SIGTERM_S if failure.how == "killed by SIGTERM"
                       else _SCHEDULER_VERDICT_S)
    except subprocess.TimeoutExpired:
        return failure
    cause = rendezvous.describe_timeout(rendezvous.scheduler_verdict(os.path.join(log_dir, "scheduler.log")))
    if cause:
        failure.how = f"{failure.how}, after {cause}"
    return failure
